"""The Mosaic GPU attention over page lists (pallas_kernels/sparse_attend_mgpu.py) against the
float64 NumPy reference of docs/design.md, section 3 (tests/reference_np.py): the lists come
from the Pallas selection kernels, the attention from this kernel. On CPU it runs in Mosaic
GPU's interpret mode (TMA copies and barriers simulated); on a GPU it is compiled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_attend_mgpu import attend_page_lists_mgpu, pad_heads
from pallas_kernels.sparse_decode_gpu import select_page_lists
from reference_np import KERNEL_BUDGETS, KERNEL_LENGTHS, assert_kernel_close
from test_sparse_kernel import P, as64, make_case, reference

INTERPRET = jax.default_backend() == "cpu"


def attend(rng, *, lengths, budgets, hkv, r, d, run_lengths=None, **kw):
    """(kernel output, float64 reference) for one random case; ``run_lengths``: the lengths
    the kernels get instead (the reference keeps ``lengths``)."""
    q, k, v, cent, table, lengths = make_case(rng, lengths=lengths, hkv=hkv, r=r, d=d,
                                              dtype=jnp.bfloat16)
    budgets = jnp.asarray(budgets, jnp.int32)
    run = lengths if run_lengths is None else jnp.asarray(run_lengths, jnp.int32)
    q_pad = pad_heads(q, hkv)
    phys, slots, count = select_page_lists(q, cent, table, run, budgets, page_size=P,
                                           max_pages=table.shape[1], interpret=INTERPRET)
    out = attend_page_lists_mgpu(q_pad, r, k, v, phys, slots, count, run, page_size=P,
                                 interpret=INTERPRET, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    return as64(out), reference(q, k, v, cent, table, lengths, budgets)[0]


@pytest.mark.parametrize("r,d,splits,stages", [(4, 128, 1, 2), (8, 64, 3, 3)])
def test_matches_float64_reference(r, d, splits, stages):
    """Issue 5's lengths and budgets (one page to many blocks a row, splits left empty)."""
    got, want = attend(np.random.default_rng(r * 100 + d), lengths=KERNEL_LENGTHS,
                       budgets=KERNEL_BUDGETS, hkv=2, r=r, d=d, splits=splits, stages=stages)
    assert_kernel_close(got, want, low_precision=True)


def test_zero_length_row_gives_zeros():
    """A row of length 0 (padding in a batch) lists no page: zeros, not NaN, and the other
    row as the reference has it."""
    got, want = attend(np.random.default_rng(3), lengths=[90, 90], run_lengths=[0, 90],
                       budgets=[4, 4], hkv=1, r=4, d=64, splits=2)
    assert (got[0] == 0).all()
    assert_kernel_close(got[1:], want[1:], low_precision=True)


@pytest.mark.parametrize("change,match", [
    (dict(dtype=jnp.float32), "bfloat16 or float16"),
    (dict(d=96), "head_dim a multiple of 64"),
    (dict(block_pages=2), "a multiple of 64"),
    (dict(stages=1), "stages >= 2")])
def test_what_it_cannot_take_is_named(change, match):
    d, dtype = change.get("d", 64), change.get("dtype", jnp.bfloat16)
    q = jnp.zeros((1, 1, 16, d), dtype)
    k = jnp.zeros((1, 4, P, d), dtype)
    lists = jnp.zeros((1, 1, 4), jnp.int32)
    kw = {key: change[key] for key in ("block_pages", "stages") if key in change}
    with pytest.raises(ValueError, match=match):
        attend_page_lists_mgpu(q, 4, k, k, lists, lists, lists[..., :1], jnp.ones((1,), jnp.int32),
                               page_size=P, splits=1, **kw)
