"""The CUDA attention of the sparse step (pallas_kernels/sparse_attend_cuda.cu) against float64
NumPy: over hand-made page lists (ragged counts, empty lists, masked tails; even splits and
stream-K, and the choice between them made on the device), and as
the attention of the whole step (``GpuDecodeTuning(attend="cuda")``) on issue 5's matrix
against the reference of docs/design.md, section 3 (tests/reference_np.py). These need an
NVIDIA GPU and nvcc; on a CPU they are skipped with that reason. What runs on a CPU: the
choice between the CUDA and the Pallas attention, and the splits' rule.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attend_cuda import (attend_page_lists_cuda, attend_selected_cuda,
                                               default_cuda_splits, score_select_attend_cuda,
                                               select_attend_lists_cuda, select_lists_cuda,
                                               unavailable, unsupported_args)
from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, resolve_attend, select_from_keys,
                                              sparse_decode_pallas)
from reference_np import KERNEL_BUDGETS, KERNEL_LENGTHS, assert_kernel_close, random_kernel_case
from test_sparse_kernel import as64, make_case, reference

P, D = 16, 128
WHY = unavailable()
needs_cuda = pytest.mark.skipif(WHY is not None, reason=f"the CUDA attention {WHY}")


def lists_case(rng, *, b, hkv, group, counts, pool=400, width=40, short=0):
    """Random bf16 queries and pages, and lists of ``counts[b][h]`` distinct pages (random
    slots of a ``width``-page sequence, in slot order) padded with junk past each count;
    lengths ``short`` tokens before the end of the last page."""
    q = jnp.asarray(rng.standard_normal((b, hkv * group, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((hkv, pool, P, D)) * 2, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((hkv, pool, P, D)), jnp.bfloat16)
    table = rng.permutation(pool)[: b * width].reshape(b, width)
    phys = rng.integers(0, pool, (b, hkv, width)).astype(np.int32)     # junk past the count
    slots = np.full((b, hkv, width), 10 ** 6, np.int32)
    for i in range(b):
        for h in range(hkv):
            chosen = np.sort(rng.choice(width, counts[i][h], replace=False))
            phys[i, h, :len(chosen)] = table[i, chosen]
            slots[i, h, :len(chosen)] = chosen
    lengths = np.full((b,), width * P - short, np.int32)
    return q, k, v, phys, slots, np.asarray(counts, np.int32)[..., None], lengths


def attention_np(q, k, v, phys, slots, counts, lengths):
    """float64: each query head over its KV head's listed pages' tokens before the length."""
    q, k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
    b, hq, _ = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    out = np.zeros((b, hq, D))
    for i in range(b):
        for h in range(hkv):
            n = counts[i, h, 0]
            pos = (slots[i, h, :n, None] * P + np.arange(P)).reshape(-1)
            keep = pos < lengths[i]
            if not keep.any():
                continue
            kk = k[h, phys[i, h, :n]].reshape(-1, D)[keep]
            vv = v[h, phys[i, h, :n]].reshape(-1, D)[keep]
            s = q[i, h * group:(h + 1) * group] @ kk.T / np.sqrt(D)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[i, h * group:(h + 1) * group] = (w / w.sum(-1, keepdims=True)) @ vv
    return out


LAYOUTS = {   # how the blocks share the lists
    "even1": dict(balanced=False, splits=1), "even3": dict(balanced=False, splits=3),
    "even16": dict(balanced=False, splits=16),
    # a list's 3 or 8 parts one cluster of blocks (the default where they fit), or not
    "even8": dict(balanced=False, splits=8), "even3_global": dict(balanced=False, splits=3,
                                                                   cluster=False),
    "even3_on5": dict(balanced=False, splits=3, programs=5),   # blocks take several parts
    # blocks take several whole lists, each next one's first pages loaded during a merge
    "even1_on5": dict(balanced=False, splits=1, programs=5),
    "streamk1": dict(balanced=True, programs=1), "streamk5": dict(balanced=True, programs=5),
    "streamk64": dict(balanced=True, programs=64), "auto": {},
    # the device's choice where the even parts take two rounds of the blocks
    "auto_on5": dict(programs=5, splits=1)}


@needs_cuda
@pytest.mark.parametrize("group", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lists_match_float64(group, layout):
    """Ragged counts (0, 1, fewer than the block's 8 warps, more than a split holds), junk
    past each count, the last page's tail masked; even splits more than some lists' entries,
    and stream-K on one block (every list in it), on blocks that share lists and lists that
    share blocks, and on more blocks than pages."""
    rng = np.random.default_rng(group * 31 + list(LAYOUTS).index(layout))
    counts = [[0, 1, 5, 40], [9, 17, 33, 2], [40, 3, 8, 16]]
    args = lists_case(rng, b=3, hkv=4, group=group, counts=counts, short=5)
    got = jax.jit(functools.partial(attend_page_lists_cuda, **LAYOUTS[layout]))(*args)
    assert got.shape == args[0].shape and got.dtype == jnp.bfloat16
    want = attention_np(*args)
    got = as64(got)
    assert np.all(got[0, :group] == 0)                  # the empty list: zeros
    assert_kernel_close(got, want, low_precision=True)


@needs_cuda
@pytest.mark.parametrize("layout", ["even1", "even3_on5", "streamk5", "auto", "auto_on5"])
def test_lists_of_one_length(layout):
    """Every list as long (the device chooses stream-K on the default blocks, even splits on
    5)."""
    rng = np.random.default_rng(5)
    args = lists_case(rng, b=4, hkv=2, group=4, counts=[[24, 24]] * 4)
    got = jax.jit(functools.partial(attend_page_lists_cuda, **LAYOUTS[layout]))(*args)
    assert_kernel_close(as64(got), attention_np(*args), low_precision=True)


@needs_cuda
@pytest.mark.parametrize("balanced", [False, True])
def test_long_lists_are_staged_in_pieces(balanced):
    """A list of 14000 pages, more entries than the block's shared memory stages at once
    (~8K beside its 128 KB of page stages and 32 KB for the warps' merge): staged in pieces."""
    rng = np.random.default_rng(11)
    args = lists_case(rng, b=1, hkv=1, group=4, counts=[[13990]], pool=14100, width=14000)
    got = jax.jit(functools.partial(attend_page_lists_cuda, balanced=balanced, splits=1,
                                    programs=1))(*args)
    assert_kernel_close(as64(got), attention_np(*args), low_precision=True)


@needs_cuda
@pytest.mark.parametrize("counts,programs", [
    ([[600, 0], [3, 1200]], 2),     # next lists of fewer entries than warps, and past 512
    ([[5, 40], [0, 2]], 2),         # next lists of no entries, and of two
    ([[100, 9000]], 1),             # the next list longer than the staged entries fit
])
def test_whole_lists_in_turn(counts, programs):
    """Even splits of one part a list on fewer blocks than lists: a block's next list (its
    count, its entries up to 512 and each warp's first page) is loaded while it streams the
    one before, the next list staged ahead only where its entries fit."""
    rng = np.random.default_rng(len(counts) * 7 + programs)
    width = max(map(max, counts)) + 10
    args = lists_case(rng, b=len(counts), hkv=2, group=4, counts=counts,
                      pool=len(counts) * width + 100, width=width, short=7)
    got = jax.jit(functools.partial(attend_page_lists_cuda, balanced=False, splits=1,
                                    programs=programs))(*args)
    assert_kernel_close(as64(got), attention_np(*args), low_precision=True)


@needs_cuda
@pytest.mark.parametrize("how", [dict(balanced=True, programs=300),
                                 dict(balanced=False, splits=75)])
@pytest.mark.parametrize("group", [5, 8])
def test_a_list_merged_from_many_parts(how, group):
    """One long row among rows of one page (a batch's last row decoding alone): its lists
    merged from ~200 stream-K parts or 75 even ones, more than a warp's 32 lanes weigh at
    once and not a multiple of the merge's 8 loads in flight."""
    rng = np.random.default_rng(group)
    counts = [[600, 599]] + [[1, 1]] * 3
    args = lists_case(rng, b=4, hkv=2, group=group, counts=counts, pool=2600, width=600,
                      short=3)
    got = jax.jit(functools.partial(attend_page_lists_cuda, **how))(*args)
    assert_kernel_close(as64(got), attention_np(*args), low_precision=True)


@needs_cuda
def test_repeated_calls_reset_their_counters():
    """The merge counters are reset by the call that used them: the same call twice, and a
    call on counters it was given, agree with the first."""
    rng = np.random.default_rng(3)
    args = lists_case(rng, b=2, hkv=2, group=4, counts=[[40, 30], [12, 7]])
    call = jax.jit(attend_page_lists_cuda,
                   static_argnames=("splits", "programs", "balanced", "cluster"))
    for how in (dict(splits=4, balanced=False, cluster=False), dict(programs=7, balanced=True),
                dict(splits=4, balanced=False)):
        first = np.asarray(call(*args, **how).astype(jnp.float32))
        again = np.asarray(call(*args, **how).astype(jnp.float32))
        given = np.asarray(call(*args, **how, arrivals=jnp.zeros((2, 2, 1), jnp.int32)
                                ).astype(jnp.float32))
        np.testing.assert_array_equal(first, again)
        np.testing.assert_array_equal(first, given)


def check_step(rng, lengths, budgets, r, **tuning):
    q, k, v, cent, table, lengths = make_case(rng, lengths=lengths, hkv=2, r=r, d=D,
                                              dtype=jnp.bfloat16)
    budgets = jnp.asarray(budgets, jnp.int32)
    out = sparse_decode_pallas(q, k, v, table, lengths, budgets, page_size=P, centroids=cent,
                               tuning=GpuDecodeTuning(attend="cuda", **tuning))
    want, _ = reference(q, k, v, cent, table, lengths, budgets)
    assert_kernel_close(as64(out), want, low_precision=True)


@needs_cuda
@pytest.mark.parametrize("r", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("how", [{}, dict(splits=1), dict(splits=3), dict(balanced=False),
                                 dict(balanced=True), dict(balanced=True, attend_programs=3)])
def test_step_matches_float64_reference(r, how):
    check_step(np.random.default_rng(r), KERNEL_LENGTHS, KERNEL_BUDGETS, r, **how)


@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize("r", [1, 2, 3, 4, 5, 6, 7, 8])
def test_full_matrix(r):
    rng = np.random.default_rng(r * 7 + D)
    lengths, budgets = random_kernel_case(rng)
    check_step(rng, lengths, budgets, r)


@needs_cuda
@pytest.mark.parametrize("r", [1, 2, 5, 8])
@pytest.mark.parametrize("how", [{}, dict(splits=1), dict(splits=3)])
def test_lists_chosen_in_the_attention_match_float64(r, how):
    """``select_in_attention``: each block chooses its list's pages from the scoring's keys
    (the minimum budget, small ones, exactly n, more than the row), in one part a list, in
    clusters of 3, and in the default splits (4 a list here, clusters)."""
    check_step(np.random.default_rng(r + 40), KERNEL_LENGTHS, KERNEL_BUDGETS, r,
               select_in_attention=True, **how)


@needs_cuda
@pytest.mark.parametrize("lengths, budgets", [([515], [20]), ([515], [3]), ([300], [40]),
                                              ([47000], [130]), ([9], [3])])
def test_one_row_chosen_in_the_attention_matches_float64(lengths, budgets):
    """One row as the decode step meets it (even splits, one cluster a list; 8 parts, as a
    model's 8 KV heads get at 32K, where this case's 2 would get more by default): a budget
    within the row, the minimum, more than the row, a table of ~2900 slots (12 a thread in
    the search), and a row of one page."""
    check_step(np.random.default_rng(lengths[0]), lengths, budgets, 4, select_in_attention=True,
               splits=8)


KEY_FAMILIES = {   # int32 keys [n] of a row, as the scoring might hand them over
    "few_values": lambda rng, n: rng.choice([-5, 0, 3], n),     # ties at the threshold
    "all_equal": lambda rng, n: np.full(n, 7),                  # no bit differs: all ties
    "low_bits": lambda rng, n: 1000 + rng.integers(0, 4, n),    # only the lowest bits differ
    "full_range": lambda rng, n: rng.integers(-2 ** 31 + 1, 2 ** 31, n),
    "one_scale": lambda rng, n: rng.integers(2 ** 30, 2 ** 30 + 2 ** 20, n),
}


def chosen_lists_np(keys, lengths, budgets, *, width, max_pages):
    """The selection rule in NumPy: per row and KV head, page 0, the last two and the K - 3
    eligible pages of largest key (ties to the lower page), every page where the row has at
    most K -> the chosen slots ``[B, Hkv, width]`` and their counts ``[B, Hkv, 1]``."""
    hkv, b, _ = keys.shape
    slots = np.zeros((b, hkv, width), np.int64)
    counts = np.zeros((b, hkv, 1), np.int64)
    for i in range(b):
        n = min(-(-int(lengths[i]) // P), width)
        k = min(max(int(budgets[i]), 3), max_pages)
        for h in range(hkv):
            if n <= k:
                chosen = list(range(n))
            else:
                eligible = sorted(range(1, n - 2), key=lambda s: (-int(keys[h, i, s]), s))
                chosen = sorted([0, n - 2, n - 1] + eligible[:k - 3])
            slots[i, h, :len(chosen)] = chosen
            counts[i, h, 0] = len(chosen)
    return slots, counts


@needs_cuda
@pytest.mark.parametrize("family", list(KEY_FAMILIES))
@pytest.mark.parametrize("splits", [1, 3])
def test_keys_chosen_in_the_attention_match_the_rule(family, splits):
    """The in-block choice on keys made to stress its search: ties at the threshold, keys
    all equal, keys that differ only in their lowest bits or across the whole int32 range,
    keys of one scale (the top bits shared); budgets from the minimum to past the row."""
    rng = np.random.default_rng(len(family) + splits)
    b, hkv, group, width, pool = 4, 2, 2, 300, 1400
    lengths = np.array([300 * P, 211 * P - 5, 40 * P, 17], np.int32)
    budgets = np.array([40, 3, 64, 5], np.int32)
    max_pages = 64
    keys = np.stack([np.stack([KEY_FAMILIES[family](rng, width) for _ in range(b)])
                     for _ in range(hkv)]).astype(np.int32)
    table = rng.permutation(pool)[: b * width].reshape(b, width).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((b, hkv * group, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((hkv, pool, P, D)) * 2, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((hkv, pool, P, D)), jnp.bfloat16)
    out = attend_selected_cuda(q, k, v, jnp.asarray(keys), jnp.asarray(table),
                               jnp.asarray(lengths), jnp.asarray(budgets), page_size=P,
                               max_pages=max_pages, splits=splits)
    slots, counts = chosen_lists_np(keys, lengths, budgets, width=width, max_pages=max_pages)
    phys = np.take_along_axis(table[:, None, :], slots, axis=2)
    want = attention_np(q, k, v, phys, slots, counts, lengths)
    assert_kernel_close(as64(out), want, low_precision=True)


@needs_cuda
@pytest.mark.parametrize("r", [1, 4, 8])
@pytest.mark.parametrize("how", [dict(splits=1), dict(balanced=True)])
def test_step_with_the_cuda_selection_matches_float64(r, how):
    """``select="cuda"``: the lists from the CUDA selection kernel (not chosen inside the
    attention), then the CUDA attention, even splits or stream-K."""
    check_step(np.random.default_rng(r + 60), KERNEL_LENGTHS, KERNEL_BUDGETS, r, select="cuda",
               select_in_attention=False, **how)


@needs_cuda
@pytest.mark.parametrize("how", [dict(balanced=True), dict(balanced=False, splits=1),
                                 dict(balanced=None), dict(balanced=False, splits=3, programs=5),
                                 dict(balanced=False, splits=2)])
def test_selection_then_attention_in_one_call(how):
    """``select_attend_lists_cuda`` (one call, the attention started by programmatic
    dependent launch) gives bit for bit what the selection's call then the attention's give,
    however the blocks share the lists (with clusters, ``splits=2`` here, it is those calls)."""
    rng = np.random.default_rng(11)
    b, hkv, group, width, pool = 3, 2, 4, 96, 700
    lengths = jnp.asarray([90 * P, 41 * P - 3, 5 * P], jnp.int32)
    budgets = jnp.asarray([24, 40, 9], jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, hkv * group, D)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((hkv, pool, P, D)), jnp.bfloat16) for _ in range(2))
    keys = jnp.asarray(rng.integers(-2 ** 31, 2 ** 31 - 1, (hkv, b, width)), jnp.int32)
    table = jnp.asarray(rng.permutation(pool)[: b * width].reshape(b, width), jnp.int32)
    size = dict(page_size=P, max_pages=48, kpad=64)

    def two_calls(q, k, v, keys, table, lengths, budgets):
        phys, slots, count, zeros = select_lists_cuda(keys, table, lengths, budgets, **size)
        return attend_page_lists_cuda(q, k, v, phys, slots, count, lengths, arrivals=zeros, **how)

    one_call = functools.partial(select_attend_lists_cuda, **size, **how)
    args = (q, k, v, keys, table, lengths, budgets)
    np.testing.assert_array_equal(np.asarray(jax.jit(one_call)(*args), np.float32),
                                  np.asarray(jax.jit(two_calls)(*args), np.float32))


@needs_cuda
@pytest.mark.parametrize("family", list(KEY_FAMILIES))
def test_cuda_selection_writes_the_pallas_lists(family):
    """The CUDA selection kernel on the stressing keys: its lists are the rule's (NumPy),
    entries past the count repeat the row's last page up to kpad, the counters are zeros;
    and every written entry is the Pallas selection's."""
    rng = np.random.default_rng(len(family) + 90)
    b, hkv, width, pool, max_pages, kpad = 5, 2, 320, 2000, 64, 64
    lengths = np.array([300 * P, 211 * P - 5, 40 * P, 17, 0], np.int32)
    budgets = np.array([40, 3, 64, 5, 9], np.int32)
    keys = np.stack([np.stack([KEY_FAMILIES[family](rng, width) for _ in range(b)])
                     for _ in range(hkv)]).astype(np.int32)
    table = rng.permutation(pool)[: b * width].reshape(b, width).astype(np.int32)
    args = (jnp.asarray(keys), jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(budgets))
    size = dict(page_size=P, max_pages=max_pages, kpad=kpad)
    phys, slots, count, zeros = (np.asarray(x) for x in jax.jit(
        functools.partial(select_lists_cuda, **size))(*args))
    want_slots, want_counts = chosen_lists_np(keys, lengths, budgets, width=width,
                                              max_pages=max_pages)
    np.testing.assert_array_equal(count, want_counts)
    np.testing.assert_array_equal(zeros, 0)
    for i in range(b):
        last = max(min(-(-int(lengths[i]) // P), width) - 1, 0)
        for h in range(hkv):
            n = int(want_counts[i, h, 0])
            want = np.concatenate([want_slots[i, h, :n], np.full(kpad - n, last)])
            np.testing.assert_array_equal(slots[i, h, :kpad], want)
            np.testing.assert_array_equal(phys[i, h, :kpad], table[i, want])
    # The Pallas selection takes power-of-two tables, and keys as the scoring writes them:
    # the lowest key on every slot that is not eligible (page 0, the last two, past the row).
    mpad, slot = 512, np.arange(512)
    pages = -(-lengths.astype(np.int64) // P)
    eligible = (slot >= 1) & (slot < pages[:, None] - 2)                     # [B, Mpad]
    marked = np.where(eligible, np.pad(keys, ((0, 0), (0, 0), (0, mpad - width))),
                      np.iinfo(np.int32).min).astype(np.int32)
    table_pad = jnp.pad(args[1], ((0, 0), (0, mpad - width)))
    pallas = select_from_keys(jnp.asarray(marked), table_pad, *args[2:], **size, arrivals=True)
    for got, other in zip((phys, slots, count, zeros), pallas):
        np.testing.assert_array_equal(got[..., :kpad], np.asarray(other)[..., :kpad])


@needs_cuda
@pytest.mark.parametrize("how", [dict(balanced=False, splits=1), dict(balanced=False, splits=3),
                                 dict(balanced=False, splits=1, overlap=False),
                                 dict(balanced=True), dict(balanced=None, programs=5)])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_scored_and_chosen_in_one_kernel(how, group):
    """``score_select_attend_cuda``: its keys are the centroids' products with the group's
    mean query (float64, to float32 rounding; the lowest key where a slot is not eligible),
    its lists the rule's on those keys, and its output the attention over them; rows of 0-700
    pages (two blocks' slots and more), budgets from the minimum to past the row."""
    rng = np.random.default_rng(group + len(how))
    b, hkv, width, pool, max_pages, kpad = 5, 2, 1100, 6000, 64, 64
    lengths = np.array([700 * P, 300 * P - 5, 40 * P, 17, 0], np.int32)
    budgets = np.array([40, 3, 64, 5, 9], np.int32)
    q = rng.standard_normal((b, hkv * group, D))
    cent = rng.standard_normal((hkv, pool, D))
    table = rng.permutation(pool)[: b * width].reshape(b, width).astype(np.int32)
    k, v = (jnp.asarray(rng.standard_normal((hkv, pool, P, D)), jnp.bfloat16) for _ in range(2))
    q, cent = jnp.asarray(q, jnp.bfloat16), jnp.asarray(cent, jnp.bfloat16)
    out, keys, phys, slots, count = (np.asarray(x) for x in jax.jit(functools.partial(
        score_select_attend_cuda, page_size=P, max_pages=max_pages, kpad=kpad, lists=True,
        **how))(q, k, v, cent, jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(budgets)))
    qbar = as64(q).reshape(b, hkv, group, D).mean(axis=2)                        # [B, Hkv, D]
    score = np.einsum("bhd,hbsd->hbs", qbar, as64(cent)[:, table])               # [Hkv, B, M]
    pages = -(-lengths.astype(np.int64) // P)
    eligible = (np.arange(width) >= 1) & (np.arange(width) < pages[:, None] - 2)
    bits = np.where(keys < 0, keys ^ 0x7FFFFFFF, keys).astype(np.int32).view(np.float32)
    np.testing.assert_allclose(np.where(eligible, bits, 0), np.where(eligible, score, 0),
                               rtol=1e-5, atol=1e-5 * np.abs(score).max())
    np.testing.assert_array_equal(keys[:, ~eligible], np.iinfo(np.int32).min)
    want_slots, want_counts = chosen_lists_np(keys, lengths, budgets, width=width,
                                              max_pages=max_pages)
    np.testing.assert_array_equal(count, want_counts)
    for i in range(b):
        for h in range(hkv):
            n = int(want_counts[i, h, 0])
            np.testing.assert_array_equal(slots[i, h, :n], want_slots[i, h, :n])
            np.testing.assert_array_equal(phys[i, h, :n], table[i, want_slots[i, h, :n]])
    want = attention_np(q, k, v, phys, slots, count, lengths)
    assert_kernel_close(as64(out), want, low_precision=True)


@needs_cuda
@pytest.mark.parametrize("r", [1, 4, 8])
@pytest.mark.parametrize("how", [dict(splits=1, balanced=False), dict(balanced=None)])
def test_step_scored_by_cuda_matches_float64(r, how):
    """``score="cuda"``: the step's keys scored and its lists chosen by one CUDA kernel."""
    check_step(np.random.default_rng(r + 70), KERNEL_LENGTHS, KERNEL_BUDGETS, r, score="cuda",
               select_in_attention=False, **how)


@needs_cuda
def test_repeated_scored_calls_reset_their_tickets():
    """The tickets and ready marks are zeroed in each call: a second call of the same jitted
    step, and a call after another problem's, give the first call's output bit for bit."""
    rng = np.random.default_rng(5)
    b, hkv, group, width, pool = 3, 2, 4, 600, 2000
    lengths = jnp.asarray([600 * P, 200 * P, 9 * P], jnp.int32)
    budgets = jnp.asarray([24, 40, 9], jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, hkv * group, D)), jnp.bfloat16)
    cent = jnp.asarray(rng.standard_normal((hkv, pool, D)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((hkv, pool, P, D)), jnp.bfloat16) for _ in range(2))
    table = jnp.asarray(rng.permutation(pool)[: b * width].reshape(b, width), jnp.int32)
    step = jax.jit(functools.partial(score_select_attend_cuda, page_size=P, max_pages=48,
                                     kpad=64, balanced=False, splits=1))
    first = np.asarray(step(q, k, v, cent, table, lengths, budgets), np.float32)
    again = np.asarray(step(q, k, v, cent, table, lengths, budgets), np.float32)
    step(q[:2], k, v, cent, table[:2], lengths[:2] // 2, budgets[:2]).block_until_ready()
    after = np.asarray(step(q, k, v, cent, table, lengths, budgets), np.float32)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first, after)


# ---------------------------------------------------------------- the choice, on any host

def test_choice_between_cuda_and_pallas():
    q = jnp.zeros((2, 8, D), jnp.bfloat16)
    k = jnp.zeros((2, 10, P, D), jnp.bfloat16)
    assert resolve_attend("pallas", q, k, P, interpret=False) == "pallas"
    assert resolve_attend("auto", q, k, P, interpret=True) == "pallas"
    # Arguments the kernel does not take: pallas for "auto", one line for "cuda".
    k32 = k.astype(jnp.float32)
    assert unsupported_args(q, k32, P) == "needs bf16 queries and pages, have bfloat16 and float32"
    assert resolve_attend("auto", q, k32, P, interpret=False) == "pallas"
    with pytest.raises(ValueError, match=r"attend='cuda'\): needs bf16"):
        resolve_attend("cuda", q, k32, P, interpret=False)
    assert "head_dim 128 and page size 16, have 128 and 8" in unsupported_args(q, k, 8)
    assert "at most 8 query heads" in unsupported_args(jnp.zeros((2, 18, D), jnp.bfloat16),
                                                       k, P)
    with pytest.raises(ValueError, match=r"^attend_page_lists_cuda: needs bf16"):
        attend_page_lists_cuda(q, k32, k32, *(jnp.zeros((2, 2, 4), jnp.int32),) * 2,
                               jnp.ones((2, 2, 1), jnp.int32), jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="runs on a GPU only"):
        resolve_attend("cuda", q, k, P, interpret=True)
    with pytest.raises(ValueError, match="attend must be one of"):
        GpuDecodeTuning(attend="triton")
    with pytest.raises(ValueError, match="select must be one of"):
        GpuDecodeTuning(select="triton")
    keys, table = jnp.zeros((2, 1, 8200), jnp.int32), jnp.zeros((1, 8200), jnp.int32)
    with pytest.raises(ValueError, match=r"^select_lists_cuda: takes tables of 1 to 8192 slots, "
                                         r"have 8200$"):
        select_lists_cuda(keys, table, jnp.ones((1,), jnp.int32), jnp.ones((1,), jnp.int32),
                          page_size=P, max_pages=64, kpad=64)
    with pytest.raises(ValueError, match=r"select='cuda'\): it runs on a GPU only"):
        select_from_keys(keys[..., :64], table[:, :64], jnp.ones((1,), jnp.int32),
                         jnp.ones((1,), jnp.int32), page_size=P, max_pages=16, kpad=16,
                         tuning=GpuDecodeTuning(select="cuda"), interpret=True)
    with pytest.raises(ValueError, match=r"attend_programs must be in \[1, 4096\], got 0"):
        GpuDecodeTuning(attend_programs=0)
    with pytest.raises(ValueError, match="splits must be <= 4096 for the CUDA attention"):
        GpuDecodeTuning(attend="cuda", splits=4097)
    with pytest.raises(ValueError, match=r"^attend_page_lists_cuda: programs and splits must"):
        attend_page_lists_cuda(q, k, k, *(jnp.zeros((2, 2, 4), jnp.int32),) * 2,
                               jnp.ones((2, 2, 1), jnp.int32), jnp.ones((2,), jnp.int32),
                               programs=0)
    with pytest.raises(ValueError, match=r"must be in \[1, 4096\], got 132 and 4097"):
        attend_page_lists_cuda(q, k, k, *(jnp.zeros((2, 2, 4), jnp.int32),) * 2,
                               jnp.ones((2, 2, 1), jnp.int32), jnp.ones((2,), jnp.int32),
                               splits=4097)
    # Settings for the CUDA attention: splits set means even splits, as for the Pallas one.
    resolved = GpuDecodeTuning(attend="cuda", splits=2).resolve(
        page_size=P, batch=4, kv_heads=8, max_pages=128)
    assert (resolved.balanced, resolved.splits, resolved.attend_programs) == (False, 2, 132)
    resolved = GpuDecodeTuning(attend="cuda").resolve(page_size=P, batch=1, kv_heads=8,
                                                      max_pages=128)
    assert (resolved.balanced, resolved.splits) == (None, 8)
    if WHY is not None:       # this host: "auto" falls back, saying why
        with pytest.warns(UserWarning, match="Pallas kernel instead of the CUDA one for attend"):
            assert resolve_attend("auto", q, k, P, interpret=False) == "pallas"


def test_default_splits_rule():
    """Blocks about half the SMs (132 on an H200: 66), at least one page a warp."""
    assert default_cuda_splits(256, 128, 132) == 1         # batch 32 x 8 KV heads
    assert default_cuda_splits(64, 128, 132) == 1          # batch 8
    assert default_cuda_splits(8, 128, 132) == 8           # batch 1
    assert default_cuda_splits(8, 32, 132) == 4            # 32 pages: 4 splits of 8
    assert default_cuda_splits(8, 4, 132) == 1
    assert default_cuda_splits(256, 8192, 132) == 1        # long lists: staged in pieces


def step_lowered_for_an_h100(tuning: GpuDecodeTuning, lengths=(300, 200)) -> str:
    """The sparse step with ``tuning`` on a small case (one row a length), lowered for an H100
    on any host (an abstract device): its StableHLO text."""
    from jax._src import mesh as mesh_lib

    h100 = mesh_lib.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                   platform="gpu")
    q, k, v, cent, table, lengths = make_case(np.random.default_rng(0), lengths=list(lengths),
                                              hkv=2, r=4, d=D, dtype=jnp.bfloat16)
    budgets = jnp.asarray(([8, 6] * len(lengths))[:len(lengths)], jnp.int32)
    step = functools.partial(sparse_decode_pallas, page_size=P, centroids=cent, tuning=tuning)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(step).trace(q, k, v, table, lengths, budgets).lower(
            lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("splits", [1, 3])
def test_step_lowers_to_the_cuda_call_for_an_h100(monkeypatch, splits):
    """On any host: the step with ``attend="cuda"``, lowered for an H100, is the scoring and
    selection kernels and the CUDA call, which takes the selection's lists and its zeroed
    counters directly (no fill of its own, also with one split)."""
    from pallas_kernels import sparse_decode_gpu
    monkeypatch.setattr(sparse_decode_gpu, "cuda_unavailable", lambda: None)
    text = step_lowered_for_an_h100(GpuDecodeTuning(attend="cuda", splits=splits,
                                                    select_in_attention=False, select="pallas"))
    kernels = re.findall(r'name = "([a-z_]+)", num_stages', text)
    assert kernels == ["sparse_decode_score", "sparse_decode_select"]
    call = re.search(r"stablehlo.custom_call @sparrow_sparse_attend\(([^)]*)\).*splits = (\d+)",
                     text)
    assert call and int(call.group(2)) == splits
    select = re.search(r"(%\d+):4 = stablehlo.custom_call @__gpu\$xla.gpu.triton", text).group(1)
    operands = call.group(1).split(", ")
    assert operands[3:6] == [f"{select}#0", f"{select}#1", f"{select}#2"]
    assert operands[7] == f"{select}#3"


@pytest.mark.parametrize("lengths, balance", [((300,), 0), ((300, 200), -1)])
def test_one_row_takes_even_splits(monkeypatch, lengths, balance):
    """On any host: one row's lists are all of one length, so the step asks the CUDA call for
    even splits (balance 0: the kernel skips the counts' scan), each list's parts one cluster
    of blocks; two rows leave the choice to the device (-1), without clusters."""
    from pallas_kernels import sparse_decode_gpu
    monkeypatch.setattr(sparse_decode_gpu, "cuda_unavailable", lambda: None)
    text = step_lowered_for_an_h100(GpuDecodeTuning(attend="cuda", select_in_attention=False,
                                                    select="pallas"), lengths)
    call = re.search(r"stablehlo.custom_call @sparrow_sparse_attend\(.*balance = (-?\d+) : i64, "
                     r"cluster = (\d+) : i64, programs = (\d+) : i64, splits = (\d+)", text)
    assert call and int(call.group(1)) == balance
    cluster, programs, splits = map(int, call.group(2, 3, 4))
    if balance == 0:
        assert (cluster, programs) == (splits, 2 * splits) and splits > 1   # 2 KV heads' lists
    else:
        assert (cluster, programs) == (1, 132)


@pytest.mark.parametrize("balanced, overlap", [(None, 1), (False, 1), (True, 0)])
def test_scored_by_cuda_lowers_to_one_call(monkeypatch, balanced, overlap):
    """On any host: with ``score="cuda"`` the step, lowered for an H100, is one custom call
    and no Pallas kernel; its attention takes even splits and waits for each list alone
    (overlap) unless stream-K is asked, and Quest's bounds are refused in one line."""
    from pallas_kernels import sparse_decode_gpu
    monkeypatch.setattr(sparse_decode_gpu, "cuda_unavailable", lambda: None)
    tuning = GpuDecodeTuning(attend="cuda", score="cuda", balanced=balanced)
    text = step_lowered_for_an_h100(tuning)
    assert re.findall(r'name = "([a-z_]+)", num_stages', text) == []
    call = re.search(r"stablehlo.custom_call @sparrow_sparse_score_select_attend\(.*"
                     r"overlap = (\d+) : i64", text)
    assert call and int(call.group(1)) == overlap
    assert text.count("stablehlo.custom_call") == 1
    q, k, v, cent, table, lengths = make_case(np.random.default_rng(1), lengths=[300], hkv=2,
                                              r=4, d=D, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^score_select_attend_cuda: scores centroids, not "
                                         r"Quest's \(kmin, kmax\)"):
        sparse_decode_pallas(q, k, v, table, lengths, jnp.asarray([8]), page_size=P,
                             scorer="quest", tuning=tuning)
    with pytest.raises(ValueError, match=r"^GpuDecodeTuning\(score='cuda'\): the CUDA "
                                         r"attention cannot run here"):
        sparse_decode_pallas(q, k, v, table, lengths, jnp.asarray([8]), page_size=P,
                             centroids=cent, tuning=GpuDecodeTuning(score="cuda"),
                             interpret=True)


def test_auto_scores_and_chooses_in_one_kernel_past_a_wave(monkeypatch):
    """On any host: ``score="auto"`` (the default) lowered for an H100 is the one-kernel
    scoring, its attention waiting list by list, where the lists outnumber a wave of blocks
    and fill their last round (128 rows of 2 KV heads on 132 SMs: 256 lists, 97%); the Pallas
    scoring where they fit one wave (chosen inside the attention), where the last round is
    mostly idle (70 rows: 140 lists, 53%) and where stream-K is asked."""
    from pallas_kernels import sparse_decode_gpu
    monkeypatch.setattr(sparse_decode_gpu, "cuda_unavailable", lambda: None)
    text = step_lowered_for_an_h100(GpuDecodeTuning(attend="cuda"), (300,) * 128)
    call = re.search(r"stablehlo.custom_call @sparrow_sparse_score_select_attend\(.*"
                     r"balance = (-?\d+) : i64.*overlap = (\d+) : i64", text)
    assert call and call.group(1, 2) == ("0", "1")
    for tuning, lengths in ((GpuDecodeTuning(attend="cuda"), (300, 200)),
                            (GpuDecodeTuning(attend="cuda"), (300,) * 70),
                            (GpuDecodeTuning(attend="cuda", balanced=True), (300,) * 128)):
        text = step_lowered_for_an_h100(tuning, lengths)
        assert re.findall(r'name = "([a-z_]+)", num_stages', text) == ["sparse_decode_score"]
        assert "score_select" not in text


@pytest.mark.parametrize("lengths", [(300,), (300, 200)])
def test_lists_chosen_in_the_attention_where_asked(monkeypatch, lengths):
    """On any host: with ``select_in_attention`` None the step, lowered for an H100, scores
    and then makes one call that chooses and attends (no selection kernel, no lists), where
    every list's parts fit one wave of blocks; with stream-K asked it keeps the selection
    kernel, and True there says why not in one line."""
    from pallas_kernels import sparse_decode_gpu
    monkeypatch.setattr(sparse_decode_gpu, "cuda_unavailable", lambda: None)
    text = step_lowered_for_an_h100(GpuDecodeTuning(attend="cuda", select_in_attention=None),
                                    lengths)
    assert re.findall(r'name = "([a-z_]+)", num_stages', text) == ["sparse_decode_score"]
    call = re.search(r"stablehlo.custom_call @sparrow_sparse_select_attend\(.*max_pages = "
                     r"(\d+) : i64, page_size = 16 : i64, splits = (\d+)", text)
    assert call and int(call.group(2)) == default_cuda_splits(2 * len(lengths), 20, 132)
    assert "@sparrow_sparse_attend(" not in text
    stream_k = GpuDecodeTuning(attend="cuda", select_in_attention=None, balanced=True)
    text = step_lowered_for_an_h100(stream_k, lengths)
    assert "@sparrow_sparse_select_lists_attend(" in text
    with pytest.raises(ValueError, match=r"^choosing the lists inside the attention needs even "
                                         r"splits of 1 to 8 parts, .*; have \d lists x \d+ "
                                         r"splits on 132 blocks \(balanced=True\), 32 slots"):
        step_lowered_for_an_h100(dataclasses.replace(stream_k, select_in_attention=True),
                                 lengths)
    with pytest.raises(ValueError, match="^select_in_attention and score='cuda' need attend="):
        GpuDecodeTuning(attend="pallas", select_in_attention=True)
    # Called directly: the same rule, in one line.
    q, k, v, cent, table, lengths = make_case(np.random.default_rng(1), lengths=[300], hkv=2,
                                              r=4, d=D, dtype=jnp.bfloat16)
    keys = jnp.zeros((2, 1, table.shape[1]), jnp.int32)
    with pytest.raises(ValueError, match=r"^attend_selected_cuda: choosing the lists inside the "
                                         r"attention needs .*; have 2 lists x 9 splits"):
        attend_selected_cuda(q, k, v, keys, table, lengths, jnp.asarray([8]), page_size=P,
                             max_pages=20, splits=9)


@pytest.mark.parametrize("select", ["cuda", "auto"])
def test_cuda_selection_where_asked(monkeypatch, select):
    """On any host: ``select="cuda"``, and "auto" with the CUDA attention, lowered for an H100
    (lists not chosen inside the attention) make one call that selects and attends, taking
    the scoring's keys, in place of the Pallas selection kernel and the attention's call."""
    from pallas_kernels import sparse_decode_gpu
    monkeypatch.setattr(sparse_decode_gpu, "cuda_unavailable", lambda: None)
    text = step_lowered_for_an_h100(
        GpuDecodeTuning(attend="cuda", select_in_attention=False, select=select), (300, 200))
    assert re.findall(r'name = "([a-z_]+)", num_stages', text) == ["sparse_decode_score"]
    score = re.search(r"(%\d+) = stablehlo.custom_call @__gpu\$xla.gpu.triton", text).group(1)
    call = re.search(r"stablehlo.custom_call @sparrow_sparse_select_lists_attend\(([^)]*)\).*"
                     r"balance = (-?\d+) : i64, max_pages = 20 : i64, page_size = 16 : i64, "
                     r"programs = (\d+) : i64", text)
    # The scoring's keys go in; two rows leave the blocks' sharing to the device, one an SM.
    assert call.group(1).split(", ")[3] == score and call.group(2, 3) == ("-1", "132")
    assert "@sparrow_sparse_attend(" not in text and "@sparrow_sparse_select_lists(" not in text


@pytest.mark.parametrize("attend, width, want", [("cuda", 8192, "cuda"), ("cuda", 16384, ""),
                                                 ("pallas", 256, "")])
def test_auto_selection_is_the_cuda_one_with_the_cuda_attention(monkeypatch, attend, width,
                                                                want):
    """On any host: ``select="auto"`` is the CUDA selection where the attention is the CUDA
    one and the table fits it (8192 slots), else the Pallas kernel."""
    from jax._src import mesh as mesh_lib

    from pallas_kernels import sparse_decode_gpu
    monkeypatch.setattr(sparse_decode_gpu, "cuda_unavailable", lambda: None)
    keys = jax.ShapeDtypeStruct((2, 3, width), jnp.int32)
    table = jax.ShapeDtypeStruct((3, width), jnp.int32)
    rows = jax.ShapeDtypeStruct((3,), jnp.int32)
    select = functools.partial(select_from_keys, page_size=P, max_pages=64, kpad=64,
                               tuning=GpuDecodeTuning(attend=attend))
    h100 = mesh_lib.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                   platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=h100)):
        text = jax.jit(select).trace(keys, table, rows, rows).lower(
            lowering_platforms=("cuda",)).as_text()
    assert ("@sparrow_sparse_select_lists(" in text) == (want == "cuda")
    assert ('name = "sparse_decode_select"' in text) == (want != "cuda")


def test_clusters_only_where_they_apply():
    """``cluster=True`` needs even splits of 2-8 parts, all in one wave: else one line."""
    args = lists_case(np.random.default_rng(0), b=2, hkv=2, group=4, counts=[[4, 4], [4, 4]])
    for how in (dict(balanced=True, splits=4), dict(balanced=False, splits=9),
                dict(balanced=False, splits=4, programs=15), dict(splits=1, balanced=False)):
        with pytest.raises(ValueError, match="^attend_page_lists_cuda: cluster=True needs"):
            attend_page_lists_cuda(*args, cluster=True, **how)


def test_one_kernel_by_default_only_where_even_parts_fill_their_last_round():
    """On any host: ``score="auto"``'s rule by the numbers measured on 132 SMs (8 KV heads):
    19 rows' 152 lists fill 58% of their second round (the one kernel slower, kernel run BG),
    32 and 64 rows' 97% (faster, run BF); 30 rows fill 91%, 29 rows 88%; one wave or fewer
    lists, stream-K asked, Quest's two summaries or float32 centroids: never."""
    from pallas_kernels.sparse_attend_cuda import scores_and_chooses
    bf16, f32 = jnp.zeros((1, 1, 1), jnp.bfloat16), jnp.zeros((1, 1, 1), jnp.float32)
    rule = lambda rows, summaries=bf16, balanced=None, score="auto": scores_and_chooses(
        score, summaries, 2048, rows * 8, splits=1, programs=132, balanced=balanced)
    assert [r for r in (8, 16, 17, 19, 29, 30, 32, 33, 34, 64) if rule(r)] == [30, 32, 33, 64]
    assert not rule(32, balanced=True) and not rule(32, (bf16, bf16)) and not rule(32, f32)
    assert rule(19, score="cuda") and not rule(64, score="pallas")
