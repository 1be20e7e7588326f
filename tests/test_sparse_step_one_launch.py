"""The sparse step as one launch (``GpuDecodeTuning(one_launch=True)``,
``sparse_step_one_launch`` in pallas_kernels/sparse_decode_gpu.py): scoring, selection and the
balanced attention in one grid, each list selected by its last scoring program and attended once
marked ready, against the float64 NumPy reference of docs/design.md, section 3
(tests/reference_np.py). Interpret mode on CPU (programs in order); on a GPU the same tests run
the programs concurrently, which is where the marks and waits matter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, list_count, select_page_lists,
                                              sparse_decode_pallas, sparse_step_one_launch)
from reference_np import KERNEL_BUDGETS, KERNEL_LENGTHS, assert_kernel_close
from test_sparse_kernel import P, as64, make_case, reference

INTERPRET = jax.default_backend() == "cpu"
ONE = GpuDecodeTuning(one_launch=True)


def step(rng, *, lengths, budgets, hkv, r, d, dtype=jnp.bfloat16, run_lengths=None,
         programs=None, tuning=ONE, max_pages=None):
    q, k, v, cent, table, lengths = make_case(rng, lengths=lengths, hkv=hkv, r=r, d=d,
                                              dtype=dtype)
    budgets = jnp.asarray(budgets, jnp.int32)
    run = lengths if run_lengths is None else jnp.asarray(run_lengths, jnp.int32)
    max_pages = max_pages or table.shape[1]
    tuning = tuning.resolve(page_size=P, batch=q.shape[0], kv_heads=hkv, max_pages=max_pages)
    out = sparse_step_one_launch(q, k, v, cent, table, run, budgets, page_size=P,
                                 max_pages=max_pages, tuning=tuning, programs=programs,
                                 interpret=INTERPRET)
    assert out.shape == q.shape and out.dtype == q.dtype
    return as64(out), reference(q, k, v, cent, table, lengths, budgets)[0]


@pytest.mark.parametrize("r,d,dtype,programs", [
    (4, 128, jnp.bfloat16, 64),     # lists split unevenly, the long ones most
    (5, 64, jnp.float32, 12),       # a group of 5 (a junk row), one program a list
    (2, 64, jnp.bfloat16, 40),      # idle programs past the shares' sum
    (1, 64, jnp.float32, None)])    # one wave of programs
def test_matches_float64_reference(r, d, dtype, programs):
    """Issue 5's lengths and budgets: one page to many blocks a row, budgets under and over
    each row's pages."""
    got, want = step(np.random.default_rng(r * 100 + d), lengths=KERNEL_LENGTHS,
                     budgets=KERNEL_BUDGETS, hkv=2, r=r, d=d, dtype=dtype, programs=programs)
    assert_kernel_close(got, want, low_precision=dtype == jnp.bfloat16)


def test_a_long_row_beside_finished_ones():
    """A static batch's tail: one row of 60 pages with a budget of 40 beside rows of one page
    and one of no tokens (zeros), small scoring chunks (many scoring programs a list)."""
    got, want = step(np.random.default_rng(7), lengths=[960, 16, 16, 16],
                     run_lengths=[960, 16, 16, 0], budgets=[40, 40, 40, 40], hkv=2, r=4, d=64,
                     programs=24, tuning=GpuDecodeTuning(one_launch=True, score_chunk=16))
    assert_kernel_close(got[:3], want[:3], low_precision=True)
    assert (got[3] == 0).all()


def test_a_wide_table_and_a_smaller_list_bound():
    """Rows of 5 to 700 pages in a 1024-slot table (each of the selection's sizes) with
    max_budget_pages below the widest row."""
    lengths = [5 * P, 150 * P, 256 * P, 257 * P - 3, 300 * P, 700 * P]
    got, want = step(np.random.default_rng(12), lengths=lengths,
                     budgets=[8, 40, 96, 96, 3, 64], hkv=1, r=2, d=64, max_pages=96)
    assert_kernel_close(got, want, low_precision=True)


def test_the_counts_known_before_selection_are_the_selections():
    """The attention programs share out the lists by ``list_count`` (from lengths and budgets,
    before any selection): it must equal the count the selection writes, for budgets under,
    at and over a row's pages, below the 3 reserved, over max_pages, and empty rows."""
    rng = np.random.default_rng(3)
    lengths = [0, 1, 16, 17, 48, 49, 300, 1000, 1000, 640]
    budgets = [5, 3, 1, 2, 3, 4, 19, 64, 200, 40]
    q, k, v, cent, table, lengths = make_case(rng, lengths=np.maximum(lengths, 1), hkv=2, r=2,
                                              d=64, dtype=jnp.float32)
    run = jnp.asarray([0, *np.asarray(lengths)[1:]], jnp.int32)
    budgets = jnp.asarray(budgets, jnp.int32)
    _, _, count = select_page_lists(q, cent, table, run, budgets, page_size=P, max_pages=64,
                                    interpret=INTERPRET)
    want = list_count(run, budgets, page_size=P, max_pages=64)
    assert np.asarray(count)[..., 0].tolist() == [[c, c] for c in np.asarray(want).tolist()]
    # Worked by hand: 0 pages; 1; 1; 2 pages under budget 3 (clipped up); 3; 4 pages, budget 4;
    # 19 of 19; 63 pages over budget 64; 63 under 200 clipped to 64; 40 of 40.
    assert np.asarray(want).tolist() == [0, 1, 1, 2, 3, 4, 19, 63, 63, 40]


def test_the_sparse_entry_point_routes_it():
    rng = np.random.default_rng(5)
    q, k, v, cent, table, lengths = make_case(rng, lengths=[400, 90], hkv=2, r=3, d=64,
                                              dtype=jnp.float32)
    budgets = jnp.asarray([9, 4], jnp.int32)
    out = sparse_decode_pallas(q, k, v, table, lengths, budgets, page_size=P, centroids=cent,
                               tuning=ONE, interpret=INTERPRET)
    assert_kernel_close(as64(out), reference(q, k, v, cent, table, lengths, budgets)[0],
                        low_precision=False)
