"""Dense decode attention over the paged KV cache (one query token per sequence, one layer).

Implementations with one contract (float32 softmax, scale ``head_dim**-0.5``, keys masked by
``lengths``, GQA: query heads ``h*r .. h*r+r-1`` read KV head h):

* ``"xla"``: gathers the rows' pages through the page table and runs two einsums. The CPU
  default and the reference.
* ``"pallas"``: the attention kernel of the sparse GPU step
  (:func:`pallas_kernels.paged_attend_gpu.attend_table`) over each row's whole page table:
  a row's splits share the pages below its length, so short rows in a wide table (continuous
  refill) cost their length, and a GQA group's heads are not padded to 16 rows.
* ``"pallas_jax"``: JAX's Pallas GPU paged attention (``jax.experimental.pallas.ops.gpu``), the
  baseline the kernel above replaced: its programs are per ``W / k_splits`` pages of the
  table whatever the row's length, and it writes 16 rows of partial results a group.
* ``"pallas_tpu"``: JAX's Pallas TPU paged attention, wrapped in
  :mod:`pallas_kernels.paged_dense_tpu` (head_dim a multiple of 128, whole sublane tiles per
  page); off TPU it runs in TPU interpret mode (tests).

``"auto"`` picks :data:`GPU_DEFAULT` on GPU for half-precision caches whose shapes its kernel
takes (the fastest in scripts/bench_paged_dense.py on the H100, see BENCHMARKS.md),
``"pallas_tpu"`` on TPU for half-precision caches whose shapes it takes, and ``"xla"``
elsewhere: float32 stays on XLA, since Triton's dots may round float32 inputs to TF32
and the TPU kernel's to bfloat16. Off GPU the TPU choice is made when lowering
(``lax.platform_dependent``), so a step exported for TPU from a CPU host holds the TPU kernel.
This module needs only jax (the benchmark runs it on a machine without flax).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

IMPLS = ("auto", "xla", "pallas", "pallas_jax", "pallas_tpu")
# Measured on the H100 (BENCHMARKS.md, "Dense paged decode").
GPU_DEFAULT = "pallas"
# Finite, so a row with no valid key (length 0, a padding row) averages instead of giving NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """One layer's pages ``[H, N, P, D]`` read through ``page_table [B, n]`` ->
    ``[B, H, n * P, D]``: each row's keys (or values) in position order."""
    h, _, p, d = pages.shape
    b, n = page_table.shape
    g = jnp.take(pages, page_table, axis=1, mode="clip")   # [H, B, n, P, D]
    return jnp.swapaxes(g, 0, 1).reshape(b, h, n * p, d)


def _check(q, k_pages, v_pages, page_table, lengths):
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(f"q must be [batch, q_heads, head_dim] and k_pages [kv_heads, pages, "
                         f"page_size, head_dim], got {q.shape} and {k_pages.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    b, hq, d = q.shape
    h = k_pages.shape[0]
    if hq % h or k_pages.shape[-1] != d:
        raise ValueError(f"q {q.shape} does not fit k_pages {k_pages.shape}: q heads must be a "
                         f"multiple of kv heads and head_dim equal")
    if page_table.ndim != 2 or page_table.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"page_table must be [{b}, pages] and lengths [{b}], got "
                         f"{page_table.shape} and {lengths.shape}")


def paged_attention_xla(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        page_table: jax.Array, lengths: jax.Array) -> jax.Array:
    """q ``[B, Hq, D]``, k/v_pages ``[H, N, P, D]``, page_table ``[B, M]``, lengths ``[B]`` ->
    ``[B, Hq, D]`` in q's dtype. Reads all M pages of each row (masked past its length)."""
    b, hq, d = q.shape
    h = k_pages.shape[0]
    k = gather_pages(k_pages, page_table)
    v = gather_pages(v_pages, page_table)
    qg = q.reshape(b, h, hq // h, d).astype(k.dtype)
    s = jnp.einsum("bhrd,bhsd->bhrs", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
    valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
    s = jnp.where(valid[:, None, None, :], s, _MASK_VALUE)
    w = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhrs,bhsd->bhrd", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, hq, d).astype(q.dtype)


def paged_attention_pallas(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           page_table: jax.Array, lengths: jax.Array, *, tuning=None,
                           interpret: bool = False) -> jax.Array:
    """The sparse GPU step's attention kernel over each row's page table, behind the same
    contract as :func:`paged_attention_xla`; ``tuning``: a
    :class:`pallas_kernels.sparse_decode_gpu.GpuDecodeTuning` (None: its defaults; splits
    unset: :func:`~pallas_kernels.paged_attend_gpu.table_splits`)."""
    from pallas_kernels.paged_attend_gpu import attend_table, table_splits
    from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, default_block_pages,
                                                  kernel_limits)
    page_size = k_pages.shape[2]
    why = kernel_limits(q.shape[-1], page_size)
    if why is not None:
        raise ValueError(f"paged_attention(impl='pallas'): {why}; use impl='xla'")
    b, width = page_table.shape
    tuning = tuning or GpuDecodeTuning()
    block = tuning.block_pages or default_block_pages(page_size)
    # Even splits unless asked (table_splits already gives a lone long row many): the balanced
    # attention was not measured end to end for dense decode (BENCHMARKS.md, run O).
    tuning = dataclasses.replace(tuning, block_pages=block, balanced=bool(tuning.balanced),
                                 splits=tuning.splits or table_splits(b, k_pages.shape[0],
                                                                      width, block))
    return attend_table(q, k_pages, v_pages, page_table.astype(jnp.int32),
                        lengths.astype(jnp.int32), page_size=page_size, tuning=tuning,
                        interpret=interpret)


def paged_attention_pallas_jax(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                               page_table: jax.Array, lengths: jax.Array, *,
                               pages_per_compute_block: int = 8, k_splits: int = 16,
                               interpret: bool = False) -> jax.Array:
    """JAX's Pallas GPU paged attention behind the same contract as :func:`paged_attention_xla`.

    Its kernel needs the table width to be a multiple of ``k_splits * pages_per_compute_block``
    (both shrunk to fit short tables); the table is padded with page 0, which it never reads
    past a row's length.
    """
    import warnings

    with warnings.catch_warnings():  # the module warns that it is deprecated on import
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    block, k_splits, width = pallas_blocks(page_table.shape[1], pages_per_compute_block,
                                           k_splits)
    table = jnp.pad(page_table, ((0, 0), (0, width - page_table.shape[1])))
    # Its kernel applies no softmax scale: fold it into q (one more rounding of q in the cache
    # dtype unless sqrt(head_dim) is a power of two).
    scaled = (q.astype(jnp.float32) * q.shape[-1] ** -0.5).astype(k_pages.dtype)
    out = paged_attention(scaled, k_pages, v_pages, table, lengths.astype(jnp.int32),
                          pages_per_compute_block=block, k_splits=k_splits,
                          interpret=interpret)
    return out.astype(q.dtype)


def _floor_pow2(x: int) -> int:
    return 1 << (max(x, 1).bit_length() - 1)


def pallas_blocks(m: int, pages_per_compute_block: int, k_splits: int) -> tuple[int, int, int]:
    """-> (pages per block, splits, padded table width) for a table of ``m`` pages: both
    shrunk to fit short tables and rounded down to powers of two (Triton's arrays must have
    power-of-two sizes), the width a multiple of their product."""
    block = _floor_pow2(min(pages_per_compute_block, m))
    k_splits = _floor_pow2(max(1, min(k_splits, m // block)))
    return block, k_splits, -(-m // (k_splits * block)) * k_splits * block


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    page_table: jax.Array, lengths: jax.Array, *, impl: str = "auto"
                    ) -> jax.Array:
    """Dense decode attention over the paged cache: q ``[B, Hq, D]``, k/v_pages ``[H, N, P,
    D]``, page_table ``[B, M]`` int32, lengths ``[B]`` int32 (current token included) ->
    ``[B, Hq, D]``."""
    _check(q, k_pages, v_pages, page_table, lengths)
    args = (q, k_pages, v_pages, page_table, lengths)
    head_dim, page_size, dtype = q.shape[-1], k_pages.shape[2], k_pages.dtype
    chosen = resolve_impl(impl, head_dim, page_size, dtype)
    if chosen == "pallas":
        return paged_attention_pallas(*args)
    if chosen == "pallas_jax":
        return paged_attention_pallas_jax(*args)
    if chosen == "pallas_tpu":
        return _tpu(*args, interpret=jax.default_backend() != "tpu")
    if impl == "auto" and jax.default_backend() != "gpu" and resolve_impl(
            impl, head_dim, page_size, dtype, platform="tpu") == "pallas_tpu":
        # Decided when lowering, per platform: lowered for CPU only the XLA path is compiled.
        return lax.platform_dependent(*args, tpu=_tpu, default=paged_attention_xla)
    return paged_attention_xla(*args)


def _tpu(*args, interpret=False):
    from pallas_kernels.paged_dense_tpu import paged_attention_tpu

    return paged_attention_tpu(*args, interpret=interpret)


def resolve_impl(impl: str, head_dim: int, page_size: int, dtype,
                 platform: str | None = None) -> str:
    """The implementation ``paged_attention(impl=...)`` runs on ``platform`` (default
    ``jax.default_backend()``): one of :data:`IMPLS` but ``"auto"``.

    ``"auto"``: the platform's kernel for half-precision caches whose shapes it takes, else
    ``"xla"``. A named ``"pallas_tpu"`` that cannot take the shapes raises ValueError."""
    if impl not in IMPLS:
        raise ValueError(f"unknown dense paged attention impl {impl!r}; known: {IMPLS}")
    from pallas_kernels.paged_dense_tpu import kernel_limits

    why = kernel_limits(head_dim, page_size, dtype)
    if impl == "auto":
        platform = platform or jax.default_backend()
        if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
            return "xla"
        if platform == "gpu":
            from pallas_kernels.sparse_decode_gpu import kernel_limits as gpu_limits
            return GPU_DEFAULT if gpu_limits(head_dim, page_size) is None else "xla"
        return "pallas_tpu" if platform == "tpu" and why is None else "xla"
    if impl == "pallas_tpu" and why is not None:
        raise ValueError(f"paged_attention(impl='pallas_tpu'): {why}; use impl='xla' (or "
                         "'auto', which falls back to it)")
    return impl
