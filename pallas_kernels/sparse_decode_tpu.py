"""Paged top-k sparse decode as Pallas kernels for TPU (Mosaic), run in TPU interpret mode on CPU.

The same step as :func:`sparrow_jax.attention.sparse.sparse_decode` (whose reference sets the
semantics) and as the GPU kernels of :mod:`pallas_kernels.sparse_decode_gpu`, laid out for a TPU:
big contiguous tiles for the matrix unit, scalars in SMEM, and every page of the cache fetched by
an explicit DMA from HBM into VMEM. Three kernels with a little XLA between them:

1. ``_score_kernel``, grid ``(Hkv, ceil(N / Tn))``: float32 scores ``qbar . centroid`` of every
   page of the pool against every sequence's group mean ``qbar``, one matrix-unit product per
   tile of the pool (Quest: ``q+ . kmax + q- . kmin`` for each of the group's heads, the
   positive and negative parts of q, then the largest over the heads). On TPU a gather of one
   256-byte centroid per page would be one DMA per page; the pool read in tiles moves the same bytes
   when the pool is full (as the engine sizes it) in a handful of large copies. XLA then picks each
   sequence's pages out of the scores (a scalar gather) and turns them into int32 keys ordered like
   the scores.
2. ``_select_kernel``, grid ``(B, Hkv)``: the exact selection of the reference (page 0 and the
   last two pages kept, the ``K - 3`` best of the others, ties to the lower page index) by a
   threshold found bit by bit over the keys (at most 32 counting passes over the row held in
   VMEM, stopping once exactly ``K - 3`` keys reach it; no sort) and, only for a tie at the
   threshold, a second bit-by-bit search over slot indices; each chosen slot's rank in
   page order comes from two small 0/1 matrix products (a prefix sum on the matrix unit). XLA
   scatters the chosen pages into page lists and marks runs of pages adjacent in the pool.
3. ``_attend_kernel``, grid ``(B, Hkv)``: online-softmax attention of the whole GQA group over
   the row's page list, ``block_pages`` pages a step, the next block's pages copied HBM -> VMEM
   while the current one is computed (two VMEM buffers). A run of pages adjacent in the pool is
   fetched as one copy per power-of-two piece, so an allocator that hands out contiguous runs
   cuts the number of DMAs. Lengths and list counts are scalar-prefetched into SMEM; the lists
   themselves too when they fit, else each row's list is copied into SMEM when its program
   starts. Budgets are runtime values: the loop runs ``ceil(count / block_pages)`` steps.

Every grid axis is "parallel", so on a two-TensorCore chip (v5p) Mosaic splits the grid across
both cores; each program's DMAs start and end inside it, so no order between programs is assumed.

Shapes inside the kernels follow TPU tiles: the group's query heads are padded to ``Rpad``, a
multiple of 8 rows; the key rows of the selection to ``Mpad``, a multiple of 1024 (``[Mpad/128,
128]``); head_dim must be a multiple of 128 (the lane width). Export on any host with
``jax.export(..., platforms=["tpu"])`` inside an abstract TPU mesh; Mosaic's own compiler only
runs on a TPU, so some layout errors surface only there.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sparrow_jax.attention.selection import MIN_BUDGET_PAGES, SCORERS, order_key
from sparrow_jax.attention.sparse_args import (as_summaries, check_sparse_decode_args,
                                               checked_summaries)

RESERVED = MIN_BUDGET_PAGES    # page 0 and the last two pages
PAGE_SIZES = (16, 32, 64)
LANES = 128
_INT_MIN = -(2 ** 31)
# Finite, so that a fully masked block cannot turn the running max into NaN.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# Lists of all rows go to SMEM with the other scalars up to this size (SMEM is 1 MiB on v5e, v5p
# and v6e, shared with Mosaic's own use); larger ones are copied in one row at a time.
SMEM_LIST_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class TpuDecodeTuning:
    """Settings of the TPU kernels that change speed, never the result.

    block_pages: pages per attention step (None: :func:`default_block_pages`); the next step's
      pages are in flight while one is computed, so at most ``2 * block_pages`` copies (K and V)
      are queued.
    score_tile: pool pages per scoring program, a multiple of 128.
    coalesce: fetch a run of pages adjacent in the pool as one copy per power-of-two piece;
      else one copy per page.
    stream_lists: copy each row's page list into SMEM when its program starts (True), keep all
      lists in SMEM from the start (False), or decide by size (None: up to SMEM_LIST_BYTES).
    """
    block_pages: int | None = None
    score_tile: int = 512
    coalesce: bool = True
    stream_lists: bool | None = None

    def __post_init__(self):
        if self.block_pages is not None and not 1 <= self.block_pages <= 128:
            raise ValueError(f"block_pages must be in [1, 128], got {self.block_pages}")
        if self.score_tile < LANES or self.score_tile % LANES:
            raise ValueError(f"score_tile must be a positive multiple of {LANES}, got "
                             f"{self.score_tile}")


def kernel_limits(head_dim: int, page_size: int, scorer: str = "centroid") -> str | None:
    """Why the TPU kernels cannot run a case (None when they can): pages fill whole sublane
    tiles (16, 32 or 64 tokens), and head_dim fills whole lanes. Both scorers run."""
    if scorer not in SCORERS:
        return f"unknown scorer {scorer!r}; expected one of {SCORERS}"
    if page_size not in PAGE_SIZES:
        return f"the TPU kernels take page_size in {PAGE_SIZES}, got {page_size}"
    if head_dim % LANES:
        return (f"the TPU kernels need head_dim a multiple of {LANES} (the lane width), got "
                f"{head_dim}")
    return None


def default_block_pages(page_size: int) -> int:
    """256 tokens a step: 16, 8, 4 pages at P = 16, 32, 64, so at most 32 copies are queued
    (public TPU kernels keep ~64 or fewer in flight) and the buffers take 256 KiB of VMEM at
    d = 128 in bf16."""
    return max(1, 256 // page_size)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _log2(x: int) -> int:
    return int(math.log2(x))


def _count(mask):
    """Number of True in a 2-D mask, as a ``[1, 1]`` float32 (exact below 2**24): reductions one
    axis at a time, as Mosaic lowers them."""
    f = mask.astype(jnp.float32)
    return jnp.sum(jnp.sum(f, axis=1, keepdims=True), axis=0, keepdims=True)


# ------------------------------------------------------------------------------------- scoring

def _dot_t(a, b):
    """a ``[X, D]`` @ b ``[Y, D]``^T in float32 (HIGHEST: no bf16 rounding of the inputs)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _score_kernel(q_ref, *refs):
    """q ``[R, Bp, D]`` f32, the page summaries of one tile of the pool, each ``[Tn, D]`` ->
    scores ``[Bp, Tn]`` f32. Centroids: R = 1, q the sequences' group means. Quest (kmin,
    kmax): R query heads, the bound's largest over them."""
    *summary_refs, out_ref = refs
    pages = [ref[...].astype(jnp.float32) for ref in summary_refs]
    if len(pages) == 1:
        out_ref[...] = _dot_t(q_ref[0], pages[0])
        return
    kmin, kmax = pages
    best = None
    for r in range(q_ref.shape[0]):
        # max(q kmax, q kmin) is q kmax where q > 0 and q kmin where q < 0 (kmax >= kmin).
        qr = q_ref[r]
        s = _dot_t(jnp.maximum(qr, 0.0), kmax) + _dot_t(jnp.minimum(qr, 0.0), kmin)
        best = s if best is None else jnp.maximum(best, s)
    out_ref[...] = best


def score_pool(queries, summaries, *, score_tile=512, interpret=False):
    """queries ``[Hkv, R, Bp, D]`` f32 (Bp a multiple of 8; R = 1, the group means, for
    centroids; the group's R heads for Quest), summaries (centroids, or Quest's (kmin, kmax)),
    each ``[Hkv, N, D]`` -> scores ``[Hkv, Bp, N]`` f32 of every pool page against every
    sequence."""
    hkv, r, bp, d = queries.shape
    n_total = summaries[0].shape[1]
    tn = n_total if n_total <= score_tile else score_tile
    return pl.pallas_call(
        _score_kernel,
        grid=(hkv, pl.cdiv(n_total, tn)),
        in_specs=[pl.BlockSpec((None, r, bp, d), lambda h, j: (h, 0, 0, 0)),
                  *[pl.BlockSpec((None, tn, d), lambda h, j: (h, j, 0))] * len(summaries)],
        out_specs=pl.BlockSpec((None, bp, tn), lambda h, j: (h, 0, j)),
        out_shape=jax.ShapeDtypeStruct((hkv, bp, n_total), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_interpret(interpret), name="sparse_decode_tpu_score",
    )(queries, *summaries)


def row_keys(scores, page_table, lengths, *, page_size, mpad):
    """Pool scores ``[Hkv, Bp, N]`` -> keys ``[B, Hkv, Mpad / 128, 128]`` int32 of each
    sequence's slots: the score's order key for pages ``1 .. n-3`` (the ones that may be
    chosen), INT_MIN elsewhere and in the padding."""
    b, m = page_table.shape
    safe = jnp.clip(page_table, 0, scores.shape[2] - 1)
    s = jnp.take_along_axis(scores[:, :b], jnp.broadcast_to(safe[None], (scores.shape[0], b, m)),
                            axis=2)
    s = jnp.swapaxes(s, 0, 1)                                               # [B, Hkv, M]
    n = (lengths + page_size - 1) // page_size
    slot = jnp.arange(m)[None, None, :]
    eligible = (slot >= 1) & (slot < n[:, None, None] - 2)
    keys = jnp.where(eligible, order_key(s), jnp.int32(_INT_MIN))
    keys = jnp.pad(keys, ((0, 0), (0, 0), (0, mpad - m)), constant_values=_INT_MIN)
    return keys.reshape(b, keys.shape[1], mpad // LANES, LANES)


# ----------------------------------------------------------------------------------- selection

def _select_kernel(len_ref, budget_ref, key_ref, rank_ref, *, page_size, max_pages):
    """Grid (B, Hkv): keys ``[Mr, 128]`` (:func:`row_keys`) -> rank ``[Mr, 128]`` int32: each
    chosen slot's place in the row's page list (in page order), -1 for the others."""
    b = pl.program_id(0)
    keys = key_ref[...]
    mr = keys.shape[0]
    idx = (lax.broadcasted_iota(jnp.int32, keys.shape, 0) * LANES
           + lax.broadcasted_iota(jnp.int32, keys.shape, 1))
    n = lax.shift_right_logical(len_ref[b] + (page_size - 1), _log2(page_size))
    budget = jnp.minimum(jnp.maximum(budget_ref[b], RESERVED), max_pages)
    k = (budget - RESERVED).astype(jnp.float32)

    # A threshold T with #(keys >= T) >= k, decided from the sign bit down: the count stays
    # >= k throughout, so each bit is kept iff the count with it set is still >= k. Ineligible
    # keys are INT_MIN, below every candidate. The rounds stop once exactly k keys reach t
    # (keys >= t are then the top k, whatever the lower bits: about half the rounds for a few
    # thousand pages); otherwise t ends as the k-th largest key (k = 0: INT_MAX, nothing
    # chosen). (Loops, not unrolled: a much smaller program to compile.)
    def threshold_bit(carry):
        bit, t, _ = carry
        cand = t | lax.shift_left(jnp.int32(1), bit)
        count = _count(keys >= cand)
        return bit - 1, jnp.where(count >= k, cand, t), count

    first = _count(keys >= 0)
    t = jnp.where(first >= k, jnp.int32(0), jnp.int32(_INT_MIN))
    # Counts are [1, 1] float32 vectors; the loop's predicate takes the last one as a scalar
    # (Mosaic converts 32-bit elements only).
    _, t, _ = lax.while_loop(lambda c: (c[0] >= 0) & (c[2][0, 0] != k), threshold_bit,
                             (jnp.int32(30), t, first))
    above = keys > t
    need = k - _count(above)                    # keys equal to T still to take, >= 0
    equal = keys == t
    # Ties: the `need` lowest slots among the equal keys. j ends as the largest slot with fewer
    # than `need` equal keys below it: the last one taken. Without a tie at T (every equal key
    # taken) the search is skipped.
    top = (mr * LANES - 1).bit_length() - 1

    def tie_bit(i, j):
        cand = j + lax.shift_left(jnp.int32(1), top - i)
        return jnp.where(_count(equal & (idx < cand)) < need, cand, j)

    j = lax.cond((_count(equal) - need)[0, 0] == 0, lambda: jnp.full((1, 1), mr * LANES, jnp.int32),
                 lambda: lax.fori_loop(0, top + 1, tie_bit, jnp.zeros((1, 1), jnp.int32)))
    chosen = above | (equal & (idx <= j) & (need > 0))
    reserved = (idx == 0) | (idx >= n - 2)
    # Dense rows (n <= budget) take all their pages; the scalar folds that in as a slot bound.
    dense_upto = jnp.where(n <= budget, n, 0)
    sel = (idx < n) & (reserved | chosen | (idx < dense_upto))

    # Rank in page order = inclusive prefix count - 1: within each 128-slot row by a product
    # with an upper-triangular 0/1 matrix, plus the counts of the rows above by a product with a
    # strictly lower one. 0/1 and counts <= 128 are exact in bf16; sums exact in float32.
    sel_b = sel.astype(jnp.bfloat16)
    upper = (lax.broadcasted_iota(jnp.int32, (LANES, LANES), 0)
             <= lax.broadcasted_iota(jnp.int32, (LANES, LANES), 1)).astype(jnp.bfloat16)
    within = jnp.dot(sel_b, upper, preferred_element_type=jnp.float32)          # [Mr, 128]
    totals = jnp.broadcast_to(within[:, LANES - 1:], (mr, LANES)).astype(jnp.bfloat16)
    lower = (lax.broadcasted_iota(jnp.int32, (mr, mr), 1)
             < lax.broadcasted_iota(jnp.int32, (mr, mr), 0)).astype(jnp.bfloat16)
    before = jnp.dot(lower, totals, preferred_element_type=jnp.float32)         # [Mr, 128]
    rank = (within + before).astype(jnp.int32) - 1
    rank_ref[...] = jnp.where(sel, rank, jnp.int32(-1))


def select_ranks(keys, lengths, budget_pages, *, page_size, max_pages, interpret=False):
    """The selection kernel: keys ``[B, Hkv, Mr, 128]`` -> ranks of the same shape."""
    b, hkv, mr, _ = keys.shape
    spec = pl.BlockSpec((None, None, mr, LANES), lambda bi, hi, *_: (bi, hi, 0, 0))
    return pl.pallas_call(
        functools.partial(_select_kernel, page_size=page_size, max_pages=max_pages),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(b, hkv), in_specs=[spec], out_specs=spec),
        out_shape=jax.ShapeDtypeStruct(keys.shape, jnp.int32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_interpret(interpret), name="sparse_decode_tpu_select",
    )(lengths, budget_pages, keys)


def page_lists(rank, page_table, *, kpad, block_pages, coalesce):
    """Ranks ``[B, Hkv, Mpad]`` -> (phys ``[B, Hkv, Kpad]``: the chosen physical pages in page
    order, 0 past the count; runs ``[B, Hkv, Kpad]``: at the start of each run of entries whose
    pages follow each other in the pool, its length (runs end at blocks of ``block_pages`` and at
    the count); count ``[B, Hkv]``)."""
    b, hkv, _ = rank.shape
    m = page_table.shape[1]
    rank = rank[:, :, :m]
    dest = jnp.where(rank >= 0, rank, kpad)
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(hkv)[None, :, None]
    phys = jnp.zeros((b, hkv, kpad), jnp.int32).at[bi, hi, dest].set(
        jnp.broadcast_to(page_table[:, None, :], rank.shape), mode="drop")
    count = jnp.sum(rank >= 0, axis=-1).astype(jnp.int32)
    e = jnp.arange(kpad)
    if not coalesce:
        return phys, jnp.ones_like(phys), count
    prev = jnp.pad(phys[..., :-1], ((0, 0), (0, 0), (1, 0)))
    brk = (e % block_pages == 0) | (phys != prev + 1) | (e >= count[..., None])
    # The next break after each entry: a reverse running minimum of the break positions.
    at = jnp.where(brk, e, kpad)
    nxt = lax.cummin(jnp.pad(at[..., 1:], ((0, 0), (0, 0), (0, 1)), constant_values=kpad),
                     axis=2, reverse=True)
    return phys, nxt - e, count


# ----------------------------------------------------------------------------------- attention

def _walk_copies(phys, runs, base, start, stop, max_run, action):
    """Entries ``start .. stop-1`` of a list (phys/runs SMEM refs at offset ``base``) as copies:
    each run of adjacent pool pages (at most ``max_run`` long) split into power-of-two pieces.
    ``action(src_page, entry, size)`` issues or waits one copy; waits replay the same walk, so
    each waits for exactly the bytes its copy moves."""
    def body(i):
        page = phys[base + i]
        length = runs[base + i]
        off = jnp.int32(0)
        size = 1 << _log2(max_run)
        while size >= 1:
            piece = jnp.int32(size)
            take = (length & piece) != 0
            o = off

            @pl.when(take)
            def _():
                action(page + o, i + o, size)

            off = off + jnp.where(take, piece, jnp.int32(0))
            size //= 2
        return i + length

    lax.while_loop(lambda i: i < stop, body, start)


def _attend_kernel(len_ref, count_ref, *refs, page_size, block_pages, kv_heads, kpad, scale,
                   compute_dtype, stream):
    """Grid (B, Hkv): q ``[Rpad, D]`` f32, pages ``[Hkv, N, P, D]`` in HBM, the row's list ->
    output ``[Rpad, D]`` f32 (zeros for a row with nothing to attend to)."""
    if stream:
        (q_ref, phys_hbm, runs_hbm, k_hbm, v_hbm, o_ref, kbuf, vbuf, sems, phys, runs,
         list_sem) = refs
    else:
        phys, runs, q_ref, k_hbm, v_hbm, o_ref, kbuf, vbuf, sems = refs
    b, h = pl.program_id(0), pl.program_id(1)
    row = b * kv_heads + h
    if stream:
        for src, dst in ((phys_hbm, phys), (runs_hbm, runs)):
            cp = pltpu.make_async_copy(src.at[row], dst, list_sem)
            cp.start()
            cp.wait()
        base = jnp.int32(0)
    else:
        base = row * kpad
    count = count_ref[row]
    length = len_ref[b]
    bp, p = block_pages, page_size
    n = lax.shift_right_logical(length + (p - 1), _log2(p))
    last_len = length - (n - 1) * p              # tokens of the last (maybe partial) page
    blocks = (count + (bp - 1)) // bp

    def copies(blk, slot, how):
        def action(src_page, entry, size):
            dst = entry - blk * bp
            for pages, buf, kv in ((k_hbm, kbuf, 0), (v_hbm, vbuf, 1)):
                cp = pltpu.make_async_copy(pages.at[h, pl.ds(src_page, size)],
                                           buf.at[slot, pl.ds(dst, size)], sems.at[kv, slot])
                cp.start() if how == "start" else cp.wait()

        _walk_copies(phys, runs, base, blk * bp, jnp.minimum(blk * bp + bp, count), bp, action)

    @pl.when(blocks > 0)
    def _():
        copies(0, 0, "start")

    rpad, d = q_ref.shape
    q = q_ref[...].astype(compute_dtype)
    tokens = bp * p
    col = lax.broadcasted_iota(jnp.int32, (rpad, tokens), 1)
    col_entry = lax.shift_right_logical(col, _log2(p))
    col_tok = col & (p - 1)
    tok_row = lax.broadcasted_iota(jnp.int32, (tokens, d), 0)
    row_entry = lax.shift_right_logical(tok_row, _log2(p))
    row_tok = tok_row & (p - 1)
    hi = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    def visible(blk, entry, tok):
        g = blk * bp + entry
        return (g < count) & ((g < count - 1) | (tok < last_len))

    def body(blk, carry):
        o, m, l = carry
        slot = blk % 2

        @pl.when(blk + 1 < blocks)
        def _():
            copies(blk + 1, 1 - slot, "start")

        copies(blk, slot, "wait")
        k = kbuf[slot].reshape(tokens, d).astype(compute_dtype)
        v = vbuf[slot].reshape(tokens, d)
        # Entries past the count were never copied in this block: zero them, since 0 * NaN in
        # P.V would poison the row (masked logits alone do not protect V).
        v = jnp.where(visible(blk, row_entry, row_tok), v, jnp.zeros_like(v)).astype(
            compute_dtype)
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=hi,
                                 preferred_element_type=jnp.float32) * scale
        logits = jnp.where(visible(blk, col_entry, col_tok), logits, jnp.float32(_MASK_VALUE))
        m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
        corr = jnp.exp(m - m_new)
        pr = jnp.exp(logits - m_new)
        l_new = corr * l + jnp.sum(pr, axis=1, keepdims=True)
        o_new = corr * o + lax.dot_general(pr.astype(compute_dtype), v,
                                           (((1,), (0,)), ((), ())), precision=hi,
                                           preferred_element_type=jnp.float32)
        return o_new, m_new, l_new

    init = (jnp.zeros((rpad, d), jnp.float32), jnp.full((rpad, 1), _MASK_VALUE, jnp.float32),
            jnp.zeros((rpad, 1), jnp.float32))
    o, _, l = lax.fori_loop(0, blocks, body, init)
    o_ref[...] = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)


def attend_lists(q_pad, k_pages, v_pages, phys, runs, count, lengths, *, page_size,
                 block_pages, compute_dtype, stream_lists, interpret=False):
    """The attention kernel: q_pad ``[B, Hkv, Rpad, D]`` f32, pages ``[Hkv, N, P, D]``, the
    lists of :func:`page_lists` -> ``[B, Hkv, Rpad, D]`` f32."""
    b, hkv, rpad, d = q_pad.shape
    kpad = phys.shape[-1]
    q_spec = pl.BlockSpec((None, None, rpad, d), lambda bi, hi, *_: (bi, hi, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    bufs = [pltpu.VMEM((2, block_pages, page_size, d), k_pages.dtype),
            pltpu.VMEM((2, block_pages, page_size, d), v_pages.dtype),
            pltpu.SemaphoreType.DMA((2, 2))]
    kernel = functools.partial(_attend_kernel, page_size=page_size, block_pages=block_pages,
                               kv_heads=hkv, kpad=kpad, scale=d ** -0.5,
                               compute_dtype=compute_dtype,
                               stream=stream_lists)
    flat = lambda x: x.reshape(b * hkv, kpad)
    if stream_lists:
        prefetch = (lengths, count.reshape(-1))
        in_specs = [q_spec, any_spec, any_spec, any_spec, any_spec]
        args = (q_pad, flat(phys), flat(runs), k_pages, v_pages)
        bufs += [pltpu.SMEM((kpad,), jnp.int32), pltpu.SMEM((kpad,), jnp.int32),
                 pltpu.SemaphoreType.DMA(())]
    else:
        prefetch = (lengths, count.reshape(-1), phys.reshape(-1), runs.reshape(-1))
        in_specs = [q_spec, any_spec, any_spec]
        args = (q_pad, k_pages, v_pages)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=(b, hkv), in_specs=in_specs,
            out_specs=q_spec, scratch_shapes=bufs),
        out_shape=jax.ShapeDtypeStruct(q_pad.shape, jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_interpret(interpret), name="sparse_decode_tpu_attend",
    )(*prefetch, *args)


# -------------------------------------------------------------------------------- entry points

def _interpret(interpret):
    return pltpu.InterpretParams() if interpret else False


def sparse_decode_tpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                      page_table: jax.Array, lengths: jax.Array, budget_pages: jax.Array, *,
                      page_size: int = 16, scorer: str = "centroid",
                      centroids: jax.Array | None = None,
                      summaries: tuple[jax.Array, jax.Array] | None = None,
                      max_budget_pages: int | None = None,
                      tuning: TpuDecodeTuning = TpuDecodeTuning(),
                      interpret: bool = False) -> jax.Array:
    """Block top-k sparse decode attention, the TPU kernels.

    ``sparrow_jax.sparse_decode(..., impl="pallas_tpu")`` (or ``"auto"`` on a TPU) is the usual
    way in; this entry point also takes the tuning settings.

    Args:
      q: ``[B, Hq, D]`` queries after q-norm and RoPE; D a multiple of 128.
      k_pages, v_pages: ``[Hkv, N, P, D]`` one layer's paged cache, current token written.
      page_table: ``[B, M]`` int32 physical page of each sequence's j-th page.
      lengths: ``[B]`` int32 tokens in the cache, current token included, in ``[1, M * P]``
        (under jit, where it cannot be checked, a row of 0 returns zeros).
      budget_pages: ``[B]`` int32 pages per (sequence, KV head), the 3 reserved included
        (>= 3). Under jit, where they cannot be checked, clipped to ``[3, max_budget_pages]``.
      page_size: P, one of 16, 32, 64.
      scorer: ``"centroid"`` (qbar . page mean of keys) or ``"quest"`` (Quest's bound from
        each page's elementwise min and max of keys).
      centroids: ``[Hkv, N, D]`` page means of the keys in the cache dtype, for ``"centroid"``;
        computed from the pages when None.
      summaries: ``(kmin, kmax)``, each ``[Hkv, N, D]``, for ``"quest"``; computed when None.
      max_budget_pages: static size of the page lists; default M.
      tuning: :class:`TpuDecodeTuning`.
      interpret: run in TPU interpret mode (CPU tests; DMAs and semaphores simulated).

    Returns:
      ``[B, Hq, D]`` in q's dtype.
    """
    check_sparse_decode_args(q, k_pages, v_pages, page_table, lengths, budget_pages,
                             page_size=page_size, max_budget_pages=max_budget_pages)
    why = kernel_limits(q.shape[-1], page_size, scorer)
    if why is not None:
        raise ValueError(f"sparse_decode_tpu: {why}")
    summ = checked_summaries(k_pages, scorer, centroids, summaries)
    return sparse_decode_tpu_checked(q, k_pages, v_pages, summ, page_table, lengths,
                                     budget_pages, page_size=page_size,
                                     max_budget_pages=max_budget_pages, tuning=tuning,
                                     interpret=interpret)


def sparse_decode_tpu_checked(q, k_pages, v_pages, summaries, page_table, lengths,
                              budget_pages, *, page_size, max_budget_pages=None,
                              tuning=TpuDecodeTuning(), interpret=False):
    """:func:`sparse_decode_tpu` for arguments its caller has already checked (as
    ``sparse_decode`` does) and given page summaries (centroids, or the pair (kmin, kmax) for
    Quest): no checks here."""
    return _sparse_decode(q, k_pages, v_pages, as_summaries(summaries),
                          page_table.astype(jnp.int32),
                          lengths.astype(jnp.int32), budget_pages.astype(jnp.int32),
                          page_size=page_size,
                          max_pages=max_budget_pages or page_table.shape[1], tuning=tuning,
                          interpret=interpret)


def list_sizes(batch, kv_heads, max_pages, page_size, tuning=TpuDecodeTuning()):
    """(block_pages, Kpad, stream_lists) the kernels use for these shapes."""
    bp = tuning.block_pages or default_block_pages(page_size)
    kpad = _round_up(max_pages, bp)
    stream = tuning.stream_lists
    if stream is None:
        stream = 2 * batch * kv_heads * kpad * 4 > SMEM_LIST_BYTES
    return bp, kpad, stream


@functools.partial(jax.jit, static_argnames=("page_size", "max_pages", "tuning", "interpret"))
def _sparse_decode(q, k_pages, v_pages, summaries, page_table, lengths, budget_pages, *,
                   page_size, max_pages, tuning, interpret):
    b, hq, d = q.shape
    hkv = k_pages.shape[0]
    r = hq // hkv
    m = page_table.shape[1]
    bp, kpad, stream = list_sizes(b, hkv, max_pages, page_size, tuning)
    q_group = q.astype(jnp.float32).reshape(b, hkv, r, d)
    # Centroids: the group means; Quest: every head. Sequences padded to a sublane tile:
    # [Hkv, R or 1, Bp, D].
    queries = q_group if len(summaries) == 2 else jnp.mean(q_group, axis=2, keepdims=True)
    queries = jnp.transpose(queries, (1, 2, 0, 3))
    queries = jnp.pad(queries, ((0, 0), (0, 0), (0, _round_up(b, 8) - b), (0, 0)))
    scores = score_pool(queries, summaries, score_tile=tuning.score_tile, interpret=interpret)
    mpad = _round_up(m, 8 * LANES)
    keys = row_keys(scores, page_table, lengths, page_size=page_size, mpad=mpad)
    rank = select_ranks(keys, lengths, budget_pages, page_size=page_size, max_pages=max_pages,
                        interpret=interpret).reshape(b, hkv, mpad)
    phys, runs, count = page_lists(rank, page_table, kpad=kpad, block_pages=bp,
                                   coalesce=tuning.coalesce)
    rpad = _round_up(max(r, 8), 8)
    q_pad = jnp.pad(q_group, ((0, 0), (0, 0), (0, rpad - r), (0, 0)))
    out = attend_lists(q_pad, k_pages, v_pages, phys, runs, count, lengths, page_size=page_size,
                       block_pages=bp, compute_dtype=jnp.promote_types(q.dtype, k_pages.dtype),
                       stream_lists=stream, interpret=interpret)
    return out[:, :, :r].reshape(b, hq, d).astype(q.dtype)
