"""The sparse step's attention on a flat grid shared out by list length (experimental, in no
impl until an H100 measures it; notes/kernel_notes.md): the same result as
:func:`pallas_kernels.sparse_decode_gpu.attend_page_lists`.

``attend_page_lists`` cuts every (row, KV head) page list into the same number of splits, one
wave of programs for the batch. A long row beside finished or short ones (a static batch's
tail, a continuous-refill chunk) then runs on as few programs as a short one: at 32K with 18
of 19 rows finished, 24 programs of 22 blocks each, 59.5 us a layer where its bytes need 6
(H100). A grid with more splits per row fixes that row but every step pays for the idle
programs and a padded merge (+0.18 ms a step at 19 rows, measured). Here the grid is one wave
(or one program a list, if more): program ``p`` finds its list and split from the prefix sum
of the lists' shares (:func:`list_shares`, computed in every program from the lists' counts),
writes its partial result at ``p``, and a second kernel merges each list's own partials.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_decode_gpu import (ATTEND_PROGRAMS_PER_SM, _MASK_VALUE, _attend,
                                              _pow2, sm_count)


def list_shares(counts: jax.Array, valid: jax.Array, *, programs: int, block_pages: int
                ) -> tuple[jax.Array, jax.Array]:
    """Programs of each list: counts ``[n]`` int32 (pages of each (row, KV head) list, those
    where ``valid [n]`` is False ignored) -> (shares, starts) ``[n]`` int32, list i run by
    programs ``starts[i] .. starts[i] + shares[i] - 1``. Each valid list gets one program and
    the ``programs - n_valid`` others in proportion to its blocks of pages, never more than it
    has blocks, so shares sum to at most ``programs``; lists of equal length get equal shares."""
    blocks = jnp.where(valid, (counts + block_pages - 1) // block_pages, 0)
    total = jnp.maximum(jnp.sum(blocks), 1)
    extra = programs - jnp.sum(valid.astype(jnp.int32))
    shares = jnp.where(valid, jnp.minimum(1 + blocks * extra // total, jnp.maximum(blocks, 1)),
                       0)
    return shares, jnp.cumsum(shares) - shares


def _load_shares(counts_ref, *, programs, block_pages):
    n = counts_ref.shape[0]
    idx = lax.broadcasted_iota(jnp.int32, (_pow2(n),), 0)
    counts = plgpu.load(counts_ref.at[pl.ds(0, _pow2(n))], mask=idx < n, other=0)
    shares, starts = list_shares(counts, idx < n, programs=programs, block_pages=block_pages)
    return idx, counts, shares, starts


def _pick(idx, i, values):
    """values[i] from a vector (0 where i is past it)."""
    return jnp.sum(jnp.where(idx == i, values, 0))


def _balanced_attend_kernel(q_ref, k_ref, v_ref, phys_ref, slot_ref, counts_ref, len_ref,
                            o_ref, m_ref, l_ref, *, kv_heads, programs, **settings):
    """Program p: split ``p - starts[i]`` of list i, the list whose programs hold p (none past
    the shares' sum: an empty result)."""
    p = pl.program_id(0)
    idx, counts, shares, starts = _load_shares(counts_ref, programs=programs,
                                               block_pages=settings["block_pages"])
    n = counts_ref.shape[0]
    i = jnp.sum(jnp.where((idx < n) & (starts + shares <= p), 1, 0))   # n: no list
    row = jnp.minimum(i // kv_heads, len_ref.shape[0] - 1)
    _attend(q_ref, k_ref, v_ref, phys_ref, slot_ref, _pick(idx, i, counts), len_ref[row],
            o_ref, m_ref, l_ref, splits=jnp.maximum(_pick(idx, i, shares), 1),
            at=(row, i % kv_heads, p - _pick(idx, i, starts)), **settings)


def _merge_kernel(counts_ref, o_ref, m_ref, l_ref, out_ref, *, kv_heads, programs,
                  block_pages, group, rpad):
    """List i = (row, KV head): its partial results rescaled to their common max and summed
    (an empty split has l = 0 and adds nothing), its query heads written to ``out[row]``."""
    i = pl.program_id(0)
    idx, _, shares, starts = _load_shares(counts_ref, programs=programs,
                                          block_pages=block_pages)
    start, share = _pick(idx, i, starts), _pick(idx, i, shares)
    junk = m_ref.shape[1] - 1
    d = o_ref.shape[2]
    r = lax.broadcasted_iota(jnp.int32, (rpad,), 0)
    r_d = lax.broadcasted_iota(jnp.int32, (rpad, d), 0)
    c_d = lax.broadcasted_iota(jnp.int32, (rpad, d), 1)

    def body(s, carry):
        o, m, l = carry
        at = start + s
        m_s = plgpu.load(m_ref.at[at, jnp.minimum(r, junk)], mask=r < group,
                         other=_MASK_VALUE)
        l_s = plgpu.load(l_ref.at[at, jnp.minimum(r, junk)], mask=r < group, other=0.0)
        o_s = plgpu.load(o_ref.at[at, jnp.minimum(r_d, junk), c_d], mask=r_d < group,
                         other=0.0)
        m_new = jnp.maximum(m, m_s)
        a, b = jnp.exp(m - m_new), jnp.exp(m_s - m_new)
        return a[:, None] * o + b[:, None] * o_s, m_new, a * l + b * l_s

    init = (jnp.zeros((rpad, d), jnp.float32), jnp.full((rpad,), _MASK_VALUE, jnp.float32),
            jnp.zeros((rpad,), jnp.float32))
    o, _, l = lax.fori_loop(0, share, body, init)
    out = jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    # One store a query head: a masked store of the padded tile would aim its masked rows at
    # other heads' places, which interpret mode writes back (with their old values).
    for g in range(group):
        head = jnp.sum(jnp.where(r_d == g, out, 0.0), axis=0)
        out_ref[i // kv_heads, (i % kv_heads) * group + g, :] = head.astype(out_ref.dtype)


def attend_page_lists_balanced(q, k_pages, v_pages, phys, slots, count, lengths, *, page_size,
                               tuning, programs=None, interpret=False):
    """As :func:`pallas_kernels.sparse_decode_gpu.attend_page_lists` (``tuning`` resolved; its
    splits unused), on ``programs`` programs (default one wave, :data:`ATTEND_PROGRAMS_PER_SM`
    a streaming multiprocessor; at least one a list)."""
    b, hq, d = q.shape
    hkv = k_pages.shape[0]
    group = hq // hkv
    rpad = max(16, _pow2(group))
    rows = group + (group < rpad)
    n = b * hkv
    programs = max(programs or ATTEND_PROGRAMS_PER_SM * sm_count(), n)
    counts = count.reshape(n)
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    per_program = lambda *blk: pl.BlockSpec((None, *blk), lambda p: (p,) + (0,) * len(blk))
    settings = dict(kv_heads=hkv, programs=programs, block_pages=tuning.block_pages)
    o, mx, l = pl.pallas_call(
        functools.partial(_balanced_attend_kernel, page_size=page_size, group=group,
                          rpad=rpad, scale=d ** -0.5, **settings),
        grid=(programs,),
        in_specs=[whole(q), whole(k_pages), whole(v_pages), whole(phys), whole(slots),
                  whole(counts), whole(lengths)],
        out_specs=[per_program(rows, d), per_program(rows), per_program(rows)],
        out_shape=[jax.ShapeDtypeStruct((programs, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((programs, rows), jnp.float32),
                   jax.ShapeDtypeStruct((programs, rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=tuning.attend_warps,
                                             num_stages=tuning.attend_stages),
        interpret=interpret, name="sparse_decode_attend_balanced",
    )(q, k_pages, v_pages, phys, slots, counts, lengths)
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return pl.pallas_call(
        functools.partial(_merge_kernel, group=group, rpad=rpad, **settings),
        grid=(n,),
        in_specs=[whole(counts), whole(o), whole(mx), whole(l)],
        out_specs=whole(out), out_shape=out,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="sparse_decode_merge",
    )(counts, o, mx, l)
