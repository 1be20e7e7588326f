"""One decode step's cache write as one Pallas kernel (Triton lowering on GPU, interpret mode on
CPU): the new token's K and V into their pages, the partial page's running key sum (and, for
the Quest scorer, its running min and max), and the page's summaries when the token fills it.
The XLA reference is :func:`sparrow_jax.attention.paged_cache.append_token`, whose semantics
this matches bit for bit.

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


def kernel_limits(kv_heads: int, head_dim: int, q_heads: int | None = None) -> str | None:
    """Why the kernel cannot write a cache (None when it can): Triton blocks are powers of two
    (``q_heads``: the fused q/k-norm and RoPE's query heads too)."""
    sizes = dict(kv_heads=kv_heads, head_dim=head_dim)
    if q_heads is not None:
        sizes["q_heads"] = q_heads
    bad = {k: x for k, x in sizes.items() if x & (x - 1)}
    if bad:
        return (", ".join(f"{k} ({x})" for k, x in bad.items())
                + " must be powers of two (Triton block shapes)")
    return None


# A program's warps for the fused q/k-norm, RoPE and write: 2.4-2.5 us at 19 and 32 rows on the
# H100 against 2.8 with 4 warps and 4.4-4.8 with 1 (scripts/bench_prep_append.py, BENCHMARKS.md).
PREP_WARPS = 2


def _write_token(page, slot, k, v, old_sum, sum_ref, kp_ref, vp_ref, cent_ref, quest=(), *,
                 page_size):
    """k, v ``[H, D]`` into slot ``slot`` of page ``page`` (``num_pages``: no write), and the
    running sum ``old_sum`` ``[H, D]`` float32 of this row and layer updated into ``sum_ref``;
    the layer's pages ``[H, N, P, D]`` and centroids ``[H, N, D]`` (whole, aliased to the
    outputs). ``quest``: for a Quest cache, (old_min, old_max) ``[H, D]`` as loaded, their refs,
    then the layer's kmin and kmax ``[H, N, D]``, updated alike."""
    h, d = k.shape
    n = kp_ref.shape[1]
    write = page < n
    k = k.astype(kp_ref.dtype)                   # as stored: the sums are of stored keys
    v = v.astype(vp_ref.dtype)
    head = jax.lax.broadcasted_iota(jnp.int32, (h, d), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (h, d), 1)
    page_hd = jnp.broadcast_to(page, (h, d))
    slot_hd = jnp.broadcast_to(slot, (h, d))
    mask = jnp.broadcast_to(write, (h, d))
    plgpu.store(kp_ref.at[head, page_hd, slot_hd, col], k, mask=mask)
    plgpu.store(vp_ref.at[head, page_hd, slot_hd, col], v, mask=mask)
    new = jnp.where(slot == 0, jnp.float32(0), old_sum) + k.astype(jnp.float32)
    sum_ref[...] = jnp.where(write, new, old_sum)
    full = jnp.broadcast_to(write & (slot == page_size - 1), (h, d))
    plgpu.store(cent_ref.at[head, page_hd, col], (new / page_size).astype(cent_ref.dtype),
                mask=full)
    if quest:
        old_min, old_max, min_ref, max_ref, kmin_ref, kmax_ref = quest
        fresh = slot == 0
        for old, ref, summary_ref, op in ((old_min, min_ref, kmin_ref, jnp.minimum),
                                          (old_max, max_ref, kmax_ref, jnp.maximum)):
            new = jnp.where(fresh, k, op(old, k))
            ref[...] = jnp.where(write, new, old)
            plgpu.store(summary_ref.at[head, page_hd, col], new, mask=full)


def _cache_refs(refs):
    """The cache arrays' refs, each passed in and out (aliased): the outputs (sum, pages,
    centroids, then Quest's min, max, kmin, kmax) and the accumulators as loaded, each load
    before any store (a load is not moved above a store that may alias it)."""
    out = refs[len(refs) // 2:]                  # the inputs are the same buffers
    sum_ref, kp_ref, vp_ref, cent_ref, *quest = out
    old = [ref[...] for ref in (sum_ref, *quest[:2])]
    quest = (*old[1:], *quest) if quest else ()
    return old[0], (sum_ref, kp_ref, vp_ref, cent_ref, quest)


def _append_kernel(page_ref, slot_ref, k_ref, v_ref, *refs, page_size):
    """Grid (B,): page, slot ``[1]``; k, v ``[H, D]``; the cache arrays in and out
    (:func:`_cache_refs`); as :func:`_write_token`."""
    old_sum, outs = _cache_refs(refs)
    _write_token(page_ref[0], slot_ref[0], k_ref[...], v_ref[...], old_sum, *outs,
                 page_size=page_size)


def _load_projection(qkv_ref, head, col, dtype):
    """This row's projections at ``[head, col]``: from ``[heads, D]``, or summed over the
    split-K partials of ``[S, heads, D]`` float32 and rounded to ``dtype`` (as the projection
    itself rounds its float32 sum)."""
    if len(qkv_ref.shape) == 2:
        return plgpu.load(qkv_ref.at[head, col])
    split = jax.lax.broadcasted_iota(jnp.int32, (qkv_ref.shape[0], *head.shape), 0)
    parts = plgpu.load(qkv_ref.at[split, head[None], col[None]])
    return jnp.sum(parts, axis=0).astype(dtype)


def _load_heads(qkv_ref, first, heads, weight_ref, dtype):
    """Heads ``first .. first+heads-1`` of this row's projections ``[heads, D]`` and their
    rotate-half partners (column ``c`` holds column ``(c + D/2) % D``: Triton cannot slice a
    block, so the partners are a second gathered load), with the norm's weight in both orders."""
    d = qkv_ref.shape[-1]
    head = first + jax.lax.broadcasted_iota(jnp.int32, (heads, d), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (heads, d), 1)
    partner = (col + d // 2) % d
    return (_load_projection(qkv_ref, head, col, dtype),
            _load_projection(qkv_ref, head, partner, dtype),
            plgpu.load(weight_ref.at[col]), plgpu.load(weight_ref.at[partner]))


def _prep_heads(x, xp, w, wp, cos, sin, eps):
    """RMS-norm over D and RoPE (rotate-half) of ``x [heads, D]`` given its partners ``xp``, in
    the roundings of :class:`sparrow_jax.models.qk_prep.QKPrep`: the norm in float32, then the
    weight, the two products and their sum each in ``x``'s dtype."""
    dtype = x.dtype
    d = x.shape[-1]
    x, xp = x.astype(jnp.float32), xp.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
    normed = w.astype(dtype) * (x * scale).astype(dtype)
    partner = wp.astype(dtype) * (xp * scale).astype(dtype)
    col = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    rotated = jnp.where(col < d // 2, -partner, partner)
    return normed * cos.astype(dtype) + rotated * sin.astype(dtype)


def _prep_append_kernel(page_ref, slot_ref, qkv_ref, qw_ref, kw_ref, cos_ref, sin_ref, *refs,
                        page_size, eps):
    """Grid (B,): this row's projections ``qkv [Hq + 2 Hkv, D]`` (q heads, then k, then v), or
    their split-K partial sums ``[S, Hq + 2 Hkv, D]`` float32;
    q/k-norm weights ``[D]``; cos, sin ``[1, D]``; the cache arrays in, q out ``[Hq, D]``, the
    cache arrays out (:func:`_cache_refs`); as :func:`_write_token`. Every load comes before
    any store: a load is not moved above a store that may alias it, and the first build, which
    loaded k after storing q, took 6.2 us a layer on the H100 against 2.4 (BENCHMARKS.md,
    "Rollout", run H)."""
    n = len(refs) // 2
    q_ref = refs[n]
    kp_ref = refs[n + 2]
    hq, hk = q_ref.shape[0], kp_ref.shape[0]
    d = qkv_ref.shape[-1]
    dt = q_ref.dtype
    q_in = _load_heads(qkv_ref, 0, hq, qw_ref, dt)
    k_in = _load_heads(qkv_ref, hq, hk, kw_ref, dt)
    v = _load_projection(qkv_ref, hq + hk + jax.lax.broadcasted_iota(jnp.int32, (hk, d), 0),
                         jax.lax.broadcasted_iota(jnp.int32, (hk, d), 1), dt)
    cos, sin = cos_ref[...], sin_ref[...]
    old_sum, outs = _cache_refs(refs[:n] + refs[n + 1:])
    page, slot = page_ref[0], slot_ref[0]
    q_ref[...] = _prep_heads(*q_in, cos, sin, eps)
    _write_token(page, slot, _prep_heads(*k_in, cos, sin, eps), v, old_sum, *outs,
                 page_size=page_size)


def _cache_specs(layer, heads, num_pages, page_size, d, quest):
    """BlockSpecs of the cache arrays a program sees: its row of the layer's accumulators, the
    layer's pages and summaries whole (sum, K, V, centroids, then Quest's min, max, kmin,
    kmax)."""
    acc = pl.BlockSpec((None, None, heads, d), lambda i: (layer, i, 0, 0))
    pages = pl.BlockSpec((heads, num_pages, page_size, d), lambda i: (0, 0, 0, 0))
    summary = pl.BlockSpec((heads, num_pages, d), lambda i: (0, 0, 0))
    return [acc, pages, pages, summary] + ([acc, acc, summary, summary] if quest else [])


@functools.partial(jax.jit, static_argnames=("layer", "page_size", "interpret"))
def append_token_pallas(page, slot, k, v, partial_sum, k_pages, v_pages, centroids, quest=(), *,
                        layer, page_size, interpret=False):
    """page, slot ``[B]`` int32 (page ``N`` = the pool's size: this row writes nothing);
    k, v ``[B, H, D]``; partial_sum ``[L, B, H, D]`` float32 (row ``layer`` is this layer's);
    k_pages, v_pages ``[H, N, P, D]``; centroids ``[H, N, D]``; ``quest``, for a Quest cache:
    (partial_min, partial_max ``[L, B, H, D]``, kmin, kmax ``[H, N, D]``) in the cache dtype ->
    the cache arrays (partial_sum to centroids, then those of ``quest``), updated in place
    where their buffers are donated or dead (inside a jitted step), else copied first. ``page``
    and ``slot`` come from :func:`sparrow_jax.attention.paged_cache.append_token`."""
    b, h, d = k.shape
    num_pages = k_pages.shape[1]
    row = pl.BlockSpec((1,), lambda i: (i,))
    per_row = pl.BlockSpec((None, h, d), lambda i: (i, 0, 0))
    cache = (partial_sum, k_pages, v_pages, centroids, *quest)
    specs = _cache_specs(layer, h, num_pages, page_size, d, quest)
    return pl.pallas_call(
        functools.partial(_append_kernel, page_size=page_size),
        grid=(b,),
        in_specs=[row, row, per_row, per_row, *specs],
        out_specs=specs,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in cache],
        input_output_aliases={4 + i: i for i in range(len(cache))},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="paged_append",
    )(page, slot, k, v, *cache)


@functools.partial(jax.jit, static_argnames=("layer", "page_size", "eps", "num_warps",
                                             "dtype", "interpret"))
def prep_append_token_pallas(page, slot, qkv, q_weight, k_weight, cos, sin, partial_sum,
                             k_pages, v_pages, centroids, quest=(), *, layer, page_size, eps,
                             num_warps=None, dtype=None, interpret=False):
    """:func:`append_token_pallas` with q/k-norm and RoPE done in the same kernel.

    qkv ``[B, Hq + 2 Hkv, D]``: each row's projected queries, keys and values, as the
    projections give them; or, where ``dtype`` is given (the projections' own: the sums are
    rounded to it, as the projections round theirs, and q comes out in it), their split-K
    partial sums ``[S, R >= B, (Hq + 2 Hkv) * D]`` float32 as
    :func:`pallas_kernels.decode_gemm_gpu.gemm_partials_pallas` leaves them, so that their sum
    is not a launch of its own;
    q_weight, k_weight ``[D]`` the norms' weights; cos, sin ``[B, D]``
    float32 (this token's angles); the rest as :func:`append_token_pallas`. -> (q ``[B, Hq, D]``
    normed and rotated, then the cache arrays as there). The keys written are normed and
    rotated. ``num_warps``: a program's warps (scripts/bench_prep_append.py sweeps them;
    default :data:`PREP_WARPS`, twice that for partial sums, whose tiles at 2 warps spill)."""
    hk, num_pages, _, d = k_pages.shape
    b = page.shape[0]
    if dtype is None:
        heads, dtype = qkv.shape[1], qkv.dtype
        whole_row = pl.BlockSpec((None, heads, d), lambda i: (i, 0, 0))
    else:
        splits, heads = qkv.shape[0], qkv.shape[2] // d
        if qkv.dtype != jnp.float32 or qkv.shape[1] < b:
            raise ValueError(f"prep_append_token_pallas: partial sums are float32 [S, R >= {b}, "
                             f"heads * {d}], got {qkv.shape} {qkv.dtype}")
        qkv = qkv.reshape(splits, qkv.shape[1], heads, d)      # free: a view of the same rows
        whole_row = pl.BlockSpec((splits, None, heads, d), lambda i: (0, i, 0, 0))
    hq = heads - 2 * hk
    row = pl.BlockSpec((1,), lambda i: (i,))
    weight = pl.BlockSpec((d,), lambda i: (0,))
    angle = pl.BlockSpec((1, d), lambda i: (i, 0))
    q_out = pl.BlockSpec((None, hq, d), lambda i: (i, 0, 0))
    cache = (partial_sum, k_pages, v_pages, centroids, *quest)
    specs = _cache_specs(layer, hk, num_pages, page_size, d, quest)
    return pl.pallas_call(
        functools.partial(_prep_append_kernel, page_size=page_size, eps=eps),
        grid=(b,),
        in_specs=[row, row, whole_row, weight, weight, angle, angle, *specs],
        out_specs=[q_out, *specs],
        out_shape=[jax.ShapeDtypeStruct((b, hq, d), dtype)]
        + [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in cache],
        input_output_aliases={7 + i: 1 + i for i in range(len(cache))},
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or PREP_WARPS * (1 if qkv.ndim == 3 else 2), num_stages=1),
        interpret=interpret, name="paged_prep_append",
    )(page, slot, qkv, q_weight, k_weight, cos, sin, *cache)
