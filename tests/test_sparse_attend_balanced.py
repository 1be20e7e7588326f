"""The attention on a flat grid sharing the lists' blocks evenly (``attend_page_lists_balanced``
in pallas_kernels/paged_attend_gpu.py): its partition worked by hand, and its output against the
float64 NumPy reference of docs/design.md, section 3 (tests/reference_np.py), the lists from the
Pallas selection kernels. Interpret mode on CPU, compiled on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attend_gpu import (attend_page_lists_balanced, list_units,
                                             units_per_program)
from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, select_page_lists,
                                              sparse_decode_pallas)
from reference_np import KERNEL_BUDGETS, KERNEL_LENGTHS, assert_kernel_close
from test_sparse_kernel import P, as64, make_case, reference

INTERPRET = jax.default_backend() == "cpu"


def partition(counts, programs, block_pages=4, valid=None):
    """(units, ends, units a program) from the kernel's own functions, as lists and an int."""
    counts = jnp.asarray(counts, jnp.int32)
    valid = jnp.ones(counts.shape, bool) if valid is None else jnp.asarray(valid)
    units, ends = list_units(counts, valid, block_pages=block_pages)
    return units.tolist(), ends.tolist(), int(units_per_program(jnp.sum(units), programs))


@pytest.mark.parametrize("counts,programs,units,chunk", [
    # 4 lists of 8 blocks (32 pages), 12 programs: 32 units, 3 a program (the 11th holds 2,
    # the 12th none); program 2 holds the first list's last 2 units and the second's first.
    ([32, 32, 32, 32], 12, [8, 8, 8, 8], 3),
    # A lone long list (65 blocks) beside three of one block: 68 units, 6 a program; the
    # 11th holds the long list's last 5 units and the first short list, the 12th the others.
    ([260, 1, 4, 2], 12, [65, 1, 1, 1], 6),
    # An empty list holds one unit; programs past the units hold none.
    ([8, 0], 100, [2, 1], 1),
    # More lists than programs: 12 units, 4 a program, the last the long list's last 2
    # units and both short lists.
    ([40, 4, 4], 3, [10, 1, 1], 4)])
def test_partition_by_hand(counts, programs, units, chunk):
    got_units, ends, got_chunk = partition(counts, programs)
    assert got_units == units and ends == np.cumsum(units).tolist() and got_chunk == chunk


def test_padding_entries_hold_no_units():
    """Entries past the lists take no units and leave the others' places as they were."""
    units, ends, chunk = partition([16, 99, 16], 6, valid=[True, False, True])
    assert units == [4, 0, 4] and ends == [4, 4, 8] and chunk == 2


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
    (4, 128, 64),       # more programs than units: one unit each, the others idle
    (5, 64, 12),        # a group of 5 (a junk row), three units a program (36 units)
    (2, 64, 40),        # more programs than units too, at another group and width
    (4, 64, 5),         # fewer programs than lists: each runs across several lists' ends
    (2, 128, 7)])       # units that do not divide among the programs
def test_matches_float64_reference(r, d, programs):
    """Issue 5's lengths and budgets: one page to many blocks a row."""
    got, want = attend(np.random.default_rng(r * 100 + d), lengths=KERNEL_LENGTHS,
                       budgets=KERNEL_BUDGETS, hkv=2, r=r, d=d, programs=programs)
    assert_kernel_close(got, want, low_precision=True)


@pytest.mark.parametrize("programs", [4, 40])
def test_a_long_row_beside_finished_ones(programs):
    """A static batch's tail: one row at 60 pages with a budget of 40 (10 blocks a list),
    three finished rows reading one page (as the engine runs them), 26 units; 4 programs (7
    units each: the second runs from one of the long row's lists into the next) and 40 (26
    used, one unit each: 10 partial results a long list, more than one merge chunk); the
    long row's output as the reference has it, a zero-length row zeros."""
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


@pytest.mark.parametrize("kw,batch,balanced", [
    ({}, 4, True), ({}, 2, True), ({}, 1, False), (dict(splits=2), 4, False),
    (dict(balanced=False), 4, False), (dict(balanced=True, splits=2), 4, True),
    (dict(balanced=True), 1, True)])
def test_which_attention_the_settings_choose(kw, batch, balanced):
    """The sparse step's default is the balanced attention, but for one row (whose lists are
    all of one length); a fixed split count asks for even splits, unless balanced is asked
    for too, which holds for one row as well."""
    got = GpuDecodeTuning(**kw).resolve(page_size=P, batch=batch, kv_heads=2, max_pages=64)
    assert got.balanced is balanced and got.splits >= 1
