"""The CUDA scoring of the sparse step (pallas_kernels/sparse_score_cuda.cu) against float64
NumPy: each slot's key decoded back to its score (rows shorter than the reserved pages,
tables wider than the rows, blocks past a row's pages, every group size), and the whole step
with ``GpuDecodeTuning(score="cuda")`` on issue 5's matrix against the reference of
docs/design.md, section 3 (tests/reference_np.py). These need an NVIDIA GPU and nvcc; on a CPU
they are skipped with that reason. What runs on a CPU: the choice between the CUDA and the
Pallas scoring, its one-line refusals, and the step lowered for an H100.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, resolve_score, score_keys,
                                              sparse_decode_pallas)
from pallas_kernels.sparse_score_cuda import score_keys_cuda, unavailable, unsupported_args
from reference_np import KERNEL_BUDGETS, KERNEL_LENGTHS, assert_kernel_close
from test_sparse_attend_cuda import step_lowered_for_an_h100
from test_sparse_kernel import as64, make_case, reference

P, D = 16, 128
WHY = unavailable()
needs_cuda = pytest.mark.skipif(WHY is not None, reason=f"the CUDA scoring {WHY}")
INT_MIN = -(2 ** 31)


def scores_from_keys(keys: np.ndarray) -> np.ndarray:
    """The inverse of the order key: int32 keys -> the float32 scores they order."""
    keys = np.asarray(keys, np.int32)
    bits = np.where(keys < 0, keys ^ np.int32(0x7FFFFFFF), keys).astype(np.int32)
    return bits.view(np.float32).astype(np.float64)


def scores_np(q, cent, table, lengths):
    """float64: ``[B, Hkv, M]`` scores of eligible slots (1 <= j < n - 2), NaN elsewhere; and
    each score's scale (sum of |products|) for the tolerance."""
    q, cent = as64(q), as64(cent)
    b, hq, _ = q.shape
    hkv = cent.shape[0]
    qbar = q.reshape(b, hkv, hq // hkv, D).mean(axis=2)              # [B, Hkv, D]
    table = np.asarray(table)
    pages = cent[:, table]                                           # [Hkv, B, M, D]
    prod = pages.transpose(1, 0, 2, 3) * qbar[:, :, None, :]         # [B, Hkv, M, D]
    n = -(-np.asarray(lengths) // P)
    slot = np.arange(table.shape[1])
    eligible = (slot[None] >= 1) & (slot[None] < n[:, None] - 2)     # [B, M]
    want = np.where(eligible[:, None], prod.sum(-1), np.nan)
    return want, np.abs(prod).sum(-1)


def check_keys(got, q, cent, table, lengths):
    want, scale = scores_np(q, cent, table, lengths)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got == INT_MIN, np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(scores_from_keys(got)[ok], want[ok], rtol=0,
                               atol=2e-6 * scale[ok].max())
    return int(ok.sum())


@needs_cuda
@pytest.mark.parametrize("group", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("blocks", [None, 1, 3, 7])
def test_keys_match_float64(group, blocks):
    """Rows of 1 and 40 tokens (no eligible slot), 49 (one), 1000 and 9000 tokens in a table
    of 600 slots (padded to 608 for the kernel's 16-slot stages; the last row's stages past
    its pages only marked), on one block an SM, and on 1, 3 and 7 blocks, whose warps' runs
    cross rows and KV heads inside their rings."""
    rng = np.random.default_rng(group)
    lengths = [1, 40, 49, 1000, 9000]
    q, _, _, cent, table, lengths = make_case(rng, lengths=lengths, hkv=2, r=group, d=D,
                                              dtype=jnp.bfloat16, spare_cols=37)
    got = np.asarray(jax.jit(functools.partial(score_keys_cuda, page_size=P, blocks=blocks))(
        q, cent, table, lengths))
    assert check_keys(got, q, cent, table, lengths) > 1000


@needs_cuda
def test_runs_over_many_short_rows():
    """600 rows of one 16-slot stage each on one block: a warp's run spans 75 rows, more than
    the 32 whose lengths its lanes hold."""
    rng = np.random.default_rng(3)
    lengths = np.append(rng.integers(1, 15 * P, size=599), 15 * P)
    q, _, _, cent, table, lengths = make_case(rng, lengths=lengths, hkv=1, r=4, d=D,
                                              dtype=jnp.bfloat16)
    assert table.shape == (600, 16)
    got = np.asarray(score_keys_cuda(q, cent, table, lengths, page_size=P, blocks=1))
    assert check_keys(got, q, cent, table, lengths) > 2000


@needs_cuda
def test_keys_order_as_the_pallas_scoring():
    """The same table scored by both kernels: the same ineligible slots, and every score
    within float32 rounding of the Pallas kernel's."""
    rng = np.random.default_rng(7)
    q, _, _, cent, table, lengths = make_case(rng, lengths=[700, 5000, 333], hkv=8, r=4, d=D,
                                              dtype=jnp.bfloat16)
    width = 512   # a power of two at least the table's, as list_sizes pads it
    table = jnp.pad(table, ((0, 0), (0, width - table.shape[1])))
    keys = {impl: np.asarray(score_keys(q, cent, table, lengths, page_size=P,
                                        tuning=GpuDecodeTuning(score=impl)))
            for impl in ("cuda", "pallas")}
    np.testing.assert_array_equal(keys["cuda"] == INT_MIN, keys["pallas"] == INT_MIN)
    _, scale = scores_np(q, cent, table, lengths)
    ok = keys["cuda"] != INT_MIN
    np.testing.assert_allclose(scores_from_keys(keys["cuda"])[ok],
                               scores_from_keys(keys["pallas"])[ok], rtol=0,
                               atol=2e-6 * scale[ok].max())


@needs_cuda
@pytest.mark.parametrize("r", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("attend", ["cuda", "pallas"])
def test_step_matches_float64_reference(r, attend):
    q, k, v, cent, table, lengths = make_case(np.random.default_rng(r), lengths=KERNEL_LENGTHS,
                                              hkv=2, r=r, d=D, dtype=jnp.bfloat16)
    budgets = jnp.asarray(KERNEL_BUDGETS, jnp.int32)
    out = sparse_decode_pallas(q, k, v, table, lengths, budgets, page_size=P, centroids=cent,
                               tuning=GpuDecodeTuning(score="cuda", attend=attend))
    want, _ = reference(q, k, v, cent, table, lengths, budgets)
    assert_kernel_close(as64(out), want, low_precision=True)


def test_what_it_takes_and_the_choice():
    """One line for what the CUDA scoring does not take; Quest and float32 caches take the
    Pallas scoring silently under "auto", interpret mode always; an explicit "cuda" that
    cannot run raises saying why; on a host without the GPU "auto" warns."""
    q = jnp.zeros((2, 8, D), jnp.bfloat16)
    cent = jnp.zeros((2, 10, D), jnp.bfloat16)
    assert unsupported_args(q, (cent,)) is None
    assert "centroids only" in unsupported_args(q, (cent, cent))
    assert "bf16" in unsupported_args(q, (cent.astype(jnp.float32),))
    assert "head_dim 128" in unsupported_args(q[..., :64], (cent[..., :64],))
    with pytest.raises(ValueError, match="score must be one of"):
        GpuDecodeTuning(score="triton")
    assert GpuDecodeTuning().score == "pallas"
    assert resolve_score("auto", q, (cent, cent), interpret=False) == "pallas"
    assert resolve_score("auto", q, (cent,), interpret=True) == "pallas"
    assert resolve_score("pallas", q, (cent,), interpret=False) == "pallas"
    with pytest.raises(ValueError, match=r"score='cuda'\): scores from centroids only"):
        resolve_score("cuda", q, (cent, cent), interpret=False)
    with pytest.raises(ValueError, match=r"score='cuda'\): it runs on a GPU only"):
        resolve_score("cuda", q, (cent,), interpret=True)
    with pytest.raises(ValueError, match=r"^score_keys: GpuDecodeTuning\(score='cuda'\): "):
        score_keys(q, (cent, cent), jnp.zeros((2, 64), jnp.int32), jnp.ones((2,), jnp.int32),
                   page_size=P, tuning=GpuDecodeTuning(score="cuda"))
    with pytest.raises(ValueError, match="^score_keys_cuda: 8 query heads are not a multiple"):
        score_keys_cuda(q, jnp.zeros((3, 10, D), jnp.bfloat16), jnp.zeros((2, 4), jnp.int32),
                        jnp.ones((2,), jnp.int32), page_size=P)
    with pytest.raises(ValueError, match="^score_keys_cuda: blocks must be >= 1, got 0"):
        score_keys_cuda(q, cent, jnp.zeros((2, 4), jnp.int32), jnp.ones((2,), jnp.int32),
                        page_size=P, blocks=0)
    assert "at most 8 query heads a KV head" in unsupported_args(
        jnp.zeros((2, 18, D), jnp.bfloat16), (jnp.zeros((2, 10, D), jnp.bfloat16),))
    if WHY is not None:
        with pytest.warns(UserWarning, match="CUDA one for score"):
            assert resolve_score("auto", q, (cent,), interpret=False) == "pallas"


def test_step_lowers_to_the_cuda_scoring_for_an_h100(monkeypatch):
    """On any host: the step with ``score="cuda"`` lowered for an H100 scores by the CUDA
    call, whose keys the Pallas selection takes; no Pallas scoring kernel is left."""
    from pallas_kernels import sparse_decode_gpu
    monkeypatch.setattr(sparse_decode_gpu, "score_cuda_unavailable", lambda: None)
    text = step_lowered_for_an_h100(GpuDecodeTuning(score="cuda", attend="pallas"))
    kernels = re.findall(r'name = "([a-z_]+)", num_stages', text)
    assert "sparse_decode_score" not in kernels and "sparse_decode_select" in kernels
    call = re.search(r"(%\d+) = stablehlo.custom_call @sparrow_sparse_score\(.*page_size = 16",
                     text)
    assert call, "no CUDA scoring call in the lowered step"
    select = re.search(r"stablehlo.custom_call @__gpu\$xla.gpu.triton\(([^)]*)\).*"
                       r"sparse_decode_select", text)
    assert select and select.group(1).split(", ")[0] == call.group(1)
