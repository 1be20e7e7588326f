"""The CUDA selection of the sparse step (pallas_kernels/sparse_select_cuda.cu) against the
NumPy reference of docs/design.md, section 3 (tests/reference_np.py: the top keys, ties from
the lowest slot, the reserved pages; written from the text): every list, entry by entry, for
distinct keys, keys with many ties at the threshold, rows the budget covers, the smallest
budget, budgets past max_pages, rows shorter than the table, and tables from one to 64 slots a
thread; the same lists as the Pallas selection's; and the whole step with
``GpuDecodeTuning(select="cuda")`` on issue 5's matrix against the float64 reference. These
need an NVIDIA GPU and nvcc; on a CPU they are skipped with that reason. What runs on a CPU:
the choice between the CUDA and the Pallas selection, its one-line refusals, and the step
lowered for an H100.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, resolve_select, select_from_keys,
                                              sparse_decode_pallas)
from pallas_kernels.sparse_select_cuda import (MAX_WIDTH, select_from_keys_cuda, unavailable,
                                               unsupported_args)
from reference_np import (KERNEL_BUDGETS, KERNEL_LENGTHS, assert_kernel_close,
                          select_pages_np)
from test_sparse_attend_cuda import step_lowered_for_an_h100
from test_sparse_kernel import as64, make_case, reference

P, D = 16, 128
WHY = unavailable()
needs_cuda = pytest.mark.skipif(WHY is not None, reason=f"the CUDA selection {WHY}")
INT_MIN = -(2 ** 31)


def keys_case(rng, lengths, width, hkv, ties):
    """Keys ``[B, Hkv, width]`` as the scoring writes them (INT_MIN outside 1 <= j < n - 2),
    a table of distinct pages ``[B, width]``; ``ties``: keys from 5 values, so that the
    threshold falls among many equal keys (negative ones included)."""
    b = len(lengths)
    n = -(-np.asarray(lengths) // P)
    if ties:
        keys = rng.choice(np.asarray([-7, -1, 0, 3, 2 ** 30], np.int64), size=(b, hkv, width))
    else:
        keys = rng.integers(INT_MIN + 1, 2 ** 31 - 1, size=(b, hkv, width))
    slot = np.arange(width)
    eligible = (slot[None] >= 1) & (slot[None] < n[:, None] - 2)
    keys = np.where(eligible[:, None], keys, INT_MIN).astype(np.int32)
    table = rng.permutation(b * width + 9)[: b * width].reshape(b, width).astype(np.int32)
    return keys, table


def lists_np(keys, table, lengths, budgets, max_pages, kpad):
    """The reference's lists: (phys, slots ``[B, Hkv, kpad]``, count ``[B, Hkv]``), entries
    past the count the row's last page."""
    b, hkv, _ = keys.shape
    phys = np.zeros((b, hkv, kpad), np.int64)
    slots = np.zeros((b, hkv, kpad), np.int64)
    count = np.zeros((b, hkv), np.int64)
    for i in range(b):
        n = -(-int(lengths[i]) // P)
        budget = min(max(int(budgets[i]), 3), max_pages)
        last = max(n - 1, 0)
        for h in range(hkv):
            chosen = select_pages_np(keys[i, h].astype(np.float64), n, budget)
            row = chosen + [last] * (kpad - len(chosen))
            slots[i, h] = row
            phys[i, h] = table[i, row]
            count[i, h] = len(chosen)
    return phys, slots, count


CASES = {
    # name: (lengths, budgets, table width, max_pages)
    "distinct": ([32768, 20000, 5000, 49], [2048, 512, 64, 4], 2048, 2048),
    "covered": ([1, 16, 100, 4000], [3, 3, 7, 300], 256, 256),
    "smallest_budget": ([4000, 2000], [3, 3], 256, 256),
    "past_max_pages": ([32768, 9000], [5000, 900], 2048, 512),
    "short_rows_wide_table": ([60, 300, 262144], [4, 9, 4096], 16384, 4096),
    "one_slot_a_thread": ([4096, 1000], [40, 20], 256, 64),
    "two": ([8192, 3000], [100, 50], 512, 128),
    "four": ([16384, 16], [1000, 3], 1024, 1024),
}


@needs_cuda
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_lists_match_the_reference(name, ties):
    lengths, budgets, width, max_pages = CASES[name]
    rng = np.random.default_rng(len(name) * 2 + ties)
    keys, table = keys_case(rng, lengths, width, hkv=4, ties=ties)
    kpad = 1 << (max_pages - 1).bit_length()
    args = (jnp.asarray(keys), jnp.asarray(table), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(budgets, jnp.int32))
    run = jax.jit(functools.partial(select_from_keys_cuda, page_size=P, max_pages=max_pages,
                                    kpad=kpad))
    phys, slots, count, arrivals = (np.asarray(x) for x in run(*args))
    want_phys, want_slots, want_count = lists_np(keys, table, lengths, budgets, max_pages, kpad)
    np.testing.assert_array_equal(count[..., 0], want_count)
    np.testing.assert_array_equal(slots[..., :kpad], want_slots)
    np.testing.assert_array_equal(phys[..., :kpad], want_phys)
    np.testing.assert_array_equal(arrivals, 0)
    # The Pallas selection's lists, entry by entry (its own test is against the same reference).
    pallas = select_from_keys(*args, page_size=P, max_pages=max_pages, kpad=kpad,
                              tuning=GpuDecodeTuning(), arrivals=True)
    for got, other in zip((phys, slots, count), pallas):
        np.testing.assert_array_equal(got[..., :kpad], np.asarray(other)[..., :kpad])


@needs_cuda
@pytest.mark.parametrize("r", [1, 4, 8])
@pytest.mark.parametrize("attend", ["cuda", "pallas"])
def test_step_matches_float64_reference(r, attend):
    q, k, v, cent, table, lengths = make_case(np.random.default_rng(r), lengths=KERNEL_LENGTHS,
                                              hkv=2, r=r, d=D, dtype=jnp.bfloat16)
    budgets = jnp.asarray(KERNEL_BUDGETS, jnp.int32)
    out = sparse_decode_pallas(q, k, v, table, lengths, budgets, page_size=P, centroids=cent,
                               tuning=GpuDecodeTuning(select="cuda", attend=attend))
    want, _ = reference(q, k, v, cent, table, lengths, budgets)
    assert_kernel_close(as64(out), want, low_precision=True)


def test_what_it_takes_and_the_choice():
    """One line for what the CUDA selection does not take; interpret mode always takes the
    Pallas selection; an explicit "cuda" that cannot run raises saying why; on a host without
    the GPU "auto" warns."""
    table = jnp.zeros((2, 64), jnp.int32)
    assert unsupported_args(table) is None
    assert f"up to {MAX_WIDTH} pages" in unsupported_args(jnp.zeros((1, 2 * MAX_WIDTH)))
    with pytest.raises(ValueError, match="select must be one of"):
        GpuDecodeTuning(select="triton")
    assert GpuDecodeTuning().select == "pallas"
    assert resolve_select("auto", table, interpret=True) == "pallas"
    assert resolve_select("pallas", table, interpret=False) == "pallas"
    with pytest.raises(ValueError, match=r"select='cuda'\): it runs on a GPU only"):
        resolve_select("cuda", table, interpret=True)
    with pytest.raises(ValueError, match=r"select='cuda'\): takes tables up to"):
        resolve_select("cuda", jnp.zeros((1, 2 * MAX_WIDTH)), interpret=False)
    with pytest.raises(ValueError, match=r"^select_from_keys_cuda: max_pages must be in"):
        select_from_keys_cuda(jnp.zeros((2, 1, 64), jnp.int32), table, jnp.ones((2,)),
                              jnp.ones((2,)), page_size=P, max_pages=128, kpad=64)
    if WHY is not None:
        with pytest.warns(UserWarning, match="CUDA one for select"):
            assert resolve_select("auto", table, interpret=False) == "pallas"


@pytest.mark.parametrize("attend", ["cuda", "pallas"])
def test_step_lowers_to_the_cuda_selection_for_an_h100(monkeypatch, attend):
    """On any host: the step with ``select="cuda"`` lowered for an H100 selects by the CUDA
    call, which takes the Pallas scoring's keys; its lists (and, for the CUDA attention, its
    zeroed counters) go to the attention; no Pallas selection kernel is left."""
    from pallas_kernels import sparse_decode_gpu
    monkeypatch.setattr(sparse_decode_gpu, "select_cuda_unavailable", lambda: None)
    monkeypatch.setattr(sparse_decode_gpu, "cuda_unavailable", lambda: None)
    text = step_lowered_for_an_h100(GpuDecodeTuning(select="cuda", attend=attend))
    kernels = re.findall(r'name = "([a-z_]+)", num_stages', text)
    assert "sparse_decode_select" not in kernels and "sparse_decode_score" in kernels
    call = re.search(r"(%\d+):4 = stablehlo.custom_call @sparrow_sparse_select\(([^)]*)\)"
                     r".*max_pages = (\d+)", text)
    assert call, "no CUDA selection call in the lowered step"
    score = re.search(r"(%\d+) = stablehlo.custom_call @__gpu\$xla.gpu.triton\([^)]*\).*"
                      r"sparse_decode_score", text).group(1)
    assert call.group(2).split(", ")[0] == score
    if attend == "cuda":
        attend_call = re.search(r"stablehlo.custom_call @sparrow_sparse_attend\(([^)]*)\)",
                                text)
        operands = attend_call.group(1).split(", ")
        sel = call.group(1)
        assert operands[3:6] == [f"{sel}#0", f"{sel}#1", f"{sel}#2"]
        assert operands[7] == f"{sel}#3"
