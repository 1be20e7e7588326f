"""Dense paged decode on TPU: JAX's Pallas TPU paged attention behind the contract of
:func:`sparrow_jax.attention.paged_dense.paged_attention_xla`.

The kernel (``jax.experimental.pallas.ops.tpu.paged_attention``) reads this project's head-major
pool ``[Hkv, N, P, D]`` directly: each row's lengths and page indices are scalar-prefetched into
SMEM, ``pages_per_compute_block`` pages are copied HBM -> VMEM per step, double-buffered, and
only the blocks below a row's length are entered. What this wrapper adds to match the contract:

* the softmax scale ``D**-0.5`` folded into q (the kernel applies none);
* the page table padded with page 0 to a multiple of the block, and clipped into ``[0, N)``:
  the kernel copies every page of a block it enters, also those past the row's length;
* lengths clipped to the table's capacity (the XLA path reads at most ``M * P`` keys);
* rows of length 0 (padding) give zeros: the kernel never writes them (the XLA path averages
  the masked values instead; no caller reads those rows).

Its dots run at the chip's default precision, which for float32 inputs is a bfloat16 pass
(TPU interpret mode on CPU reproduces errors of ~5e-3): :mod:`sparrow_jax.attention.paged_dense`
picks it only for half-precision caches. On a two-TensorCore chip (v5p) the grid is split
across both cores by KV head (or by row when the KV heads are odd).
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

LANES = 128
# Tokens per compute block: vLLM TPU's default block of 256 tokens keeps few DMAs in flight.
BLOCK_TOKENS = 256


def kernel_limits(head_dim: int, page_size: int, dtype) -> str | None:
    """Why the TPU paged attention cannot take these static shapes, or None if it can.

    A page is copied as one ``(page_size, head_dim)`` tile: head_dim must fill whole 128-lane
    rows, and page_size whole sublane tiles (8 rows of 4-byte values, 16 of 2-byte ones)."""
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize not in (2, 4):
        return f"cache dtype {jnp.dtype(dtype).name} is not a 2- or 4-byte float"
    if head_dim % LANES:
        return f"head_dim {head_dim} is not a multiple of {LANES}"
    rows = 32 // itemsize
    if page_size % rows:
        return f"page_size {page_size} is not a multiple of {rows} for {jnp.dtype(dtype).name}"
    return None


def tensorcores() -> int:
    """TensorCores one device drives on the TPU being lowered for: the abstract TPU of
    :func:`pallas_kernels.tpu_targets.abstract_tpu` when in one, else the local TPU, else 1."""
    dev = jax.sharding.get_abstract_mesh().abstract_device
    if dev is not None and dev.platform == "tpu":
        return dev.num_cores or 1
    local = jax.devices()[0]
    if local.platform != "tpu":
        return 1
    return getattr(local, "num_cores", None) or 1


def megacore_mode(kv_heads: int, batch: int, cores: int) -> str | None:
    """The kernel's split across ``cores`` TensorCores: by KV head when they pair up, else by
    row. None on one core: the kernel hangs if told to split on a chip that cannot."""
    if cores < 2:
        return None
    if kv_heads % 2 == 0:
        return "kv_head"
    return "batch" if batch % 2 == 0 else None


def block_pages(page_size: int, table_pages: int) -> int:
    """Pages per compute block: ``BLOCK_TOKENS`` worth, at most the table's width."""
    return max(1, min(BLOCK_TOKENS // page_size, table_pages))


def paged_attention_tpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        page_table: jax.Array, lengths: jax.Array, *,
                        pages_per_compute_block: int | None = None,
                        interpret: bool = False) -> jax.Array:
    """q ``[B, Hq, D]``, k/v_pages ``[Hkv, N, P, D]``, page_table ``[B, M]`` int32, lengths
    ``[B]`` (current token included) -> ``[B, Hq, D]`` in q's dtype.

    ``interpret``: run in TPU interpret mode (CPU tests; DMAs and semaphores simulated).
    Callers check shapes with :func:`kernel_limits` first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    b, hq, d = q.shape
    h, n, p, _ = k_pages.shape
    m = page_table.shape[1]
    block = pages_per_compute_block or block_pages(p, m)
    width = -(-m // block) * block
    table = jnp.clip(jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, width - m))), 0, n - 1)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, m * p)
    scaled = (q.astype(jnp.float32) * d ** -0.5).astype(k_pages.dtype)
    mode = megacore_mode(h, b, 1 if interpret else tensorcores())
    ctx = (pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()) if interpret
           else contextlib.nullcontext())
    with ctx:
        out = paged_attention(scaled, k_pages, v_pages, lengths, table,
                              pages_per_compute_block=block, megacore_mode=mode)
    return jnp.where((lengths > 0)[:, None, None], out, 0).astype(q.dtype)
