"""Attention over selected page lists as a Mosaic GPU kernel (Hopper): pages gathered by TMA.

The attention part of the sparse decode step (docs/design.md, section 3), the same inputs and
result as :func:`pallas_kernels.paged_attend_gpu.attend_page_lists`: the page lists of
:func:`~pallas_kernels.sparse_decode_gpu.select_page_lists`, attended with online softmax,
split into ``splits`` parts merged by :func:`~pallas_kernels.paged_attend_gpu.merge_splits`.

Why a second kernel: the Triton-lowered one gathers each 4 KB page with computed pointers
into registers; here each page of K and of V is one TMA copy into shared memory, ``stages -
1`` blocks of ``block_pages`` pages in flight per program while the matrix unit works on the
current one. Hopper's matrix instructions take 64 rows: a KV head's query heads are padded
to 64 (the extra products are cheap next to the page reads). Measured, it is 12-24% slower
than the Pallas attention on an H100 (BENCHMARKS.md, run J), and a Triton attention with one
TMA copy a page, launched with the global scratch that jaxlib does not pass, is no faster
either (run AF): Hopper's TMA copies one page at a time, no gather. Kept as the Mosaic GPU
reference for that comparison (``bench_decode.py --breakdown`` times it); not what
``impl="auto"`` runs.

Grid (B, Hkv, splits), one warpgroup a program::

    fetch blocks 0 .. stages-2 of this split (K and V pages, one TMA copy each)
    for block i: fetch block i + stages - 1 into the slot block i - 1 used; wait for block i;
        logits = q . K^T (masked: past the list's count, or past the sequence's length);
        online softmax; acc += p . V
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.paged_attend_gpu import merge_splits, pow2

ROWS = 64    # rows of a Hopper matrix instruction (wgmma)
# Finite, so that a row with no tokens keeps max = MASK_VALUE and sum 0 (merged to zeros).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_mgpu_attend(q_pad, k_pages, *, page_size: int, block_pages: int, splits: int,
                      stages: int) -> None:
    """ValueError naming what this kernel cannot take."""
    d, rpad = q_pad.shape[-1], q_pad.shape[-2]
    dtypes = {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}
    if jnp.dtype(k_pages.dtype) not in dtypes or jnp.dtype(q_pad.dtype) != k_pages.dtype:
        raise ValueError(f"attend_page_lists_mgpu takes a bfloat16 or float16 cache and queries "
                         f"of its dtype, got {k_pages.dtype} and {q_pad.dtype}")
    if d % 64:
        raise ValueError(f"attend_page_lists_mgpu needs head_dim a multiple of 64, got {d}")
    if rpad > ROWS:
        raise ValueError(f"attend_page_lists_mgpu takes at most {ROWS} query heads a KV head, "
                         f"got {rpad}")
    if page_size % 8 or (page_size * block_pages) % 64:
        raise ValueError(f"attend_page_lists_mgpu needs page_size a multiple of 8 and "
                         f"page_size x block_pages a multiple of 64, got {page_size} x "
                         f"{block_pages}")
    if splits < 1 or stages < 2:
        raise ValueError(f"attend_page_lists_mgpu needs splits >= 1 and stages >= 2, got "
                         f"{splits} and {stages}")


def attend_page_lists_mgpu(q_pad, group, k_pages, v_pages, phys, slots, count, lengths, *,
                           page_size: int, splits: int, block_pages: int = 4, stages: int = 2,
                           interpret: bool = False):
    """q_pad ``[B, Hkv, Rpad, D]`` with ``group`` real heads, pages ``[Hkv, N, P, D]``, the
    page lists phys, slots ``[B, Hkv, L]`` and count ``[B, Hkv, 1]`` (entries past the count
    are never read), lengths ``[B]`` -> ``[B, Hkv * group, D]`` in q's dtype. ``interpret``:
    Mosaic GPU's interpret mode (CPU)."""
    check_mgpu_attend(q_pad, k_pages, page_size=page_size, block_pages=block_pages,
                      splits=splits, stages=stages)
    o, mx, l = _attend(q_pad, k_pages, v_pages, phys.astype(jnp.int32),
                       slots.astype(jnp.int32), count[..., 0].astype(jnp.int32),
                       lengths.astype(jnp.int32), page_size=page_size, splits=splits,
                       block_pages=block_pages, stages=stages, interpret=interpret)
    return merge_splits(o, mx, l, group).astype(q_pad.dtype)


@functools.partial(jax.jit, static_argnames=("page_size", "splits", "block_pages", "stages",
                                             "interpret"))
def _attend(q_pad, k_pages, v_pages, phys, slots, count, lengths, *, page_size, splits,
            block_pages, stages, interpret):
    b, hkv, rpad, d = q_pad.shape
    p, bp = page_size, block_pages
    bt = p * bp
    scale = d ** -0.5
    q64 = jnp.pad(q_pad, ((0, 0), (0, 0), (0, ROWS - rpad), (0, 0)))

    def body(q_ref, k_ref, v_ref, phys_ref, slots_ref, count_ref, len_ref, o_ref, m_ref, l_ref,
             q_smem, k_smem, v_smem, p_smem, o_smem, ml_smem, q_bar, k_bar, v_bar):
        bi, hi, si = (lax.axis_index(a) for a in "bhs")
        cnt, length = count_ref[bi, hi], len_ref[bi]
        blocks = (cnt + bp - 1) // bp
        per = (blocks + splits - 1) // splits
        first = si * per
        n = jnp.maximum(jnp.minimum(first + per, blocks) - first, 0)

        def fetch(i, slot):
            for j in range(bp):
                # Entries past the count (the last block's tail) fetch the last listed page
                # again: a valid address whatever the list holds there; never attended.
                page = phys_ref[bi, hi, jnp.minimum((first + i) * bp + j, cnt - 1)]
                dst = pl.ds(j * p, p)
                plgpu.copy_gmem_to_smem(k_ref.at[hi, page], k_smem.at[slot, dst], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[hi, page], v_smem.at[slot, dst], v_bar.at[slot])

        plgpu.copy_gmem_to_smem(q_ref.at[bi, hi], q_smem, q_bar)
        for i in range(stages - 1):
            pl.when(i < n)(functools.partial(fetch, i, i))
        plgpu.barrier_wait(q_bar)
        token = plgpu.broadcasted_iota(jnp.int32, (ROWS, bt), 1, layout=plgpu.Layout.WGMMA)

        def step(i, carry):
            acc, m, l = carry
            slot = lax.rem(i, stages)
            ahead = i + stages - 1
            # The slot block i - 1 used: its matrix products have completed.
            pl.when(ahead < n)(lambda: fetch(ahead, lax.rem(ahead, stages)))
            plgpu.barrier_wait(k_bar.at[slot])

            def qk(ref):
                plgpu.wgmma(ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma_wait(0)
                return ref[...]

            logits = pl.run_scoped(qk, plgpu.ACC((ROWS, bt), jnp.float32))
            # Tokens of entry e: attended while e < count and slot * P + t < length.
            keep = jnp.zeros((ROWS, bt), jnp.bool_)
            for j in range(bp):
                e = (first + i) * bp + j
                room = jnp.where(e < cnt, length - slots_ref[bi, hi, jnp.minimum(e, cnt - 1)] * p,
                                 0)
                t = token - j * p
                keep = keep | ((t >= 0) & (t < jnp.minimum(room, p)))
            logits = jnp.where(keep, logits * scale, -jnp.inf)
            m_new = jnp.maximum(m, logits.max(axis=1))
            corr = jnp.exp(m - m_new)
            probs = jnp.exp(logits - lax.broadcast_in_dim(m_new, logits.shape, [0]))
            l = l * corr + probs.sum(axis=1)
            p_smem[...] = probs.astype(p_smem.dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])

            def pv(ref):
                plgpu.wgmma(ref, p_smem, v_smem.at[slot])
                plgpu.wgmma_wait(0)
                return ref[...]

            acc = (acc * lax.broadcast_in_dim(corr, acc.shape, [0])
                   + pl.run_scoped(pv, plgpu.ACC((ROWS, d), jnp.float32)))
            return acc, m_new, l

        rows = plgpu.Layout.WGMMA.reduce(1)
        acc, m, l = lax.fori_loop(0, n, step, (
            plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), rows),
            plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), rows)))
        o_smem[...] = acc
        ml_smem[0] = m
        ml_smem[1] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[bi, hi, si])
        plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[bi, hi, si])
        plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[bi, hi, si])
        plgpu.wait_smem_to_gmem(0)

    # 128-byte swizzled 8 x 64 tiles: the layout the matrix unit reads from shared memory.
    layout = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    dtype = k_pages.dtype
    per_split = (b, hkv, splits, ROWS)
    o, mx, l = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(per_split + (d,), jnp.float32),
                  jax.ShapeDtypeStruct(per_split, jnp.float32),
                  jax.ShapeDtypeStruct(per_split, jnp.float32)),
        scratch_types=[plgpu.SMEM((ROWS, d), dtype, transforms=layout),
                       plgpu.SMEM((stages, bt, d), dtype, transforms=layout),
                       plgpu.SMEM((stages, bt, d), dtype, transforms=layout),
                       plgpu.SMEM((ROWS, bt), dtype, transforms=layout),
                       plgpu.SMEM((ROWS, d), jnp.float32),
                       plgpu.SMEM((2, ROWS), jnp.float32),
                       plgpu.Barrier(num_arrivals=1),
                       # One arrival per page copied into the slot.
                       plgpu.Barrier(num_arrivals=bp, num_barriers=stages),
                       plgpu.Barrier(num_arrivals=bp, num_barriers=stages)],
        grid=(b, hkv, splits), grid_names=("b", "h", "s"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q64, k_pages, v_pages, phys, slots, count, lengths)
    return o[:, :, :, :rpad], mx[:, :, :, :rpad], l[:, :, :, :rpad]


__all__ = ["attend_page_lists_mgpu", "check_mgpu_attend"]


def pad_heads(q: jax.Array, kv_heads: int) -> jax.Array:
    """q ``[B, Hq, D]`` -> ``[B, Hkv, Rpad, D]``: each KV head's query heads, zero rows added up
    to a power of two >= 16 (the smallest matrix-unit tile): this attention's input (the other
    GPU kernels read ``q`` unpadded)."""
    b, hq, d = q.shape
    r = hq // kv_heads
    return jnp.pad(q.reshape(b, kv_heads, r, d),
                   ((0, 0), (0, 0), (0, max(16, pow2(r)) - r), (0, 0)))
