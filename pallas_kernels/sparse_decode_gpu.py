"""Paged top-k sparse decode as Pallas kernels (Triton lowering on GPU, interpret mode on CPU).

One decode step of docs/design.md, section 3 for one layer, in three kernels and a small combine:

1. ``_score_kernel``, grid ``(B, Hkv, M / C)``: float32 scores ``qbar . centroid`` of the pages
   that may be chosen (``1 .. n-3``), turned into int32 keys whose signed order is the order of
   the scores (ineligible slots get the smallest key). Reads one key-sized vector per page.
2. ``_select_kernel``, grid ``(B, Hkv)``: the ``K - 3``-th largest key found by a radix
   threshold search (from the sign bit down, ``radix_bits`` bits per block-wide counting round
   over the row held on chip; no sort), ties to the lower page index by a bitwise search over
   slot indices, plus the reserved pages; the chosen slots are compacted in page order (a prefix
   sum) into a page list.
3. ``_attend_kernel``, grid ``(B, Hkv, S)``: online-softmax attention of all query heads of the
   group over the listed pages, the list split S ways (flash-decoding) so that small batches
   still fill the GPU; each split loops only over its share of its own row's list, so the cost
   follows each sequence's budget. The S partial results are merged in XLA.

Shapes inside the kernels are powers of two (Triton's rule): the page table is padded to
``Mpad`` slots, the query heads of a group to ``Rpad >= 16`` rows (the matrix units' minimum; so
any group size, e.g. 5, works), the page list to ``Kpad`` entries.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sparrow_jax.attention.selection import MIN_BUDGET_PAGES, page_centroids
from sparrow_jax.attention.sparse_args import check_sparse_decode_args, check_summary

RESERVED = MIN_BUDGET_PAGES    # page 0 and the last two pages (docs/design.md, section 3)
_INT_MIN = -(2 ** 31)
# Finite, so that a fully masked block cannot turn the running max into NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Scalars inside kernels are typed (jnp.int32(0), not 0): the Triton lowering gives a weakly
# typed constant in jnp.where the predicate's type.


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _order_key(score: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order (signed compare); -0.0 and 0.0 map alike."""
    bits = lax.bitcast_convert_type(score + 0.0, jnp.int32)
    # Negative floats order backwards in their magnitude bits: flip those bits.
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _qbar(q_ref, group):
    """The mean ``[D]`` float32 of the group's query heads: q ``[Rpad, D]``, zero rows past
    ``group``."""
    return jnp.sum(q_ref[...].astype(jnp.float32), axis=0) / group


def _score_chunk(qbar, cent_ref, table, n, c, *, chunk):
    """Keys ``[C]`` int32 of slots ``c*C .. c*C+C-1``: qbar ``[D]`` (:func:`_qbar`), centroids
    ``[N, D]`` (this KV head), table ``[C]`` (those slots), n pages in use."""
    slot = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    eligible = (slot >= 1) & (slot < n - 2)
    # Ineligible slots read page 0's centroid (one cached row) instead of a stray one.
    phys = jnp.where(eligible, table, jnp.int32(0))
    cent = cent_ref[phys, :].astype(jnp.float32)                          # [C, D]
    # Elementwise products and a float32 sum: exact float32 arithmetic, never TF32.
    score = jnp.sum(cent * qbar[None, :], axis=1)
    return jnp.where(eligible, _order_key(score), jnp.int32(_INT_MIN))


def _score_kernel(q_ref, cent_ref, table_ref, len_ref, key_ref, *, page_size, chunk, group,
                  loop):
    """Grid (B, Hkv, Mpad / (C * loop)): table ``[C * loop]`` (this program's slots), length
    ``[1]`` -> keys ``[C * loop]``, ``loop`` chunks of C in a loop (Triton pipelines its loads
    with ``num_stages`` > 1)."""
    c0 = pl.program_id(2) * loop
    n = (len_ref[0] + page_size - 1) // page_size
    qbar = _qbar(q_ref, group)
    if loop == 1:
        key_ref[...] = _score_chunk(qbar, cent_ref, table_ref[...], n, c0, chunk=chunk)
        return

    def body(i, carry):
        sl = pl.ds(i * chunk, chunk)
        key_ref[sl] = _score_chunk(qbar, cent_ref, table_ref[sl], n, c0 + i, chunk=chunk)
        return carry

    lax.fori_loop(0, loop, body, jnp.int32(0))


def _count(mask: jax.Array) -> jax.Array:
    return jnp.sum(mask.astype(jnp.int32))


def _select_kernel(key_ref, table_ref, len_ref, budget_ref, phys_ref, slot_ref, count_ref, *,
                   page_size, max_pages, slot_bits, radix_bits):
    """Grid (B, Hkv): keys ``[Mpad]``, table ``[Mpad]``, length, budget -> the page list of
    :func:`_select_row`."""
    n = (len_ref[0] + page_size - 1) // page_size
    _select_row(key_ref[...], table_ref[...], n, budget_ref[0], phys_ref, slot_ref, count_ref,
                max_pages=max_pages, slot_bits=slot_bits, radix_bits=radix_bits)


def _score_select_kernel(q_ref, cent_ref, table_ref, len_ref, budget_ref, _arrived_in,
                         key_ref, phys_ref, slot_ref, count_ref, arrived_ref, *, page_size,
                         chunk, group, max_pages, slot_bits, radix_bits, interpret):
    """Scoring and selection in one launch. Grid (Mpad / C, B, Hkv), chunks fastest so that a
    row's chunks run together: each program scores its chunk into the row's keys ``[Mpad]``
    (global memory), then counts itself in ``arrived`` (an atomic add, zero on entry); the
    program that arrives last reads the whole row back and selects (:func:`_select_row`)
    while other rows are still being scored."""
    c = pl.program_id(0)
    chunks = pl.num_programs(0)
    n = (len_ref[0] + page_size - 1) // page_size
    key_ref[pl.ds(c * chunk, chunk)] = _score_chunk(
        _qbar(q_ref, group), cent_ref, table_ref[pl.ds(c * chunk, chunk)], n, c, chunk=chunk)
    if not interpret:
        # Every thread's key stores precede the (release) atomic, issued by one thread. The
        # interpreter runs programs one after another: nothing to order.
        plgpu.debug_barrier()
    arrived = plgpu.atomic_add(arrived_ref, (jnp.int32(0),), jnp.int32(1))

    @pl.when(arrived == chunks - 1)
    def _():
        # The other programs' keys: volatile loads go to L2, never to a stale L1 line (jax
        # 0.11.2 rejects cache_modifier=".cg").
        keys = key_ref[...] if interpret else plgpu.load(key_ref, volatile=True)
        _select_row(keys, table_ref[...], n, budget_ref[0], phys_ref, slot_ref, count_ref,
                    max_pages=max_pages, slot_bits=slot_bits, radix_bits=radix_bits)


def _select_row(keys, table, n, budget, phys_ref, slot_ref, count_ref, *, max_pages, slot_bits,
                radix_bits):
    """One (sequence, KV head): keys ``[Mpad]`` (:func:`_score_chunk`), table ``[Mpad]``, n
    pages in use, budget -> the page list (physical and logical, each ``[2 * Kpad]``: entries
    ``count .. Kpad-1`` repeat the last page, the second half is never written on GPU) and the
    count ``[1]``."""
    mpad = keys.shape[0]
    kpad = phys_ref.shape[0] // 2
    idx = lax.broadcasted_iota(jnp.int32, (mpad,), 0)
    budget = jnp.clip(budget, RESERVED, max_pages)
    k = budget - RESERVED

    # Largest T with #(keys >= T) >= k, built from the sign bit down, `radix_bits` bits per
    # round, each round one reduction: count(keys >= t) >= k holds throughout, so a one-bit
    # round counts only the candidate with the bit set; wider rounds count all 2**radix_bits
    # candidates at once. Ineligible keys are INT_MIN and every candidate is larger, so they
    # are never counted; k = 0 gives T = INT_MAX, nothing chosen.
    # (Python loops: unrolled, fixed trip counts.)
    t = jnp.where(_count(keys >= 0) >= k, jnp.int32(0), jnp.int32(_INT_MIN))
    hi = 31
    while hi > 0:
        width = min(radix_bits, hi)
        shift = hi - width
        if width == 1:
            cand = t | jnp.int32(1 << shift)
            t = jnp.where(_count(keys >= cand) >= k, cand, t)
        else:
            # All 2**width digits (Triton shapes are powers of two), digit 0 included.
            digits = lax.broadcasted_iota(jnp.int32, (1 << width, 1), 0)
            cands = t | lax.shift_left(digits, shift)
            counts = jnp.sum((keys[None, :] >= cands).astype(jnp.int32), axis=1)
            # Counts fall as candidates rise: the last one still >= k is the digit.
            digit = jnp.sum((counts >= k).astype(jnp.int32)) - 1
            t = t | lax.shift_left(digit, shift)
        hi = shift
    above = keys > t
    need = k - _count(above)                     # how many keys equal to t to take, >= 0
    equal = keys == t
    # Ties: the `need` lowest slots among the equal keys: the largest j with fewer than `need`
    # equal keys below it is the last one taken. Usually exactly `need` keys equal t (no tie
    # at the threshold) and the search is skipped.
    def lowest_equal():
        j = jnp.int32(0)
        for bit in range(slot_bits - 1, -1, -1):
            cand = j + (1 << bit)
            j = jnp.where(_count(equal & (idx < cand)) < need, cand, j)
        return j

    # need <= mpad, so the first branch is mpad (no limit); it is computed from a traced value
    # because the Triton lowering cannot yield a literal from a cond.
    j = lax.cond(_count(equal) == need, lambda: jnp.maximum(need, jnp.int32(mpad)),
                 lowest_equal)
    chosen = above | (equal & (idx <= j) & (need > 0))
    reserved = (idx == 0) | ((idx >= n - 2) & (idx < n))
    sel = jnp.where(n <= budget, idx < n, reserved | chosen)

    # Compact in page order: chosen slots go to ranks 0 .. total-1, the others after them and
    # carry the last page, so entries past the count repeat it (the attention kernel reads whole
    # blocks of entries; a repeated page comes from cache, not memory). Ranks are distinct; those
    # past the list go to the junk half of the buffer with their stores masked off.
    sel_i = sel.astype(jnp.int32)
    upto = jnp.cumsum(sel_i)                     # chosen slots at or below each slot
    total = jnp.sum(sel_i)
    rank = jnp.where(sel, upto - 1, total + idx - upto)
    last = jnp.maximum(n - 1, 0)
    last_phys = jnp.sum(jnp.where(idx == last, table, jnp.int32(0)))
    keep = rank < kpad
    dest = jnp.where(keep, rank, jnp.int32(kpad))
    plgpu.store(phys_ref.at[dest], jnp.where(sel, table, last_phys), mask=keep)
    plgpu.store(slot_ref.at[dest], jnp.where(sel, idx, last), mask=keep)
    count_ref[...] = jnp.full((1,), total, jnp.int32)


def _attend_kernel(q_ref, k_ref, v_ref, phys_ref, slot_ref, count_ref, len_ref,
                   o_ref, m_ref, l_ref, *, page_size, block_pages, splits, scale):
    """q ``[Rpad, D]``, pages ``[N, P, D]`` (this KV head), page list ``[Kpad]`` -> this split's
    unnormalised output ``[Rpad, D]`` f32, running max and sum ``[Rpad]``."""
    s = pl.program_id(2)
    rpad, d = q_ref.shape
    block_k = block_pages * page_size
    count = count_ref[0]
    length = len_ref[0]
    blocks = (count + block_pages - 1) // block_pages
    per_split = (blocks + splits - 1) // splits
    start = s * per_split
    stop = jnp.minimum(start + per_split, blocks)
    q = q_ref[...]
    cdt = jnp.promote_types(q.dtype, k_ref.dtype)
    q = q.astype(cdt)
    tok = lax.broadcasted_iota(jnp.int32, (block_pages, page_size), 1)
    entry = lax.broadcasted_iota(jnp.int32, (block_pages, page_size), 0)

    def body(i, carry):
        o, m, l = carry
        sl = pl.ds(i * block_pages, block_pages)
        phys = phys_ref[sl]
        slot = slot_ref[sl]
        k = k_ref[phys].reshape(block_k, d).astype(cdt)
        v = v_ref[phys].reshape(block_k, d).astype(cdt)
        # [Rpad, block_k] float32; allow_tf32=False keeps float32 inputs exact.
        logits = plgpu.dot(q, k, trans_b=True, allow_tf32=False) * scale
        ok = ((i * block_pages + entry < count)
              & (slot[:, None] * page_size + tok < length)).reshape(1, block_k)
        logits = jnp.where(ok, logits, jnp.float32(_MASK_VALUE))
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])
        l_new = corr * l + jnp.sum(p, axis=1)
        o_new = corr[:, None] * o + plgpu.dot(p.astype(cdt), v, allow_tf32=False)
        return o_new, m_new, l_new

    init = (jnp.zeros((rpad, d), jnp.float32), jnp.full((rpad,), _MASK_VALUE, jnp.float32),
            jnp.zeros((rpad,), jnp.float32))
    o, m, l = lax.fori_loop(start, stop, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _merge(o, m, l, o_j, m_j, l_j):
    """Two partial softmax results (unnormalised output, max, sum) -> their union's. Empty ones
    (l = 0, m = the mask value) drop out."""
    m_new = jnp.maximum(m, m_j)
    a, b = jnp.exp(m - m_new), jnp.exp(m_j - m_new)
    return a[:, None] * o + b[:, None] * o_j, m_new, a * l + b * l_j


def _normalise(o, l):
    """o / l, and zeros for a row with no tokens at all (length 0, padding)."""
    return jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0)


def _attend_merge_kernel(q_ref, k_ref, v_ref, phys_ref, slot_ref, count_ref, len_ref,
                         _arrived_in, o_ref, m_ref, l_ref, out_ref, arrived_ref, *, page_size,
                         block_pages, splits, scale, interpret):
    """:func:`_attend_kernel` with the split merge inside: each split writes its partial result
    into the row's ``[S, ...]`` buffers and counts itself in ``arrived`` (an atomic add, zero on
    entry); the split that arrives last merges the S partials and writes the normalised output
    ``[Rpad, D]`` in q's dtype."""
    s = pl.program_id(2)
    _attend_kernel(q_ref, k_ref, v_ref, phys_ref, slot_ref, count_ref, len_ref,
                   o_ref.at[s], m_ref.at[s], l_ref.at[s], page_size=page_size,
                   block_pages=block_pages, splits=splits, scale=scale)
    if not interpret:
        plgpu.debug_barrier()    # every thread's stores precede the (release) atomic
    arrived = plgpu.atomic_add(arrived_ref, (jnp.int32(0),), jnp.int32(1))

    @pl.when(arrived == splits - 1)
    def _():
        # The other splits' partials: volatile loads go to L2, never to a stale L1 line.
        ld = ((lambda ref: ref[...]) if interpret
              else (lambda ref: plgpu.load(ref, volatile=True)))
        rpad, d = out_ref.shape
        init = (jnp.zeros((rpad, d), jnp.float32), jnp.full((rpad,), _MASK_VALUE, jnp.float32),
                jnp.zeros((rpad,), jnp.float32))
        o, _, l = lax.fori_loop(
            0, splits, lambda j, c: _merge(*c, ld(o_ref.at[j]), ld(m_ref.at[j]),
                                           ld(l_ref.at[j])), init)
        out_ref[...] = _normalise(o, l).astype(out_ref.dtype)


def kernel_limits(head_dim: int, page_size: int, scorer: str = "centroid",
                  block_pages: int | None = None) -> str | None:
    """Why the kernels cannot run a case (None when they can): they score page centroids only,
    and Triton blocks need power-of-two sides, matrix-unit tiles at least 16 wide."""
    if scorer != "centroid":
        return f"the kernels score page centroids only (scorer='centroid'), got {scorer!r}"
    p, d = page_size, head_dim
    if p < 1 or p & (p - 1) or d & (d - 1) or d < 16:
        return (f"page_size ({p}) and head_dim ({d}) must be powers of two, head_dim >= 16 "
                "(Triton block shapes, matrix-unit tiles)")
    if block_pages is not None and (block_pages < 1 or block_pages & (block_pages - 1)
                                    or block_pages * p < 16):
        return (f"block_pages ({block_pages}) must be a power of two with block_pages x "
                f"page_size >= 16")
    return None


def default_block_pages(page_size: int) -> int:
    """Pages per attention step: 4 (the H100 sweep at page 16), at least 16 tokens."""
    return max(4, 16 // page_size)


def _check_args(q, k_pages, v_pages, page_table, lengths, budget_pages, page_size, scorer,
                centroids, max_budget_pages, block_pages):
    check_sparse_decode_args(q, k_pages, v_pages, page_table, lengths, budget_pages,
                             page_size=page_size, max_budget_pages=max_budget_pages)
    why = kernel_limits(q.shape[-1], page_size, scorer, block_pages)
    if why is not None:
        raise ValueError(f"sparse_decode_pallas: {why}")
    if centroids is not None:
        check_summary("centroids", centroids, k_pages)


# Attention kernel settings from the H100 sweep (notes/kernel_notes.md 10): 2 warps and no
# software pipelining leave 228 registers a thread and 4 programs per SM, whose loads in flight
# read faster than Triton's 2-stage pipeline at 4 warps (133 registers, 3 programs per SM).
ATTEND_WARPS = 2
ATTEND_STAGES = 1
ATTEND_PROGRAMS_PER_SM = 4


def _sm_count() -> int:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132) if dev.platform == "gpu" else 132


def default_splits(batch: int, kv_heads: int, max_pages: int, block_pages: int) -> int:
    """Splits of each page list: as many as one wave of attention programs holds
    (:data:`ATTEND_PROGRAMS_PER_SM` per SM), at least one, at least one block of pages per
    split. One wave, because a second, partly filled wave leaves the GPU idle at its end: at
    batch 32 (256 rows) two splits took 180 us where four took 183 (H100)."""
    slots = ATTEND_PROGRAMS_PER_SM * _sm_count()
    blocks = -(-max_pages // block_pages)
    return int(max(1, min(blocks, slots // (batch * kv_heads))))


def sparse_decode_pallas(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                         page_table: jax.Array, lengths: jax.Array, budget_pages: jax.Array, *,
                         page_size: int = 16, scorer: str = "centroid",
                         centroids: jax.Array | None = None,
                         max_budget_pages: int | None = None, block_pages: int | None = None,
                         splits: int | None = None, score_chunk: int = 64,
                         select_warps: int = 4, radix_bits: int = 1,
                         num_warps: int = ATTEND_WARPS, num_stages: int = ATTEND_STAGES,
                         fuse_select: bool = False,
                         merge_in_kernel: bool = False, score_warps: int = 4,
                         score_loop: int = 1, score_stages: int = 1,
                         interpret: bool = False) -> jax.Array:
    """Block top-k sparse decode attention (docs/design.md, section 3), the Pallas kernels.

    ``sparrow_jax.sparse_decode(..., impl="pallas")`` (or ``"auto"`` on a GPU) is the usual way
    in; this entry point also takes the tuning settings.

    Args:
      q: ``[B, Hq, D]`` queries after q-norm and RoPE.
      k_pages, v_pages: ``[Hkv, N, P, D]`` one layer's paged cache, current token written.
      page_table: ``[B, M]`` int32 physical page of each sequence's j-th page.
      lengths: ``[B]`` int32 tokens in the cache, current token included, in ``[1, M * P]``
        (under jit, where it cannot be checked, a row of 0 returns zeros).
      budget_pages: ``[B]`` int32 pages per (sequence, KV head), the 3 reserved included
        (>= 3). Under jit, where they cannot be checked, clipped to ``[3, max_budget_pages]``.
      page_size: P, a power of two.
      scorer: ``"centroid"`` only.
      centroids: ``[Hkv, N, D]`` page means of the keys in the cache dtype; computed from the
        pages when None (as the cache would store them).
      max_budget_pages: static size of the page lists; default M. Concrete budgets needing
        more pages raise.
      block_pages: pages per step of the attention loop (a power of two, at least 16 tokens);
        default :func:`default_block_pages`.
      splits: parts of each page list run in parallel; default :func:`default_splits`.
      score_chunk: page slots per program of the scoring kernel (a power of two).
      select_warps: Triton warps of the selection kernel.
      radix_bits: bits of the threshold decided per counting round of the selection.
      num_warps, num_stages: Triton settings of the attention kernel.
      fuse_select: score and select in one launch, the last scoring program of each row
        selecting (:func:`_score_select_kernel`); else two kernels.
      merge_in_kernel: the last split of each row merges the splits' partial results
        (:func:`_attend_merge_kernel`); else XLA merges them.
      score_warps, score_loop, score_stages: Triton warps of the scoring kernel, chunks each
        of its programs loops over, and the loop's pipelining depth (two-kernel path).
      interpret: run the kernels in Pallas' interpreter (CPU tests).

    Arguments are checked as by ``sparse_decode`` (:mod:`sparrow_jax.attention.sparse_args`),
    plus the kernels' own limits (:func:`kernel_limits`).

    Returns:
      ``[B, Hq, D]`` in q's dtype.
    """
    _check_args(q, k_pages, v_pages, page_table, lengths, budget_pages, page_size, scorer,
                centroids, max_budget_pages, block_pages)
    if centroids is None:
        centroids = page_centroids(k_pages)
    return sparse_decode_pallas_checked(
        q, k_pages, v_pages, centroids, page_table, lengths, budget_pages, page_size=page_size,
        max_budget_pages=max_budget_pages, block_pages=block_pages, splits=splits,
        score_chunk=score_chunk, select_warps=select_warps, radix_bits=radix_bits,
        num_warps=num_warps, num_stages=num_stages, fuse_select=fuse_select,
        merge_in_kernel=merge_in_kernel, score_warps=score_warps, score_loop=score_loop,
        score_stages=score_stages, interpret=interpret)


def sparse_decode_pallas_checked(q, k_pages, v_pages, centroids, page_table, lengths,
                                 budget_pages, *, page_size, max_budget_pages=None,
                                 block_pages=None, splits=None, score_chunk=64, select_warps=4,
                                 radix_bits=1, num_warps=ATTEND_WARPS,
                                 num_stages=ATTEND_STAGES, fuse_select=False,
                                 merge_in_kernel=False, score_warps=4, score_loop=1,
                                 score_stages=1, interpret=False):
    """:func:`sparse_decode_pallas` for arguments its caller has already checked (as
    ``sparse_decode`` does) and given centroids: no checks here."""
    max_pages = max_budget_pages or page_table.shape[1]
    if block_pages is None:
        block_pages = default_block_pages(page_size)
    if splits is None:
        splits = default_splits(q.shape[0], k_pages.shape[0], max_pages, block_pages)
    return _sparse_decode(q, k_pages, v_pages, centroids, page_table.astype(jnp.int32),
                          lengths.astype(jnp.int32), budget_pages.astype(jnp.int32),
                          page_size=page_size, max_pages=max_pages, block_pages=block_pages,
                          splits=splits, score_chunk=score_chunk, select_warps=select_warps,
                          radix_bits=radix_bits, num_warps=num_warps, num_stages=num_stages,
                          fuse_select=fuse_select, merge_in_kernel=merge_in_kernel,
                          score_warps=score_warps, score_loop=score_loop,
                          score_stages=score_stages, interpret=interpret)


def _dims(page_table, max_pages, score_chunk, block_pages):
    kpad = max(_pow2(max_pages), block_pages)
    # mpad >= kpad: every list entry below kpad gets a value.
    mpad = max(_pow2(page_table.shape[1]), score_chunk, kpad)
    return mpad, kpad


def pad_heads(q: jax.Array, kv_heads: int) -> jax.Array:
    """q ``[B, Hq, D]`` -> ``[B, Hkv, Rpad, D]``: each KV head's query heads, zero rows added up
    to a power of two >= 16 (the smallest matrix-unit tile)."""
    b, hq, d = q.shape
    r = hq // kv_heads
    return jnp.pad(q.reshape(b, kv_heads, r, d),
                   ((0, 0), (0, 0), (0, max(16, _pow2(r)) - r), (0, 0)))


def select_page_lists(q_pad, group, centroids, page_table, lengths, budget_pages, *, page_size,
                      max_pages, score_chunk=64, block_pages=4, select_warps=4, radix_bits=1,
                      fuse_select=False, score_warps=4, score_loop=1, score_stages=1,
                      interpret=False):
    """Scoring and selection kernels: q_pad ``[B, Hkv, Rpad, D]`` (:func:`pad_heads`) holding
    ``group`` query heads per KV head, centroids ``[Hkv, N, D]``, page_table
    ``[B, M]``, lengths ``[B]``, budget_pages ``[B]`` (all int32) -> (phys ``[B, Hkv, Kpad]``,
    slots ``[B, Hkv, Kpad]``, count ``[B, Hkv, 1]``) int32: the chosen pages of each (sequence,
    KV head) in page order, as physical pages and as slots of the sequence; entries from count
    on repeat the last page. ``fuse_select``: one launch (:func:`_score_select_kernel`), the
    last-arriving scoring program of each row selects; else two kernels."""
    b, hkv, rpad, d = q_pad.shape
    n_total = centroids.shape[1]
    mpad, kpad = _dims(page_table, max_pages, score_chunk, block_pages)
    table = jnp.pad(page_table, ((0, 0), (0, mpad - page_table.shape[1])))
    if fuse_select:
        list_shapes = [jax.ShapeDtypeStruct((b, hkv, 2 * kpad), jnp.int32),
                       jax.ShapeDtypeStruct((b, hkv, 2 * kpad), jnp.int32),
                       jax.ShapeDtypeStruct((b, hkv, 1), jnp.int32)]
        row = pl.BlockSpec((1,), lambda ci, bi, hi: (bi,))
        per_row = lambda width: pl.BlockSpec((None, None, width), lambda ci, bi, hi: (bi, hi, 0))
        outs = pl.pallas_call(
            functools.partial(_score_select_kernel, page_size=page_size, chunk=score_chunk,
                              group=group, max_pages=max_pages,
                              slot_bits=int(math.log2(mpad)),
                              radix_bits=radix_bits, interpret=interpret),
            grid=(mpad // score_chunk, b, hkv),
            in_specs=[pl.BlockSpec((None, None, rpad, d), lambda ci, bi, hi: (bi, hi, 0, 0)),
                      pl.BlockSpec((None, n_total, d), lambda ci, bi, hi: (hi, 0, 0)),
                      pl.BlockSpec((None, mpad), lambda ci, bi, hi: (bi, 0)),
                      row, row, per_row(1)],
            out_specs=[per_row(mpad), per_row(2 * kpad), per_row(2 * kpad), per_row(1),
                       per_row(1)],
            out_shape=[jax.ShapeDtypeStruct((b, hkv, mpad), jnp.int32), *list_shapes,
                       jax.ShapeDtypeStruct((b, hkv, 1), jnp.int32)],
            input_output_aliases={5: 4},
            compiler_params=plgpu.CompilerParams(num_warps=select_warps, num_stages=1),
            interpret=interpret, name="sparse_decode_score_select",
        )(q_pad, centroids, table, lengths, budget_pages, jnp.zeros((b, hkv, 1), jnp.int32))
        return tuple(outs[1:4])

    keys = score_keys(q_pad, group, centroids, table, lengths, page_size=page_size,
                      score_chunk=score_chunk, score_warps=score_warps, score_loop=score_loop,
                      score_stages=score_stages, interpret=interpret)
    return select_from_keys(keys, table, lengths, budget_pages, page_size=page_size,
                            max_pages=max_pages, kpad=kpad, select_warps=select_warps,
                            radix_bits=radix_bits, interpret=interpret)


def score_keys(q_pad, group, centroids, table, lengths, *, page_size, score_chunk=64,
               score_warps=4, score_loop=1, score_stages=1, interpret=False):
    """The scoring kernel alone: table ``[B, Mpad]`` (padded, :func:`_dims`) -> keys
    ``[B, Hkv, Mpad]`` int32 (:func:`_score_chunk`); each program scores ``score_loop``
    chunks of ``score_chunk`` slots."""
    b, hkv, rpad, d = q_pad.shape
    n_total = centroids.shape[1]
    mpad = table.shape[1]
    loop = max(1, min(score_loop, mpad // score_chunk))
    span = score_chunk * loop
    return pl.pallas_call(
        functools.partial(_score_kernel, page_size=page_size, chunk=score_chunk, group=group,
                          loop=loop),
        grid=(b, hkv, mpad // span),
        in_specs=[pl.BlockSpec((None, None, rpad, d), lambda bi, hi, ci: (bi, hi, 0, 0)),
                  pl.BlockSpec((None, n_total, d), lambda bi, hi, ci: (hi, 0, 0)),
                  pl.BlockSpec((None, span), lambda bi, hi, ci: (bi, ci)),
                  pl.BlockSpec((1,), lambda bi, hi, ci: (bi,))],
        out_specs=pl.BlockSpec((None, None, span), lambda bi, hi, ci: (bi, hi, ci)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, mpad), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=score_warps, num_stages=score_stages),
        interpret=interpret, name="sparse_decode_score",
    )(q_pad, centroids, table, lengths)


def select_from_keys(keys, table, lengths, budget_pages, *, page_size, max_pages, kpad,
                     select_warps=4, radix_bits=1, interpret=False):
    """The selection kernel alone: keys ``[B, Hkv, Mpad]``, table ``[B, Mpad]`` -> the lists of
    :func:`select_page_lists`."""
    b, hkv, mpad = keys.shape
    row = pl.BlockSpec((1,), lambda bi, hi: (bi,))
    out = lambda: pl.BlockSpec((None, None, 2 * kpad), lambda bi, hi: (bi, hi, 0))
    return pl.pallas_call(
        functools.partial(_select_kernel, page_size=page_size, max_pages=max_pages,
                          slot_bits=int(math.log2(mpad)), radix_bits=radix_bits),
        grid=(b, hkv),
        in_specs=[pl.BlockSpec((None, None, mpad), lambda bi, hi: (bi, hi, 0)),
                  pl.BlockSpec((None, mpad), lambda bi, hi: (bi, 0)),
                  row, row],
        out_specs=[out(), out(), pl.BlockSpec((None, None, 1), lambda bi, hi: (bi, hi, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, 2 * kpad), jnp.int32),
                   jax.ShapeDtypeStruct((b, hkv, 2 * kpad), jnp.int32),
                   jax.ShapeDtypeStruct((b, hkv, 1), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=select_warps, num_stages=1),
        interpret=interpret, name="sparse_decode_select",
    )(keys, table, lengths, budget_pages)


def attend_page_lists(q_pad, group, k_pages, v_pages, phys, slots, count, lengths, *,
                      page_size, block_pages, splits, num_warps=ATTEND_WARPS,
                      num_stages=ATTEND_STAGES,
                      merge_in_kernel=False, interpret=False):
    """Attention kernel and split merge: q_pad ``[B, Hkv, Rpad, D]`` with ``group`` real heads,
    pages ``[Hkv, N, P, D]``, the lists of :func:`select_page_lists`, lengths ``[B]`` ->
    ``[B, Hkv * group, D]`` in q's dtype. The S partial results of a row are merged by its
    last split (``merge_in_kernel``) or in XLA."""
    b, hkv, rpad, d = q_pad.shape
    n_total = k_pages.shape[1]
    r = group
    kpad = phys.shape[-1]
    pages_spec = pl.BlockSpec((None, n_total, page_size, d), lambda bi, hi, si: (hi, 0, 0, 0))
    list_spec = pl.BlockSpec((None, None, kpad), lambda bi, hi, si: (bi, hi, 0))
    in_specs = [pl.BlockSpec((None, None, rpad, d), lambda bi, hi, si: (bi, hi, 0, 0)),
                pages_spec, pages_spec, list_spec, list_spec,
                pl.BlockSpec((None, None, 1), lambda bi, hi, si: (bi, hi, 0)),
                pl.BlockSpec((1,), lambda bi, hi, si: (bi,))]
    part_shapes = [jax.ShapeDtypeStruct((b, hkv, splits, rpad, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, rpad), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, rpad), jnp.float32)]
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    kw = dict(page_size=page_size, block_pages=block_pages, splits=splits, scale=d ** -0.5)

    if merge_in_kernel:
        row = lambda *blk: pl.BlockSpec((None, None, *blk),
                                        lambda bi, hi, si: (bi, hi) + (0,) * len(blk))
        outs = pl.pallas_call(
            functools.partial(_attend_merge_kernel, interpret=interpret, **kw),
            grid=(b, hkv, splits),
            in_specs=[*in_specs, row(1)],
            out_specs=[row(splits, rpad, d), row(splits, rpad), row(splits, rpad),
                       row(rpad, d), row(1)],
            out_shape=[*part_shapes, jax.ShapeDtypeStruct((b, hkv, rpad, d), q_pad.dtype),
                       jax.ShapeDtypeStruct((b, hkv, 1), jnp.int32)],
            input_output_aliases={7: 4}, compiler_params=params, interpret=interpret,
            name="sparse_decode_attend_merge",
        )(q_pad, k_pages, v_pages, phys, slots, count, lengths,
          jnp.zeros((b, hkv, 1), jnp.int32))
        out = outs[3]
        return (out if r == rpad else out[:, :, :r]).reshape(b, hkv * r, d)

    o, mx, l = pl.pallas_call(
        functools.partial(_attend_kernel, **kw),
        grid=(b, hkv, splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, rpad, d),
                                lambda bi, hi, si: (bi, hi, si, 0, 0)),
                   pl.BlockSpec((None, None, None, rpad), lambda bi, hi, si: (bi, hi, si, 0)),
                   pl.BlockSpec((None, None, None, rpad), lambda bi, hi, si: (bi, hi, si, 0))],
        out_shape=part_shapes, compiler_params=params, interpret=interpret,
        name="sparse_decode_attend",
    )(q_pad, k_pages, v_pages, phys, slots, count, lengths)

    # Merge the splits: rescale each to the common max. Empty splits have l = 0 and drop out;
    # a row with no tokens at all (length 0, padding) gets zeros.
    m_all = jnp.max(mx, axis=2, keepdims=True)
    w = jnp.exp(mx - m_all)
    l_all = jnp.sum(w * l, axis=2)
    o_all = jnp.sum(w[..., None] * o, axis=2)
    out = jnp.where(l_all[..., None] > 0,
                    o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None], 0.0)
    return out[:, :, :r].reshape(b, hkv * r, d).astype(q_pad.dtype)


@functools.partial(jax.jit, static_argnames=(
    "page_size", "max_pages", "block_pages", "splits", "score_chunk", "select_warps",
    "radix_bits", "num_warps", "num_stages", "fuse_select", "merge_in_kernel", "score_warps",
    "score_loop", "score_stages", "interpret"))
def _sparse_decode(q, k_pages, v_pages, centroids, page_table, lengths, budget_pages, *,
                   page_size, max_pages, block_pages, splits, score_chunk, select_warps,
                   radix_bits, num_warps, num_stages, fuse_select, merge_in_kernel, score_warps,
                   score_loop, score_stages, interpret):
    group = q.shape[1] // k_pages.shape[0]
    q_pad = pad_heads(q, k_pages.shape[0])
    phys, slots, count = select_page_lists(
        q_pad, group, centroids, page_table, lengths, budget_pages, page_size=page_size,
        max_pages=max_pages, score_chunk=score_chunk, block_pages=block_pages,
        select_warps=select_warps, radix_bits=radix_bits, fuse_select=fuse_select,
        score_warps=score_warps, score_loop=score_loop, score_stages=score_stages,
        interpret=interpret)
    return attend_page_lists(q_pad, group, k_pages, v_pages, phys, slots, count, lengths,
                             page_size=page_size, block_pages=block_pages, splits=splits,
                             num_warps=num_warps, num_stages=num_stages,
                             merge_in_kernel=merge_in_kernel, interpret=interpret)
