"""One decode step's cache write as one Pallas kernel (Triton lowering on GPU, interpret mode on
CPU): the new token's K and V into their pages, the partial page's running key sum, and the
page's centroid when the token fills it. The XLA reference is
:func:`sparrow_jax.attention.paged_cache.append_token`, whose semantics this matches bit for bit.

Why a kernel: XLA writes the token as four small kernels a layer (a scatter each for K, V and the
centroid, and an update of the running sums), each a few microseconds for a few kilobytes; on the
H100 at 19 rows they took ~10 us a layer, ~270 us of a decode step, in both modes (BENCHMARKS.md,
"Rollout"). Here a program per row writes all of it in place (the cache arrays are aliased to
the outputs, so nothing is copied).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def kernel_limits(kv_heads: int, head_dim: int) -> str | None:
    """Why the kernel cannot write a cache (None when it can): Triton blocks are powers of two."""
    if kv_heads & (kv_heads - 1) or head_dim & (head_dim - 1):
        return (f"kv_heads ({kv_heads}) and head_dim ({head_dim}) must be powers of two "
                "(Triton block shapes)")
    return None


def _append_kernel(page_ref, slot_ref, k_ref, v_ref, sum_in, kp_in, vp_in, cent_in,
                   sum_ref, kp_ref, vp_ref, cent_ref, *, page_size):
    """Grid (B,): page (``num_pages``: no write), slot ``[1]``; k, v ``[H, D]``; the running sum
    ``[H, D]`` float32 of this row and layer; the layer's pages ``[H, N, P, D]`` and centroids
    ``[H, N, D]`` (whole, aliased to the outputs)."""
    del sum_in, kp_in, vp_in, cent_in            # the same buffers as the outputs
    h, d = k_ref.shape
    n = kp_ref.shape[1]
    page = page_ref[0]
    slot = slot_ref[0]
    write = page < n
    k = k_ref[...].astype(kp_ref.dtype)          # as stored: the sums are of stored keys
    v = v_ref[...].astype(vp_ref.dtype)
    head = jax.lax.broadcasted_iota(jnp.int32, (h, d), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (h, d), 1)
    page_hd = jnp.broadcast_to(page, (h, d))
    slot_hd = jnp.broadcast_to(slot, (h, d))
    mask = jnp.broadcast_to(write, (h, d))
    plgpu.store(kp_ref.at[head, page_hd, slot_hd, col], k, mask=mask)
    plgpu.store(vp_ref.at[head, page_hd, slot_hd, col], v, mask=mask)
    old = sum_ref[...]
    new = jnp.where(slot == 0, jnp.float32(0), old) + k.astype(jnp.float32)
    sum_ref[...] = jnp.where(write, new, old)
    full = jnp.broadcast_to(write & (slot == page_size - 1), (h, d))
    plgpu.store(cent_ref.at[head, page_hd, col], (new / page_size).astype(cent_ref.dtype),
                mask=full)


@functools.partial(jax.jit, static_argnames=("layer", "page_size", "interpret"))
def append_token_pallas(page, slot, k, v, partial_sum, k_pages, v_pages, centroids, *, layer,
                        page_size, interpret=False):
    """page, slot ``[B]`` int32 (page ``N`` = the pool's size: this row writes nothing);
    k, v ``[B, H, D]``; partial_sum ``[L, B, H, D]`` float32 (row ``layer`` is this layer's);
    k_pages, v_pages ``[H, N, P, D]``; centroids ``[H, N, D]`` -> the last four, updated in
    place where their buffers are donated or dead (inside a jitted step), else copied first.
    ``page`` and ``slot`` come from :func:`sparrow_jax.attention.paged_cache.append_token`."""
    b, h, d = k.shape
    num_pages = k_pages.shape[1]
    row = pl.BlockSpec((1,), lambda i: (i,))
    per_row = pl.BlockSpec((None, h, d), lambda i: (i, 0, 0))
    sums = pl.BlockSpec((None, None, h, d), lambda i: (layer, i, 0, 0))
    pages = pl.BlockSpec((h, num_pages, page_size, d), lambda i: (0, 0, 0, 0))
    cents = pl.BlockSpec((h, num_pages, d), lambda i: (0, 0, 0))
    return pl.pallas_call(
        functools.partial(_append_kernel, page_size=page_size),
        grid=(b,),
        in_specs=[row, row, per_row, per_row, sums, pages, pages, cents],
        out_specs=[sums, pages, pages, cents],
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype)
                   for a in (partial_sum, k_pages, v_pages, centroids)],
        input_output_aliases={4: 0, 5: 1, 6: 2, 7: 3},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="paged_append",
    )(page, slot, k, v, partial_sum, k_pages, v_pages, centroids)
