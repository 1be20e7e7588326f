"""The attention on a flat grid shared out by list length (``attend_page_lists_balanced`` in
pallas_kernels/paged_attend_gpu.py): its shares worked by hand, and its output against the
float64 NumPy reference of docs/design.md, section 3 (tests/reference_np.py), the lists from the
Pallas selection kernels. Interpret mode on CPU, compiled on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attend_gpu import attend_page_lists_balanced, list_shares
from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, select_page_lists,
                                              sparse_decode_pallas)
from reference_np import KERNEL_BUDGETS, KERNEL_LENGTHS, assert_kernel_close
from test_sparse_kernel import P, as64, make_case, reference

INTERPRET = jax.default_backend() == "cpu"


@pytest.mark.parametrize("counts,programs,shares", [
    # 4 lists of 8 blocks (32 pages), 12 programs: 1 each + 8 x 8 // 32 = 3 each.
    ([32, 32, 32, 32], 12, [3, 3, 3, 3]),
    # A lone long list (65 blocks) beside three of one block: 1 + 65 x 8 // 68 = 8; 1 each.
    ([260, 1, 4, 2], 12, [8, 1, 1, 1]),
    # Never more programs than blocks: 2 blocks, 100 programs.
    ([8, 0], 100, [2, 1]),
    # As many lists as programs: one each.
    ([40, 4, 4], 3, [1, 1, 1])])
def test_shares_by_hand(counts, programs, shares):
    got, starts = list_shares(jnp.asarray(counts, jnp.int32), jnp.ones(len(counts), bool),
                              programs=programs, block_pages=4)
    assert got.tolist() == shares
    assert starts.tolist() == np.concatenate([[0], np.cumsum(shares)[:-1]]).tolist()
    assert sum(shares) <= programs


def test_shares_skip_invalid_entries():
    """Padding entries (past the lists) get no program and take none from the others."""
    got, starts = list_shares(jnp.asarray([16, 99, 16], jnp.int32),
                              jnp.asarray([True, False, True]), programs=6, block_pages=4)
    assert got.tolist() == [3, 0, 3] and starts.tolist() == [0, 3, 3]


def attend(rng, *, lengths, budgets, hkv, r, d, programs, run_lengths=None):
    q, k, v, cent, table, lengths = make_case(rng, lengths=lengths, hkv=hkv, r=r, d=d,
                                              dtype=jnp.bfloat16)
    budgets = jnp.asarray(budgets, jnp.int32)
    run = lengths if run_lengths is None else jnp.asarray(run_lengths, jnp.int32)
    tuning = GpuDecodeTuning().resolve(page_size=P, batch=q.shape[0], kv_heads=hkv,
                                       max_pages=table.shape[1])
    phys, slots, count = select_page_lists(q, cent, table, run, budgets, page_size=P,
                                           max_pages=table.shape[1], tuning=tuning,
                                           interpret=INTERPRET)
    out = attend_page_lists_balanced(q, k, v, phys, slots, count, run, page_size=P,
                                     tuning=tuning, programs=programs, interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == q.dtype
    return as64(out), reference(q, k, v, cent, table, lengths, budgets)[0]


@pytest.mark.parametrize("r,d,programs", [
    (4, 128, 64),       # lists split unevenly, the long ones most
    (5, 64, 12),        # a group of 5 (a junk row), programs equal to the lists
    (2, 64, 40)])       # idle programs past the shares' sum
def test_matches_float64_reference(r, d, programs):
    """Issue 5's lengths and budgets: one page to many blocks a row."""
    got, want = attend(np.random.default_rng(r * 100 + d), lengths=KERNEL_LENGTHS,
                       budgets=KERNEL_BUDGETS, hkv=2, r=r, d=d, programs=programs)
    assert_kernel_close(got, want, low_precision=True)


@pytest.mark.parametrize("programs", [24, 40])
def test_a_long_row_beside_finished_ones(programs):
    """A static batch's tail: one row at 60 pages with a budget of 40, three finished rows
    reading one page (as the engine runs them); 24 programs (7 splits for each of the long
    row's lists) and 40 (10, more than one merge chunk); the long row's output as the
    reference has it, a zero-length row zeros."""
    got, want = attend(np.random.default_rng(7), lengths=[960, 16, 16, 16],
                       run_lengths=[960, 16, 16, 0], budgets=[40, 40, 40, 40], hkv=2, r=4,
                       d=64, programs=programs)
    assert_kernel_close(got[:3], want[:3], low_precision=True)
    assert (got[3] == 0).all()


def test_the_selection_hands_over_the_arrival_counters():
    """``arrivals=True`` adds the zeroed counters as a fourth output and leaves the lists as
    they were. (Interpret mode zero-fills outputs; on a GPU a counter the selection left
    unwritten would make the whole-step test below fail.)"""
    rng = np.random.default_rng(12)
    q, _, _, cent, table, lengths = make_case(rng, lengths=KERNEL_LENGTHS, hkv=2, r=4, d=64,
                                              dtype=jnp.bfloat16)
    budgets = jnp.asarray(KERNEL_BUDGETS, jnp.int32)
    kw = dict(page_size=P, max_pages=table.shape[1], interpret=INTERPRET)
    lists = select_page_lists(q, cent, table, lengths, budgets, **kw)
    *same, arrivals = select_page_lists(q, cent, table, lengths, budgets, arrivals=True, **kw)
    kpad = lists[0].shape[-1] // 2      # entries from Kpad on are never read
    for want, got in zip(lists, same):
        np.testing.assert_array_equal(np.asarray(got)[..., :kpad], np.asarray(want)[..., :kpad])
    assert arrivals.shape == lists[2].shape and arrivals.dtype == jnp.int32
    assert (np.asarray(arrivals) == 0).all()


def test_the_whole_step_with_balanced_tuning():
    """``GpuDecodeTuning(balanced=True)`` routes the sparse step's attention through it:
    score, select (which also zeroes the attention's arrival counters), attend and merge
    against the float64 reference."""
    rng = np.random.default_rng(11)
    q, k, v, cent, table, lengths = make_case(rng, lengths=KERNEL_LENGTHS, hkv=2, r=4, d=64,
                                              dtype=jnp.bfloat16)
    budgets = jnp.asarray(KERNEL_BUDGETS, jnp.int32)
    out = sparse_decode_pallas(q, k, v, table, lengths, budgets, page_size=P, centroids=cent,
                               tuning=GpuDecodeTuning(balanced=True), interpret=INTERPRET)
    assert_kernel_close(as64(out), reference(q, k, v, cent, table, lengths, budgets)[0],
                        low_precision=True)


@pytest.mark.parametrize("kw,balanced", [({}, True), (dict(splits=2), False),
                                         (dict(balanced=False), False),
                                         (dict(balanced=True, splits=2), True)])
def test_which_attention_the_settings_choose(kw, balanced):
    """The sparse step's default is the balanced attention; a fixed split count asks for even
    splits, unless balanced is asked for too."""
    got = GpuDecodeTuning(**kw).resolve(page_size=P, batch=4, kv_heads=2, max_pages=64)
    assert got.balanced is balanced and got.splits >= 1
