"""The ``@triton.jit`` kernels of one sparse decode step (docs/design.md, section 3), written
directly in Triton (no Pallas): what :mod:`pallas_kernels.sparse_decode_triton` launches through
jax-triton on a GPU, and what the CPU tests run in Triton's interpreter (``TRITON_INTERPRET=1``)
on NumPy arrays.

Rows are (sequence, KV head) pairs, ``row = b * HKV + h``. All arrays are contiguous:
q ``[B, HQ, D]``, pages ``[HKV, N, P, D]``, page summaries (centroids, or Quest's kmin and
kmax) ``[HKV, N, D]``, page table ``[B, M]``,
keys ``[rows, M]`` uint32, page lists ``[rows, MAXP]`` int32, counts ``[rows]``, partial results
``[rows, S, RPAD, D]`` / ``[rows, S, RPAD]`` float32. Offsets into the pool are int64: a 64K
context at batch 64 puts pages past 2**31 elements.

Scores become uint32 keys whose unsigned order is the float order, so that selecting the
``budget - 3`` best pages is a threshold search over integers: either four rounds of a 256-bin
histogram (one byte of the threshold per round) or 32 one-bit rounds of a block-wide count.
Ties at the threshold go to the lower page index through a prefix sum, as in
``sparrow_jax.attention.selection.select_pages``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Finite, so that a fully masked block cannot turn the running max into NaN.
MASK_VALUE = tl.constexpr(-0.7 * 3.4028234663852886e38)


@triton.jit
def _order_keys(score):
    """float32 -> uint32 with the same order (unsigned compare); -0.0 and 0.0 map alike."""
    bits = tl.where(score == 0.0, 0.0, score).to(tl.uint32, bitcast=True)
    # Negative floats order backwards in their magnitude bits: flip all bits; positive ones
    # go above every negative one: set the sign bit.
    flip = tl.where((bits >> 31) == 1, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
    return bits ^ flip


@triton.jit
def _group_mean(q_ptr, b, h, HQ: tl.constexpr, R: tl.constexpr, RPAD: tl.constexpr,
                D: tl.constexpr):
    """qbar ``[D]`` float32: the mean of the R query heads of KV head h."""
    r = tl.arange(0, RPAD)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * HQ + h * R + r)[:, None] * D + d[None, :], mask=(r < R)[:, None],
                other=0.0).to(tl.float32)
    return tl.sum(q, axis=0) / R


@triton.jit
def _chunk(len_ptr, HKV: tl.constexpr, P: tl.constexpr, C: tl.constexpr):
    """(row, b, h, slot ``[C]``, eligible ``[C]``) of a scoring program, grid (rows,
    cdiv(M, C)): pages ``1 .. n-3`` may be chosen."""
    row = tl.program_id(0)
    b = row // HKV
    n = tl.cdiv(tl.load(len_ptr + b), P)
    slot = tl.program_id(1) * C + tl.arange(0, C)
    return row, b, row % HKV, slot, (slot >= 1) & (slot < n - 2)


@triton.jit
def _page_rows(ptr, h, phys, eligible, N: tl.constexpr, D: tl.constexpr):
    """One page summary ``[C, D]`` float32 of the physical pages ``phys`` (int64; zero where
    not eligible)."""
    d = tl.arange(0, D)
    return tl.load(ptr + (h.to(tl.int64) * N + phys)[:, None] * D + d[None, :],
                   mask=eligible[:, None], other=0.0).to(tl.float32)


@triton.jit
def _store_keys(key_ptr, row, slot, eligible, score, M: tl.constexpr):
    """Keys of the chunk's slots; slots that may not be chosen get key 0, below every
    eligible key's."""
    tl.store(key_ptr + row * M + slot, tl.where(eligible, _order_keys(score), 0),
             mask=slot < M)


@triton.jit
def score_kernel(q_ptr, cent_ptr, table_ptr, len_ptr, key_ptr, HKV: tl.constexpr,
                 HQ: tl.constexpr, R: tl.constexpr, RPAD: tl.constexpr, D: tl.constexpr,
                 P: tl.constexpr, M: tl.constexpr, N: tl.constexpr, C: tl.constexpr):
    """Grid (rows, cdiv(M, C)): keys ``[C]`` of one chunk of one row's page slots, scored as
    ``qbar . centroid``."""
    row, b, h, slot, eligible = _chunk(len_ptr, HKV, P, C)
    qbar = _group_mean(q_ptr, b, h, HQ, R, RPAD, D)
    phys = tl.load(table_ptr + b * M + slot, mask=eligible, other=0).to(tl.int64)
    cent = _page_rows(cent_ptr, h, phys, eligible, N, D)
    # Elementwise products and a float32 sum: exact float32 arithmetic, never TF32.
    _store_keys(key_ptr, row, slot, eligible, tl.sum(cent * qbar[None, :], axis=1), M)


@triton.jit
def quest_score_kernel(q_ptr, kmin_ptr, kmax_ptr, table_ptr, len_ptr, key_ptr,
                       HKV: tl.constexpr, HQ: tl.constexpr, R: tl.constexpr,
                       RPAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr, M: tl.constexpr,
                       N: tl.constexpr, C: tl.constexpr):
    """:func:`score_kernel` with Quest's bound: the largest over the R query heads of
    ``sum_d max(q_d kmax_d, q_d kmin_d)``, elementwise in float32."""
    row, b, h, slot, eligible = _chunk(len_ptr, HKV, P, C)
    phys = tl.load(table_ptr + b * M + slot, mask=eligible, other=0).to(tl.int64)
    kmin = _page_rows(kmin_ptr, h, phys, eligible, N, D)
    kmax = _page_rows(kmax_ptr, h, phys, eligible, N, D)
    d = tl.arange(0, D)
    score = tl.full((C,), float("-inf"), tl.float32)
    for r in tl.static_range(R):
        qr = tl.load(q_ptr + (b * HQ + h * R + r) * D + d).to(tl.float32)[None, :]
        score = tl.maximum(score, tl.sum(tl.maximum(qr * kmax, qr * kmin), axis=1))
    _store_keys(key_ptr, row, slot, eligible, score, M)


@triton.jit
def _threshold_histogram(u, valid, k):
    """(T, rem): the k-th largest of the valid keys u ``[MPAD]`` uint32 (T = 2**32 - 1 when
    k = 0) and how many keys equal to T are among the k largest. One byte of T per round:
    a 256-bin histogram of that byte over the keys that match T's higher bytes."""
    bins = tl.arange(0, 256)
    rem = k
    prefix = tl.full([], 0, tl.uint32)
    for shift in tl.static_range(24, -1, -8):
        digit = ((u >> shift) & 0xFF).to(tl.int32)
        match = valid
        if shift < 24:
            match = valid & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
        hist = tl.histogram(digit, 256, mask=match)
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist   # keys >= digit d
        # Counts fall as digits rise: the last one still holding rem keys is T's byte.
        best = tl.sum((at_least >= rem).to(tl.int32), axis=0) - 1
        rem -= tl.sum(tl.where(bins == best, at_least - hist, 0), axis=0)
        prefix = prefix | (best.to(tl.uint32) << shift)
    return prefix, rem


@triton.jit
def _threshold_bitwise(u, valid, k):
    """:func:`_threshold_histogram` by 32 one-bit rounds: the largest T with
    ``#(u >= T) >= k``, from the top bit down, one block-wide count per bit."""
    t = tl.full([], 0, tl.uint32)
    for bit in tl.static_range(31, -1, -1):
        cand = t | (tl.full([], 1, tl.uint32) << bit)
        t = tl.where(tl.sum((valid & (u >= cand)).to(tl.int32), axis=0) >= k, cand, t)
    return t, k - tl.sum((valid & (u > t)).to(tl.int32), axis=0)


@triton.jit
def _select_row(u, table_ptr, phys_ptr, slot_ptr, count_ptr, row, b, n, budget,
                M: tl.constexpr, MPAD: tl.constexpr, MAXP: tl.constexpr,
                HISTOGRAM: tl.constexpr):
    """One row's page list from its keys u ``[MPAD]``: page 0, the last two pages and the
    ``budget - 3`` best-keyed eligible pages (all ``n`` pages when ``n <= budget``), stored in
    page order as physical pages and slots, with their count."""
    idx = tl.arange(0, MPAD)
    budget = tl.minimum(tl.maximum(budget, 3), MAXP)
    k = budget - 3
    valid = (idx >= 1) & (idx < n - 2)
    if HISTOGRAM:
        t, rem = _threshold_histogram(u, valid, k)
    else:
        t, rem = _threshold_bitwise(u, valid, k)
    equal = valid & (u == t)
    # Ties at the threshold: the rem lowest slots among the keys equal to it.
    tied = equal & (tl.cumsum(equal.to(tl.int32), axis=0) <= rem)
    chosen = (valid & (u > t)) | tied
    reserved = (idx == 0) | ((idx >= n - 2) & (idx < n))
    sel = tl.where(n <= budget, idx < n, reserved | chosen)
    # Compact in page order: the j-th chosen slot goes to entry j.
    rank = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    phys = tl.load(table_ptr + b * M + idx, mask=sel, other=0)
    tl.store(phys_ptr + row * MAXP + rank, phys, mask=sel)
    tl.store(slot_ptr + row * MAXP + rank, idx, mask=sel)
    tl.store(count_ptr + row, tl.sum(sel.to(tl.int32), axis=0))


@triton.jit
def select_kernel(key_ptr, table_ptr, len_ptr, budget_ptr, phys_ptr, slot_ptr, count_ptr,
                  HKV: tl.constexpr, P: tl.constexpr, M: tl.constexpr, MPAD: tl.constexpr,
                  MAXP: tl.constexpr, HISTOGRAM: tl.constexpr):
    """Grid (rows,): one row's page list from its keys ``[M]`` (:func:`score_kernel`)."""
    row = tl.program_id(0)
    b = row // HKV
    n = tl.cdiv(tl.load(len_ptr + b), P)
    idx = tl.arange(0, MPAD)
    u = tl.load(key_ptr + row * M + idx, mask=idx < M, other=0)
    _select_row(u, table_ptr, phys_ptr, slot_ptr, count_ptr, row, b, n, tl.load(budget_ptr + b),
                M, MPAD, MAXP, HISTOGRAM)


@triton.jit
def attend_kernel(q_ptr, k_ptr, v_ptr, phys_ptr, slot_ptr, count_ptr, len_ptr, o_ptr, m_ptr,
                  l_ptr, HKV: tl.constexpr, HQ: tl.constexpr, R: tl.constexpr,
                  RPAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                  MAXP: tl.constexpr, BP: tl.constexpr, S: tl.constexpr, SCALE: tl.constexpr,
                  IEEE: tl.constexpr):
    """Grid (rows, S): online-softmax attention of the R query heads of one row over its
    share (split ``s`` of S) of the row's page list, BP pages a step, pages gathered by
    computed pointers -> unnormalised output ``[RPAD, D]``, running max and sum ``[RPAD]``."""
    row = tl.program_id(0)
    s = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    count = tl.load(count_ptr + row)
    length = tl.load(len_ptr + b)
    blocks = tl.cdiv(count, BP)
    per_split = tl.cdiv(blocks, S)
    start = s * per_split
    stop = tl.minimum(start + per_split, blocks)
    r = tl.arange(0, RPAD)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * HQ + h * R + r)[:, None] * D + d[None, :], mask=(r < R)[:, None],
                other=0.0)
    t = tl.arange(0, BP * P)
    tok = t % P
    head = h.to(tl.int64) * N * P * D
    o = tl.zeros((RPAD, D), tl.float32)
    m = tl.full((RPAD,), MASK_VALUE, tl.float32)
    l = tl.zeros((RPAD,), tl.float32)
    for i in tl.range(start, stop):
        entry = i * BP + t // P                    # each token's list entry
        listed = entry < count
        phys = tl.load(phys_ptr + row * MAXP + entry, mask=listed, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + row * MAXP + entry, mask=listed, other=0)
        off = head + (phys * P + tok)[:, None] * D + d[None, :]
        k = tl.load(k_ptr + off, mask=listed[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_ptr + off, mask=listed[:, None], other=0.0).to(q.dtype)
        if IEEE:
            logits = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            logits = tl.dot(q, tl.trans(k))
        ok = listed & (slot * P + tok < length)
        logits = tl.where(ok[None, :], logits * SCALE, MASK_VALUE)
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        corr = tl.exp(m - m_new)
        p = tl.exp(logits - m_new[:, None])
        l = corr * l + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v)
        o = corr[:, None] * o + pv
        m = m_new
    part = row * S + s
    tl.store(o_ptr + (part * RPAD + r)[:, None] * D + d[None, :], o)
    tl.store(m_ptr + part * RPAD + r, m)
    tl.store(l_ptr + part * RPAD + r, l)
