"""Attention of a row's query group over a list of its pages, the GPU kernels (Pallas, Triton
lowering; interpret mode on CPU) shared by the sparse step and dense decode.

The sparse step's lists are the selection's (:mod:`pallas_kernels.sparse_decode_gpu`), dense
decode's each row's page table (:func:`attend_table`, the engine's dense attention on GPU).
Online softmax over blocks of pages in float32; a list is cut into splits (flash-decoding) so
that small batches still fill the GPU, and the splits' partial results are merged:

- :func:`attend_page_lists` and :func:`attend_table`, grid ``(B, Hkv, S)``: every list in the
  same S splits, one wave of programs for the batch (:func:`default_splits`; dense decode at
  least one split per :data:`TABLE_SPLIT_PAGES` pages, :func:`table_splits`), merged in XLA
  (:func:`merge_splits`).
- :func:`attend_page_lists_balanced` and :func:`attend_table_balanced`
  (``GpuDecodeTuning.balanced``; the sparse step's default from two rows, dense decode keeps
  even splits):
  one wave of programs sharing the lists' blocks of pages evenly (stream-K), so that a long
  row beside finished or short ones (a static batch's tail, a continuous-refill chunk) is
  not left to the batch's even split: at 32K with 18 of 19 rows finished, the even split
  gave the long row 24 programs of 22 blocks each, 59.5 us a layer where its bytes need 6
  (H100), and a grid with more splits a row made every step pay for its idle programs and a
  padded merge (+0.18 ms a step at 19 rows). The blocks are laid end to end
  (:func:`list_units`) and program ``p`` takes its share of them
  (:func:`units_per_program`), across lists' ends where they fall. Programs that each stay
  inside one list leave some idle when the lists do not divide the wave (at 34 rows of 8 KV
  heads, 272 lists in 528 programs got one program each: half the wave idle, the attention
  twice its bytes' time; H200). For each list it touches, a program writes its partial
  result and counts its arrival on the list; the list's last program to arrive merges the
  list's partials (one launch, no merge kernel after it).

A group's query heads are read from the unpadded ``[B, Hq, D]`` into ``Rpad >= 16`` rows (the
matrix units' minimum) by a masked load; only the group's rows of the partial results are
written (a junk row takes the padding rows' masked stores).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite, so that a fully masked block cannot turn the running max into NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): Triton's block sides."""
    return 1 << max(0, (int(x) - 1).bit_length())


def group_queries(q_ref, kv_head, group: int, rows: int, row=()) -> jax.Array:
    """The query heads of KV head ``kv_head`` from q ``[Hq, D]`` (or ``q[row]`` of ``[B, Hq,
    D]``) as ``[rows, D]``, zero rows past ``group``."""
    hq, d = q_ref.shape[len(row):]
    r = lax.broadcasted_iota(jnp.int32, (rows, d), 0)
    head = jnp.minimum(kv_head * group + r, hq - 1)
    return plgpu.load(q_ref.at[(*row, head, lax.broadcasted_iota(jnp.int32, (rows, d), 1))],
                      mask=r < group, other=0)


def _attend_kernel(q_ref, k_ref, v_ref, phys_ref, slot_ref, count_ref, len_ref,
                   o_ref, m_ref, l_ref, **settings):
    """q ``[Hq, D]`` (this row), pages ``[N, P, D]`` (this KV head), page list ``[Kpad]`` of
    physical pages and their slots in the row -> this split's partial results
    (:func:`_attend`)."""
    _attend(q_ref, k_ref, v_ref, phys_ref, slot_ref, count_ref[0], len_ref[0],
            o_ref, m_ref, l_ref, **settings)


def _table_attend_kernel(q_ref, k_ref, v_ref, table_ref, len_ref, o_ref, m_ref, l_ref,
                         **settings):
    """Dense decode: the list is the row's page table ``[W]``, every page below its length."""
    length = len_ref[0]
    count = (length + settings["page_size"] - 1) // settings["page_size"]
    _attend(q_ref, k_ref, v_ref, table_ref, None, count, length, o_ref, m_ref, l_ref,
            **settings)


def _attend(q_ref, k_ref, v_ref, phys_ref, slot_ref, count, length, o_ref, m_ref, l_ref, *,
            page_size, block_pages, splits, group, rpad, scale, at=None, part_at=(),
            span=None):
    """Online-softmax attention of one row's query group over this split's share of the
    ``count`` listed pages (slots: ``slot_ref``, or the list positions when None) -> its
    unnormalised output ``[G, D]`` f32, running max and sum ``[G]`` (the group's heads,
    computed as ``Rpad`` rows; a G-th junk row takes the padding rows' masked stores).
    ``at``: None, the grid's (row, KV head, split) blocks; or traced ``(row, kv_head, split)``
    indexing whole arrays (q ``[B, Hq, D]``, pages ``[Hkv, N, P, D]``, lists ``[B, Hkv, L]`` or
    a page table ``[B, W]``; ``splits`` traced too): a Triton load takes one index
    expression, not a view of a view. ``part_at``: where the partial results go in whole
    output arrays (the balanced kernel's segment), none for the grid's blocks. ``span``:
    traced ``(first, stop)`` blocks of the list in place of the split's (``splits`` unused),
    ``stop`` clipped to the list's blocks."""
    if at is None:
        row, pages_at, list_at = (), (), ()
        kv, s = pl.program_id(1), pl.program_id(2)
    else:
        r, kv, s = at
        row, pages_at = (r,), (kv,)
        list_at = (r, kv) if len(phys_ref.shape) == 3 else (r,)     # a list, or a table
    d = o_ref.shape[-1]
    block_k = block_pages * page_size
    width = phys_ref.shape[-1]
    blocks = (count + block_pages - 1) // block_pages
    if span is None:
        per_split = (blocks + splits - 1) // splits
        start = s * per_split
        stop = jnp.minimum(start + per_split, blocks)
    else:
        start, stop = span[0], jnp.minimum(span[1], blocks)
    q = group_queries(q_ref, kv, group, rpad, row)
    cdt = jnp.promote_types(q.dtype, k_ref.dtype)
    q = q.astype(cdt)
    tok = lax.broadcasted_iota(jnp.int32, (block_pages, page_size), 1)
    entry = lax.broadcasted_iota(jnp.int32, (block_pages, page_size), 0)

    def body(i, carry):
        o, m, l = carry
        sl = pl.ds(i * block_pages, block_pages)
        if slot_ref is None:
            # A page table's width need not be a multiple of the block: past it, page 0.
            slot = i * block_pages + lax.broadcasted_iota(jnp.int32, (block_pages,), 0)
            phys = plgpu.load(phys_ref.at[(*list_at, sl)], mask=slot < width, other=0)
        else:
            phys = phys_ref[(*list_at, sl)]
            slot = slot_ref[(*list_at, sl)]
        k = k_ref[(*pages_at, phys)].reshape(block_k, d).astype(cdt)
        v = v_ref[(*pages_at, phys)].reshape(block_k, d).astype(cdt)
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
    junk = o_ref.shape[len(part_at)] - 1
    row = lax.broadcasted_iota(jnp.int32, (rpad,), 0)
    row_d = lax.broadcasted_iota(jnp.int32, (rpad, d), 0)
    col_d = lax.broadcasted_iota(jnp.int32, (rpad, d), 1)
    plgpu.store(o_ref.at[(*part_at, jnp.minimum(row_d, junk), col_d)], o, mask=row_d < group)
    plgpu.store(m_ref.at[(*part_at, jnp.minimum(row, junk))], m, mask=row < group)
    plgpu.store(l_ref.at[(*part_at, jnp.minimum(row, junk))], l, mask=row < group)


# Attention programs per SM at the default settings (228 registers a thread at 2 warps).
ATTEND_PROGRAMS_PER_SM = 4


def sm_count() -> int:
    """Streaming multiprocessors of the first device (132, an H100's, off GPU)."""
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132) if dev.platform == "gpu" else 132


def default_splits(batch: int, kv_heads: int, max_pages: int, block_pages: int) -> int:
    """Splits of each page list: as many as one wave of attention programs holds
    (:data:`ATTEND_PROGRAMS_PER_SM` per SM), at least one, at least one block of pages per
    split. One wave, because a second, partly filled wave leaves the GPU idle at its end: at
    batch 32 (256 rows) two splits took 180 us where four took 183 (H100)."""
    slots = ATTEND_PROGRAMS_PER_SM * sm_count()
    blocks = -(-max_pages // block_pages)
    return int(max(1, min(blocks, slots // (batch * kv_heads))))


# Dense decode: pages a split covers at most (16 blocks of 4), whatever the batch.
TABLE_SPLIT_PAGES = 64


def table_splits(batch: int, kv_heads: int, width: int, block_pages: int) -> int:
    """Splits of each row's page table in dense decode: :func:`default_splits`, and at least
    enough that a split covers :data:`TABLE_SPLIT_PAGES` pages of a full-width row. Rows differ
    in length (a static batch's tail: a few long rows among finished ones), so one wave sized
    for the batch leaves a lone long row to a few programs: at batch 32 with one 8K row live,
    2 splits took 0.199 ms a layer, 16 took 0.052; with all 32 live, 0.406 and 0.421 (H100)."""
    return max(default_splits(batch, kv_heads, width, block_pages),
               -(-width // TABLE_SPLIT_PAGES))


def attend_page_lists(q, k_pages, v_pages, phys, slots, count, lengths, *, page_size, tuning,
                      interpret=False, arrivals=None):
    """Attention kernel and split merge: q ``[B, Hq, D]``, pages ``[Hkv, N, P, D]``, the lists
    of :func:`select_page_lists`, lengths ``[B]`` -> ``[B, Hq, D]`` in q's dtype; ``tuning``
    resolved (:meth:`GpuDecodeTuning.resolve`); ``tuning.balanced``:
    :func:`attend_page_lists_balanced` (``arrivals``: its zeroed counters, if the caller has
    them)."""
    if tuning.balanced:
        return attend_page_lists_balanced(q, k_pages, v_pages, phys, slots, count, lengths,
                                          page_size=page_size, tuning=tuning,
                                          interpret=interpret, arrivals=arrivals)
    list_spec = pl.BlockSpec((None, None, phys.shape[-1]), lambda bi, hi, si: (bi, hi, 0))
    count_spec = pl.BlockSpec((None, None, 1), lambda bi, hi, si: (bi, hi, 0))
    return _attend_call(_attend_kernel, q, k_pages, v_pages, [list_spec, list_spec, count_spec],
                        [phys, slots, count], lengths, page_size=page_size, tuning=tuning,
                        interpret=interpret, name="sparse_decode_attend")


def attend_table(q, k_pages, v_pages, page_table, lengths, *, page_size, tuning,
                 interpret=False):
    """Dense decode attention with the sparse step's attention kernel, each row's list being
    its page table: q ``[B, Hq, D]``, pages ``[Hkv, N, P, D]``, page_table ``[B, W]`` int32,
    lengths ``[B]`` int32 -> ``[B, Hq, D]`` in q's dtype; ``tuning`` resolved for
    ``max_pages=W``. A row's splits share its own pages, so a short row in a wide table costs
    its length, and rows read no head padding (JAX's GPU paged attention gives every row
    ``W / k_splits``-page programs and writes 16 rows a group). ``tuning.balanced``:
    :func:`attend_table_balanced`."""
    if tuning.balanced:
        return attend_table_balanced(q, k_pages, v_pages, page_table, lengths,
                                     page_size=page_size, tuning=tuning, interpret=interpret)
    return _attend_call(_table_attend_kernel, q, k_pages, v_pages,
                        [pl.BlockSpec((None, page_table.shape[1]), lambda bi, hi, si: (bi, 0))],
                        [page_table], lengths, page_size=page_size, tuning=tuning,
                        interpret=interpret, name="dense_decode_attend")


def _attend_call(kernel, q, k_pages, v_pages, list_specs, lists, lengths, *, page_size, tuning,
                 interpret, name):
    """One attention kernel launch, grid ``(B, Hkv, S)``, and the split merge."""
    b, hq, d = q.shape
    hkv, n_total = k_pages.shape[:2]
    group = hq // hkv
    rpad = max(16, pow2(group))
    rows = group + (group < rpad)               # the group's heads and a junk row, if any
    splits = tuning.splits
    pages_spec = pl.BlockSpec((None, n_total, page_size, d), lambda bi, hi, si: (hi, 0, 0, 0))
    per_split = lambda *blk: pl.BlockSpec((None, None, None, *blk),
                                          lambda bi, hi, si: (bi, hi, si) + (0,) * len(blk))
    o, mx, l = pl.pallas_call(
        functools.partial(kernel, page_size=page_size, block_pages=tuning.block_pages,
                          splits=splits, group=group, rpad=rpad, scale=d ** -0.5),
        grid=(b, hkv, splits),
        in_specs=[pl.BlockSpec((None, hq, d), lambda bi, hi, si: (bi, 0, 0)),
                  pages_spec, pages_spec, *list_specs,
                  pl.BlockSpec((1,), lambda bi, hi, si: (bi,))],
        out_specs=[per_split(rows, d), per_split(rows), per_split(rows)],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, splits, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, rows), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=tuning.attend_warps,
                                             num_stages=tuning.attend_stages),
        interpret=interpret, name=name,
    )(q, k_pages, v_pages, *lists, lengths)
    return merge_splits(o, mx, l, group).astype(q.dtype)


def merge_splits(o, mx, l, group):
    """Partial results ``o [B, Hkv, S, R, D]``, max and sum ``[B, Hkv, S, R]`` (the first
    ``group`` of R rows real) -> ``[B, Hkv * group, D]`` float32: each split rescaled to the
    common max. Empty splits have l = 0 and drop out; a row with no tokens at all (length 0,
    padding) gets zeros."""
    b, hkv, _, _, d = o.shape
    m_all = jnp.max(mx, axis=2, keepdims=True)
    w = jnp.exp(mx - m_all)
    l_all = jnp.sum(w * l, axis=2)
    o_all = jnp.sum(w[..., None] * o, axis=2)
    out = jnp.where(l_all[..., None] > 0,
                    o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None], 0.0)
    return out[:, :, :group].reshape(b, hkv * group, d)


def list_units(counts: jax.Array, valid: jax.Array, *, block_pages: int
               ) -> tuple[jax.Array, jax.Array]:
    """The work units of each list, its blocks of pages laid end to end: counts ``[n]`` int32
    (pages of each (row, KV head) list, those where ``valid [n]`` is False ignored) -> (units,
    ends) ``[n]`` int32, list i holding units ``ends[i] - units[i] .. ends[i] - 1``. A valid
    list of no pages holds one unit (its program writes the list's zeros)."""
    units = jnp.where(valid, jnp.maximum((counts + block_pages - 1) // block_pages, 1), 0)
    return units, jnp.cumsum(units)


def units_per_program(total: jax.Array, programs: int) -> jax.Array:
    """Units a program takes when ``programs`` share ``total``: the fewest that cover them,
    ``ceil(total / programs)``, the same for every program (program p holds ``p * chunk ..
    (p + 1) * chunk - 1``, the last ones fewer or none), so a unit's program is one division
    (an even split would give the busiest program no fewer)."""
    return jnp.maximum((total + programs - 1) // programs, 1)


def _list_counts(ref, *, table, kv_heads, page_size):
    """(index ``[Npad]``, n, counts ``[Npad]``): the pages of every (row, KV head) list, padded
    to a power of two with zeros; read from the lists' counts ``[B * Hkv]``, or for page
    tables (``table``) from the rows' lengths ``[B]``."""
    n = ref.shape[0] * (kv_heads if table else 1)
    idx = lax.broadcasted_iota(jnp.int32, (pow2(n),), 0)
    if not table:
        return idx, n, plgpu.load(ref.at[pl.ds(0, pow2(n))], mask=idx < n, other=0)
    lengths = plgpu.load(ref.at[jnp.minimum(idx // kv_heads, ref.shape[0] - 1)], mask=idx < n,
                         other=0)
    return idx, n, (lengths + page_size - 1) // page_size


def _pick(idx, i, values):
    """values[i] from a vector (0 where i is past it)."""
    return jnp.sum(jnp.where(idx == i, values, 0))


def _balanced_attend_kernel(q_ref, k_ref, v_ref, list_ref, *refs, table, kv_heads, programs,
                            compiled, **settings):
    """Program p: its :func:`units_per_program` of the lists' blocks laid end to end
    (:func:`list_units`; stream-K: every program the same work whatever the lists' lengths,
    so a program may finish one list and start the next). For each list i it touches, its
    partial result is written at segment ``p + i`` (segments run in order of their units,
    and from one to the next p or i or both grow: each has its own place), then its arrival
    counted on list i; the list's last program to arrive merges the list's
    segments into ``out`` (no second launch). Lists: refs = (slots, counts, lengths,
    arrivals, out, o, m, l, arrivals out); page tables: (lengths, arrivals, out, o, m, l,
    arrivals out)."""
    if table:
        slot_ref, (len_ref, _, out_ref, o_ref, m_ref, l_ref, arrivals_ref) = None, refs
        counts_ref = len_ref
    else:
        slot_ref, counts_ref, len_ref, _, out_ref, o_ref, m_ref, l_ref, arrivals_ref = refs
    idx, n, count = _list_counts(counts_ref, table=table, kv_heads=kv_heads,
                                 page_size=settings["page_size"])
    units, ends = list_units(count, idx < n, block_pages=settings["block_pages"])
    total = jnp.sum(units)
    chunk = units_per_program(total, programs)
    p = pl.program_id(0)
    lo, hi = p * chunk, jnp.minimum((p + 1) * chunk, total)

    def segment(i, carry):
        end = _pick(idx, i, ends)
        first = end - _pick(idx, i, units)
        row = jnp.minimum(i // kv_heads, len_ref.shape[0] - 1)
        _attend(q_ref, k_ref, v_ref, list_ref, slot_ref, _pick(idx, i, count), len_ref[row],
                o_ref, m_ref, l_ref, splits=1, at=(row, i % kv_heads, 0), part_at=(p + i,),
                span=(jnp.maximum(lo, first) - first, jnp.minimum(hi, end) - first),
                **settings)
        # Every thread's partial stores before the arrival, which releases them (the atomic
        # is acquire-release at GPU scope); the last to arrive reads the others' by volatile
        # loads, past the SM's L1, which may hold lines of partials read before they were
        # written (a line holds several segments' maxima). Interpret mode runs the programs
        # one after another, so a plain count is the same there (and it cannot discharge
        # an atomic inside a loop).
        if compiled:
            plgpu.debug_barrier()
            arrived = plgpu.atomic_add(arrivals_ref, i, jnp.ones((), jnp.int32))
        else:
            arrived = arrivals_ref[i]
            arrivals_ref[i] = arrived + 1
        p_first, p_last = first // chunk, (end - 1) // chunk

        @pl.when(arrived == p_last - p_first)
        def _():
            _merge_list(i, p_first + i, p_last - p_first + 1, o_ref, m_ref, l_ref, out_ref,
                        kv_heads=kv_heads, group=settings["group"])
        return carry

    @pl.when(lo < total)
    def _():
        # The lists holding units lo and hi - 1: those ending before them are counted
        # (padding entries end at total, after both).
        i_first = jnp.sum(jnp.where(ends <= lo, 1, 0))
        i_last = jnp.sum(jnp.where(ends <= hi - 1, 1, 0))
        lax.fori_loop(i_first, i_last + 1, segment, 0)


# Partial results the merge reads at once: its loop's loads are not pipelined, so one
# partial an iteration would pay a load's latency for each of a lone row's ~32 splits.
MERGE_CHUNK = 8


def _merge_list(i, start, share, o_ref, m_ref, l_ref, out_ref, *, kv_heads, group):
    """List i = (row, KV head): its partial results at ``start .. start + share - 1``
    rescaled to their common max and summed (an empty split has l = 0 and adds nothing),
    :data:`MERGE_CHUNK` partials at a time, its query heads written to ``out[row]``."""
    junk = m_ref.shape[1] - 1
    parts, _, d = o_ref.shape
    gpad = pow2(group)         # no matrix units here: the group's rows, not the 16 of a dot
    c, r = (lax.broadcasted_iota(jnp.int32, (MERGE_CHUNK, gpad), ax) for ax in (0, 1))
    c_d, r_d, d_d = (lax.broadcasted_iota(jnp.int32, (MERGE_CHUNK, gpad, d), ax)
                     for ax in (0, 1, 2))

    def body(j, carry):
        o, m, l = carry
        at, at_d = start + j * MERGE_CHUNK + c, start + j * MERGE_CHUNK + c_d
        ok, ok_d = (at < start + share) & (r < group), (at_d < start + share) & (r_d < group)
        at, at_d = jnp.minimum(at, parts - 1), jnp.minimum(at_d, parts - 1)
        m_s = plgpu.load(m_ref.at[at, jnp.minimum(r, junk)], mask=ok, other=_MASK_VALUE,
                         volatile=True)
        l_s = plgpu.load(l_ref.at[at, jnp.minimum(r, junk)], mask=ok, other=0.0,
                         volatile=True)
        o_s = plgpu.load(o_ref.at[at_d, jnp.minimum(r_d, junk), d_d], mask=ok_d, other=0.0,
                         volatile=True)
        m_new = jnp.maximum(m, jnp.max(m_s, axis=0))
        a, b = jnp.exp(m - m_new), jnp.exp(m_s - m_new[None, :])
        return (a[:, None] * o + jnp.sum(b[:, :, None] * o_s, axis=0), m_new,
                a * l + jnp.sum(b * l_s, axis=0))

    init = (jnp.zeros((gpad, d), jnp.float32), jnp.full((gpad,), _MASK_VALUE, jnp.float32),
            jnp.zeros((gpad,), jnp.float32))
    o, _, l = lax.fori_loop(0, (share + MERGE_CHUNK - 1) // MERGE_CHUNK, body, init)
    out = jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    # One store a query head: a masked store of the padded tile would aim its masked rows at
    # other heads' places, which interpret mode writes back (with their old values).
    g_d = lax.broadcasted_iota(jnp.int32, (gpad, d), 0)
    for g in range(group):
        head = jnp.sum(jnp.where(g_d == g, out, 0.0), axis=0)
        out_ref[i // kv_heads, (i % kv_heads) * group + g, :] = head.astype(out_ref.dtype)


def attend_page_lists_balanced(q, k_pages, v_pages, phys, slots, count, lengths, *, page_size,
                               tuning, programs=None, interpret=False, arrivals=None):
    """As :func:`attend_page_lists` (``tuning`` resolved; its splits unused), on ``programs``
    programs (default one wave: :data:`ATTEND_PROGRAMS_PER_SM` a streaming multiprocessor),
    each list merged by its last program. ``arrivals``: the lists' arrival
    counters, zeros of ``count``'s shape (the selection's, see
    :func:`~pallas_kernels.sparse_decode_gpu.select_page_lists`); None: zeros made here."""
    return _balanced_call(q, k_pages, v_pages, [phys, slots, count.reshape(-1)], lengths,
                          table=False, page_size=page_size, tuning=tuning,
                          programs=programs, interpret=interpret,
                          name="sparse_decode_attend_balanced",
                          arrivals=None if arrivals is None else arrivals.reshape(-1))


def attend_table_balanced(q, k_pages, v_pages, page_table, lengths, *, page_size, tuning,
                          programs=None, interpret=False):
    """As :func:`attend_table`, the work shared out as :func:`attend_page_lists_balanced`
    shares it (a row's pages its list for each KV head)."""
    return _balanced_call(q, k_pages, v_pages, [page_table], lengths,
                          table=True, page_size=page_size, tuning=tuning,
                          programs=programs, interpret=interpret,
                          name="dense_decode_attend_balanced")


def _balanced_call(q, k_pages, v_pages, lists, lengths, *, table, page_size, tuning, programs,
                   interpret, name, arrivals=None):
    """The balanced attention, merge included: one launch, grid ``(programs,)``; ``lists``:
    the page lists, their slots and counts, or the page table (whose lists' pages
    :func:`_list_counts` reads from the lengths). The partial results and the arrival counts
    are outputs only because a Pallas GPU kernel has no global scratch; the counts start at
    zero each call: ``arrivals`` if given (``[lists]`` zeros), else zeros from XLA (a launch
    of its own)."""
    b, hq, d = q.shape
    hkv = k_pages.shape[0]
    group = hq // hkv
    rpad = max(16, pow2(group))
    rows = group + (group < rpad)
    programs = programs or ATTEND_PROGRAMS_PER_SM * sm_count()
    parts = programs + b * hkv          # segment p + i's places
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * len(x.shape))
    if arrivals is None:
        arrivals = jnp.zeros((b * hkv,), jnp.int32)
    ins = [q, k_pages, v_pages, *lists, lengths, arrivals]
    outs = [jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((parts, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((parts, rows), jnp.float32),
            jax.ShapeDtypeStruct((parts, rows), jnp.float32),
            jax.ShapeDtypeStruct(arrivals.shape, arrivals.dtype)]
    out, *_ = pl.pallas_call(
        functools.partial(_balanced_attend_kernel, table=table, kv_heads=hkv, programs=programs,
                          compiled=not interpret,
                          page_size=page_size, block_pages=tuning.block_pages, group=group,
                          rpad=rpad, scale=d ** -0.5),
        grid=(programs,),
        in_specs=[whole(x) for x in ins],
        out_specs=[whole(x) for x in outs], out_shape=outs,
        input_output_aliases={len(ins) - 1: len(outs) - 1},
        compiler_params=plgpu.CompilerParams(num_warps=tuning.attend_warps,
                                             num_stages=tuning.attend_stages),
        interpret=interpret, name=name,
    )(*ins)
    return out
