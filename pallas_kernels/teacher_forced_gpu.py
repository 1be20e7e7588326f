"""Teacher-forced sparse attention's forward and backward as Pallas kernels (Triton lowering
on GPU, interpret mode on CPU): a selection kernel, then flash attention under a per-query page
mask.

Teacher forcing replays one decode step per position, each with its own page selection
(docs/design.md, section 3). The XLA formulation computes ``[chunk, T]`` score tensors, written
to memory and read back by the mask, the softmax and the backward; here scores live only in
registers, FlashAttention-2 style, and a key block that no query of a query block selected is
skipped. (Measured on the H100 at 8K and 32K with the paper schedule: no block is skipped,
since each query's pages are its own and a block's union covers its prefix; BENCHMARKS.md.)

* ``_select_kernel`` (:func:`select_pages_kernel`), grid ``(B, Hkv, C / rows)``: the block
  top-k of ``rows`` queries from their float32 scores (computed in XLA), a bitwise threshold
  search per query held on chip instead of a sort; equals
  :func:`sparrow_jax.attention.selection.select_pages` bit for bit.

The mask's format, :func:`page_words`: bit ``p % 32`` of ``words[b, h, p // 32, i]`` says
whether query ``i`` of KV head ``h`` selected page ``p``. Key ``j`` is visible to query ``i``
iff ``j <= i`` and the bit of page ``j // page_size`` is set. A key block lies inside one word
(block_k divides ``32 * page_size``), so each block step loads one int32 per query. Three
attention kernels, grid ``(B, Hq, blocks)``, query heads sharing their KV head's keys and mask:

* ``_forward_kernel``: per query block, an online softmax over the causal key blocks; writes
  the output and the log-sum-exp.
* ``_dkv_kernel``: per key block, a loop over the query blocks at and after it; dk and dv per
  query head, summed over each KV head's group in XLA.
* ``_dq_kernel``: per query block, the forward's loop again, for dq.

The reference is the XLA path of :mod:`sparrow_jax.attention.teacher_forced` (same numerics:
float32 scores from the inputs' dtype, probabilities meeting v in v's dtype).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sparrow_jax.attention.selection import order_key

WORD_PAGES = 32
# Finite, so that a fully masked block cannot turn the running max into NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _is_pow2(x: int) -> bool:
    return x >= 1 and not x & (x - 1)


@dataclasses.dataclass(frozen=True)
class TeacherForcedTuning:
    """Block sizes and launch settings (speed only, never the result): the forward's and dq's
    query/key blocks, the dk/dv kernel's blocks, Triton warps and pipeline stages, the selection
    kernel's queries a program and warps. Every block a power of two >= 16."""

    block_q: int = 64
    block_k: int = 64
    bwd_block_q: int = 64
    bwd_block_k: int = 64
    warps: int = 4
    bwd_warps: int = 4
    stages: int = 2
    select_rows: int = 16
    select_warps: int = 8

    def __post_init__(self):
        for name in ("block_q", "block_k", "bwd_block_q", "bwd_block_k", "select_rows"):
            b = getattr(self, name)
            if not _is_pow2(b) or b < 16:
                raise ValueError(f"TeacherForcedTuning.{name} must be a power of two >= 16, "
                                 f"got {b}")
        for name in ("warps", "bwd_warps", "select_warps"):
            w = getattr(self, name)
            if not _is_pow2(w) or w > 32:
                raise ValueError(f"TeacherForcedTuning.{name} must be a power of two in "
                                 f"[1, 32], got {w}")
        if self.stages < 1:
            raise ValueError(f"TeacherForcedTuning.stages must be >= 1, got {self.stages}")

    @property
    def multiple(self) -> int:
        """Sequence lengths the kernels take are multiples of this."""
        return max(self.block_q, self.block_k, self.bwd_block_q, self.bwd_block_k,
                   self.select_rows)

    def check(self, page_size: int) -> None:
        for name in ("block_k", "bwd_block_k"):
            b = getattr(self, name)
            if (WORD_PAGES * page_size) % b or (b > page_size and b % page_size):
                raise ValueError(f"TeacherForcedTuning.{name}={b} must divide "
                                 f"{WORD_PAGES} x page_size = {WORD_PAGES * page_size} and be "
                                 f"a multiple of page_size when larger than it")


def page_words(mask: jax.Array) -> jax.Array:
    """mask ``[B, H, T, M]`` bool (page slots chosen by each query) -> words ``[B, H, W, T]``
    int32, ``W = ceil(M / 32)``: bit ``p % 32`` of ``words[..., p // 32, i]`` is ``mask[..., i,
    p]``."""
    b, h, t, m = mask.shape
    w = -(-m // WORD_PAGES)
    bits = jnp.pad(mask, ((0, 0), (0, 0), (0, 0), (0, w * WORD_PAGES - m)))
    bits = bits.reshape(b, h, t, w, WORD_PAGES).astype(jnp.uint32)
    words = jnp.sum(bits << jnp.arange(WORD_PAGES, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
    return lax.bitcast_convert_type(words, jnp.int32).transpose(0, 1, 3, 2)


# Integer arithmetic inside kernels goes through lax with int32 constants: jnp's // and % add
# sign corrections whose weakly typed constants the Triton lowering mistypes. All operands are
# non-negative, so truncating division is floor division.
def _div(x, n: int):
    return lax.div(x, jnp.int32(n))


def _page_bit(pos, page_size: int):
    return lax.rem(_div(pos, page_size), jnp.int32(WORD_PAGES))


def _visible(words, q0, k0, bq: int, bk: int, page_size: int):
    """words ``[bq]`` of the key block's word -> bool ``[bq, bk]``: page bit and causality."""
    qpos = q0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    kpos = k0 + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    bits = lax.shift_right_logical(jnp.broadcast_to(words[:, None], (bq, bk)),
                                   _page_bit(kpos, page_size))
    return ((bits & jnp.int32(1)) == jnp.int32(1)) & (qpos >= kpos)


def _block_selected(words, k0, bk: int, page_size: int):
    """Whether any query whose word is in ``words`` selected a page of the key block at k0."""
    span = max(bk // page_size, 1)
    bits = lax.shift_right_logical(words, jnp.broadcast_to(_page_bit(k0, page_size),
                                                           words.shape))
    return jnp.max(bits & jnp.int32((1 << span) - 1)) > jnp.int32(0)


def _dot(a, b, **kw):
    # float32 accumulation; no TF32, so float32 inputs (tests) are exact products.
    return plgpu.dot(a, b, allow_tf32=False, **kw).astype(jnp.float32)


def _word_column(k0, page_size: int):
    return _div(k0, WORD_PAGES * page_size)


_INT_MIN = -(2 ** 31)
_SELECT_TILE = 16384


def _row_count(mask):
    return jnp.sum(mask.astype(jnp.int32), axis=1)


def _select_kernel(score_ref, n_ref, budget_ref, sel_ref, *, slot_bits):
    """Block top-k of ``R`` queries at once: scores ``[R, Mpad]`` float32, pages in use ``[R]``,
    budgets ``[R]`` -> chosen ``[R, Mpad]`` int8 (:func:`sparrow_jax.attention.selection.
    select_pages`' rule: reserved pages, the ``budget - 3`` best eligible ones, ties to the lower
    page; dense when the budget covers every page in use). No sort: per row, the threshold key is
    built bit by bit from the sign down, each round one count over the row held on chip."""
    r, mpad = score_ref.shape
    n = n_ref[...][:, None]
    budget = jnp.maximum(budget_ref[...], jnp.int32(3))[:, None]
    idx = lax.broadcasted_iota(jnp.int32, (r, mpad), 1)
    eligible = (idx >= jnp.int32(1)) & (idx < n - jnp.int32(2))
    keys = jnp.where(eligible, order_key(score_ref[...]), jnp.int32(_INT_MIN))
    k = (budget - jnp.int32(3))[:, 0]
    # Largest t with #(keys >= t) >= k per row; INT_MIN keys are never counted, k = 0 ends at
    # INT_MAX (nothing chosen).
    t = jnp.where(_row_count(keys >= jnp.int32(0)) >= k, jnp.int32(0), jnp.int32(_INT_MIN))
    for bit in range(30, -1, -1):
        cand = t | jnp.int32(1 << bit)
        t = jnp.where(_row_count(keys >= cand[:, None]) >= k, cand, t)
    above = keys > t[:, None]
    need = k - _row_count(above)
    equal = keys == t[:, None]
    # Ties at the threshold: the `need` lowest slots among the equal keys.
    j = jnp.zeros((r,), jnp.int32)
    for bit in range(slot_bits - 1, -1, -1):
        cand = j + jnp.int32(1 << bit)
        j = jnp.where(_row_count(equal & (idx < cand[:, None])) < need, cand, j)
    chosen = above | (equal & (idx <= j[:, None]) & (need[:, None] > jnp.int32(0)))
    reserved = (idx == jnp.int32(0)) | ((idx >= n - jnp.int32(2)) & (idx < n))
    sel = jnp.where(n <= budget, idx < n, reserved | chosen)
    sel_ref[...] = sel.astype(sel_ref.dtype)


def select_pages_kernel(scores: jax.Array, n: jax.Array, budget: jax.Array, *, rows: int = 16,
                        warps: int = 8, interpret: bool = False) -> jax.Array:
    """scores ``[B, H, C, M]`` float32, n ``[C]`` pages in use, budget ``[B, C]`` -> bool ``[B,
    H, C, M]``: :func:`~sparrow_jax.attention.selection.select_pages` for every query, ``rows``
    queries a program (fewer when the pages are many). C must be a multiple of ``rows``."""
    b, h, c, m = scores.shape
    mpad = 1 << max(0, (m - 1).bit_length())
    # A program holds rows x Mpad keys in registers: beyond 16K of them (64 a thread at 8 warps)
    # they spill, which at 32K context (Mpad 4096) made selection the layer's largest cost.
    rows = max(1, min(rows, _SELECT_TILE // mpad))
    scores = jnp.pad(scores, ((0, 0), (0, 0), (0, 0), (0, mpad - m)))
    block = pl.BlockSpec((None, None, rows, mpad), lambda b, h, i: (b, h, i, 0))
    sel = pl.pallas_call(
        functools.partial(_select_kernel, slot_bits=max(mpad.bit_length(), 1)),
        grid=(b, h, c // rows),
        in_specs=[block, pl.BlockSpec((rows,), lambda b, h, i: (i,)),
                  pl.BlockSpec((None, rows), lambda b, h, i: (b, i))],
        out_specs=block, out_shape=jax.ShapeDtypeStruct((b, h, c, mpad), jnp.int8),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret, name="teacher_forced_select",
    )(scores, n.astype(jnp.int32), budget.astype(jnp.int32))
    return sel[..., :m] > 0


def _forward_kernel(q_ref, k_ref, v_ref, w_ref, o_ref, lse_ref, *, bq, bk, page_size, scale):
    q0 = pl.program_id(2) * bq
    q = q_ref[...]
    d = q.shape[-1]

    def step(kb, carry):
        k0 = kb * bk
        words = w_ref[_word_column(k0, page_size), pl.ds(q0, bq)]

        def attend(carry):
            acc, m, l = carry
            k = k_ref[pl.ds(k0, bk), :]
            v = v_ref[pl.ds(k0, bk), :]
            vis = _visible(words, q0, k0, bq, bk, page_size)
            s = _dot(q, k, trans_b=True) * scale
            s = jnp.where(vis, s, _MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = _dot(p.astype(v.dtype), v)
            return acc * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

        return lax.cond(_block_selected(words, k0, bk, page_size), attend, lambda c: c, carry)

    init = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), _MASK_VALUE, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(0, _div(q0 + bq + bk - 1, bk), step, init)
    # Every real query sees its own key; the guard only keeps padding finite.
    l = jnp.where(l > 0, l, 1.0)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dkv_kernel(q_ref, k_ref, v_ref, w_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                bq, bk, page_size, scale):
    k0 = pl.program_id(2) * bk
    k = k_ref[...]
    v = v_ref[...]
    d = k.shape[-1]
    column = _word_column(k0, page_size)

    def step(qb, carry):
        q0 = qb * bq
        words = w_ref[column, pl.ds(q0, bq)]

        def accumulate(carry):
            dk, dv = carry
            q = q_ref[pl.ds(q0, bq), :]
            do = do_ref[pl.ds(q0, bq), :]
            lse = lse_ref[pl.ds(q0, bq)]
            delta = delta_ref[pl.ds(q0, bq)]
            vis = _visible(words, q0, k0, bq, bk, page_size)
            s = _dot(q, k, trans_b=True) * scale
            p = jnp.where(vis, jnp.exp(s - lse[:, None]), 0.0)
            dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
            dp = _dot(do, v, trans_b=True)
            ds = p * (dp - delta[:, None])
            dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
            return dk, dv

        return lax.cond(_block_selected(words, k0, bk, page_size), accumulate, lambda c: c,
                        carry)

    init = (jnp.zeros((bk, d), jnp.float32), jnp.zeros((bk, d), jnp.float32))
    dk, dv = lax.fori_loop(_div(k0, bq), q_ref.shape[0] // bq, step, init)
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, w_ref, do_ref, lse_ref, delta_ref, dq_ref, *, bq, bk,
               page_size, scale):
    q0 = pl.program_id(2) * bq
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]

    def step(kb, dq):
        k0 = kb * bk
        words = w_ref[_word_column(k0, page_size), pl.ds(q0, bq)]

        def accumulate(dq):
            k = k_ref[pl.ds(k0, bk), :]
            v = v_ref[pl.ds(k0, bk), :]
            vis = _visible(words, q0, k0, bq, bk, page_size)
            s = _dot(q, k, trans_b=True) * scale
            p = jnp.where(vis, jnp.exp(s - lse[:, None]), 0.0)
            dp = _dot(do, v, trans_b=True)
            ds = p * (dp - delta[:, None])
            return dq + _dot(ds.astype(k.dtype), k)

        return lax.cond(_block_selected(words, k0, bk, page_size), accumulate, lambda c: c, dq)

    dq = lax.fori_loop(0, _div(q0 + bq + bk - 1, bk), step,
                       jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _specs(b_q, t, d, group):
    """BlockSpecs over ``[B, T, H, D]`` arrays: a query head's block, its whole KV head."""
    q_block = pl.BlockSpec((None, b_q, None, d), lambda b, h, i: (b, i, h, 0))
    kv_whole = pl.BlockSpec((None, t, None, d), lambda b, h, i: (b, 0, h // group, 0))
    return q_block, kv_whole


def _forward(q, k, v, words, page_size, tuning, interpret):
    b, t, hq, d = q.shape
    group = hq // k.shape[2]
    bq, bk = tuning.block_q, tuning.block_k
    q_block, kv_whole = _specs(bq, t, d, group)
    w_spec = pl.BlockSpec((None, None, words.shape[2], t), lambda b, h, i: (b, h // group, 0, 0))
    kernel = functools.partial(_forward_kernel, bq=bq, bk=bk, page_size=page_size,
                               scale=d ** -0.5)
    return pl.pallas_call(
        kernel, grid=(b, hq, t // bq),
        in_specs=[q_block, kv_whole, kv_whole, w_spec],
        out_specs=[q_block, pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, hq, t), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=tuning.warps, num_stages=tuning.stages),
        interpret=interpret, name="teacher_forced_forward",
    )(q, k, v, words)


def _backward(q, k, v, words, out, lse, do, page_size, tuning, interpret):
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    bq, bk = tuning.bwd_block_q, tuning.bwd_block_k
    scale = d ** -0.5
    delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    delta = delta.transpose(0, 2, 1)                                    # [B, Hq, T]
    params = plgpu.CompilerParams(num_warps=tuning.bwd_warps, num_stages=tuning.stages)
    w_spec = pl.BlockSpec((None, None, words.shape[2], t), lambda b, h, i: (b, h // group, 0, 0))
    whole_q = pl.BlockSpec((None, t, None, d), lambda b, h, i: (b, 0, h, 0))
    whole_row = pl.BlockSpec((None, None, t), lambda b, h, i: (b, h, 0))
    k_block = pl.BlockSpec((None, bk, None, d), lambda b, h, i: (b, i, h // group, 0))
    dkv_block = pl.BlockSpec((None, bk, None, d), lambda b, h, i: (b, i, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, bq=bq, bk=bk, page_size=page_size, scale=scale),
        grid=(b, hq, t // bk),
        in_specs=[whole_q, k_block, k_block, w_spec, whole_q, whole_row, whole_row],
        out_specs=[dkv_block, dkv_block],
        out_shape=[jax.ShapeDtypeStruct((b, t, hq, d), jnp.float32)] * 2,
        compiler_params=params, interpret=interpret, name="teacher_forced_dkv",
    )(q, k, v, words, do, lse, delta)
    q_block, kv_whole = _specs(bq, t, d, group)
    row_block = pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, bq=bq, bk=bk, page_size=page_size, scale=scale),
        grid=(b, hq, t // bq),
        in_specs=[q_block, kv_whole, kv_whole, w_spec, q_block, row_block, row_block],
        out_specs=q_block, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params, interpret=interpret, name="teacher_forced_dq",
    )(q, k, v, words, do, lse, delta)
    # The query heads of a group share their KV head: their dk/dv add up.
    dk = dk.reshape(b, t, hkv, group, d).sum(axis=3).astype(k.dtype)
    dv = dv.reshape(b, t, hkv, group, d).sum(axis=3).astype(v.dtype)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def page_masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, words: jax.Array,
                          page_size: int, tuning: TeacherForcedTuning = TeacherForcedTuning(),
                          interpret: bool = False) -> jax.Array:
    """q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]``, words ``[B, Hkv, W, T]`` (:func:`page_words`)
    -> ``[B, T, Hq, D]`` in q's dtype: softmax(q k^T / sqrt(D)) v over the keys each query sees.

    T must be a multiple of ``tuning.multiple`` and D a power of two >= 16 (the caller pads);
    every query must see at least one key. Differentiable in q, k and v.
    """
    return _forward(q, k, v, words, page_size, tuning, interpret)[0]


def _vjp_forward(q, k, v, words, page_size, tuning, interpret):
    out, lse = _forward(q, k, v, words, page_size, tuning, interpret)
    return out, (q, k, v, words, out, lse)


def _vjp_backward(page_size, tuning, interpret, residuals, do):
    q, k, v, words, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, words, out, lse, do, page_size, tuning, interpret)
    return dq, dk, dv, None


page_masked_attention.defvjp(_vjp_forward, _vjp_backward)


def check_args(q, k, v, words, page_size: int, tuning: TeacherForcedTuning) -> None:
    """The kernels' shape limits, raised as one line each."""
    b, t, hq, d = q.shape
    if not _is_pow2(d) or d < 16:
        raise ValueError(f"teacher-forced kernel: head_dim must be a power of two >= 16, got {d}")
    if t % tuning.multiple:
        raise ValueError(f"teacher-forced kernel: T={t} must be a multiple of "
                         f"{tuning.multiple} (pad it)")
    w = -(-(-(-t // page_size)) // WORD_PAGES)
    if words.shape != (b, k.shape[2], w, t):
        raise ValueError(f"teacher-forced kernel: words must be {(b, k.shape[2], w, t)}, got "
                         f"{words.shape}")
    tuning.check(page_size)
