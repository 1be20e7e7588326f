"""The TPU sparse decode kernels (pallas_kernels/sparse_decode_tpu.py) against the float64 NumPy
reference (tests/reference_np.py), in TPU interpret mode on CPU (DMAs and semaphores simulated,
uninitialised VMEM filled with NaN so that reading an uncopied page shows).

Each distinct shape compiles the interpreter's program once (~10 s here), so the default suite
keeps a few cases that together cover the matrix's axes; the full matrix is slow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_decode_tpu import (LANES, TpuDecodeTuning, page_lists, row_keys,
                                              select_ranks, sparse_decode_tpu,
                                              sparse_decode_tpu_checked)
from reference_np import (KERNEL_BUDGETS, KERNEL_LENGTHS, assert_kernel_close, random_kernel_case,
                          select_pages_np, sparse_decode_np)

INTERPRET = jax.default_backend() != "tpu"


def as64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def make_case(rng, *, lengths, hkv, r, d, dtype, page_size, contiguous=False, spare_cols=1):
    """Random queries and paged cache, page "topics" so that scores spread, centroids as the
    cache stores them. Pages are scattered over the pool in random order, or (contiguous) each
    sequence's pages are one run of the pool, so that chosen neighbours coalesce."""
    lengths = np.asarray(lengths, np.int32)
    m = int(-(-lengths.max() // page_size)) + spare_cols
    b = len(lengths)
    pages_total = b * m + 5
    order = np.arange(pages_total) if contiguous else rng.permutation(pages_total)
    table = order[: b * m].reshape(b, m).astype(np.int32)
    q = rng.standard_normal((b, hkv * r, d))
    k = rng.standard_normal((hkv, pages_total, page_size, d)) + 2 * rng.standard_normal(
        (hkv, pages_total, 1, d))
    v = rng.standard_normal((hkv, pages_total, page_size, d))
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    cent = jnp.mean(k.astype(jnp.float32), axis=2).astype(dtype)
    return q, k, v, cent, jnp.asarray(table), jnp.asarray(lengths)


def check(rng, *, lengths, budgets, hkv, r, d, dtype, page_size, contiguous=False,
          zero_row=False, **kw):
    q, k, v, cent, table, lengths = make_case(rng, lengths=lengths, hkv=hkv, r=r, d=d,
                                              dtype=dtype, page_size=page_size,
                                              contiguous=contiguous)
    budgets = jnp.asarray(budgets, jnp.int32)
    if zero_row:
        # A padding row of length 0, which only the unchecked entry (as under jit) accepts.
        out = sparse_decode_tpu_checked(q, k, v, cent, table, lengths.at[-1].set(0), budgets,
                                        page_size=page_size, interpret=INTERPRET, **kw)
        assert (np.asarray(out[-1], np.float32) == 0).all()
        out, q, table, lengths, budgets = out[:-1], q[:-1], table[:-1], lengths[:-1], budgets[:-1]
    else:
        out = sparse_decode_tpu(q, k, v, table, lengths, budgets, page_size=page_size,
                                centroids=cent, interpret=INTERPRET, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = sparse_decode_np(as64(q), as64(k), as64(v), np.asarray(table), np.asarray(lengths),
                            np.asarray(budgets), page_size=page_size, centroids=as64(cent))
    got = as64(out)
    assert_kernel_close(got, want, low_precision=dtype == jnp.bfloat16)


@pytest.mark.parametrize("case", [
    # GQA 5 (padded to 8 rows), float32, page 16, lists in SMEM, one copy per page.
    dict(r=5, dtype=jnp.float32, page_size=16, tuning=TpuDecodeTuning(coalesce=False)),
    # bf16, page 32, lists streamed per row, contiguous tables (runs coalesce), blocks of 3
    # pages (runs cut at odd block ends), a padding row of length 0.
    dict(r=8, dtype=jnp.bfloat16, page_size=32, contiguous=True, zero_row=True,
         tuning=TpuDecodeTuning(stream_lists=True, block_pages=3)),
    # page 64, no GQA, float32, coalesced, lists of 12 slots (max_budget_pages < M).
    dict(r=1, dtype=jnp.float32, page_size=64, contiguous=True, max_budget_pages=12,
         budgets=[3, 3, 3, 4, 12, 9], lengths=[1, 20, 64, 130, 700, 2000]),
])
def test_matches_float64_reference(case):
    case = dict(case)
    rng = np.random.default_rng(case["r"] * 100 + case["page_size"])
    check(rng, lengths=case.pop("lengths", KERNEL_LENGTHS),
          budgets=case.pop("budgets", KERNEL_BUDGETS), hkv=2, d=128, **case)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [16, 32, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("r", [1, 2, 3, 4, 5, 6, 7, 8])
def test_full_matrix(r, dtype, page_size):
    rng = np.random.default_rng(r * 7 + page_size)
    lengths, budgets = random_kernel_case(rng)
    check(rng, lengths=lengths, budgets=budgets, hkv=2, r=r, d=128, dtype=dtype,
          page_size=page_size, contiguous=bool(r % 2),
          tuning=TpuDecodeTuning(stream_lists=bool(r % 3 == 0), coalesce=r != 4))


def lists_of(scores_by_slot, n, budgets, *, page_size=16, block_pages=4):
    """Run the selection kernel and the list step on given per-slot scores ``[rows, M]`` (one
    KV head, identity page table, the pool scored as the slots) -> each row's chosen slots."""
    rows, m = scores_by_slot.shape
    table = jnp.tile(jnp.arange(m, dtype=jnp.int32), (rows, 1))
    pool = jnp.asarray(scores_by_slot, jnp.float32)[None]                 # [1, rows, N = M]
    lengths = jnp.asarray(n, jnp.int32) * page_size
    mpad = -(-m // (8 * LANES)) * 8 * LANES
    keys = row_keys(pool, table, lengths, page_size=page_size, mpad=mpad)
    rank = select_ranks(keys, lengths, jnp.asarray(budgets, jnp.int32), page_size=page_size,
                        max_pages=m, interpret=INTERPRET).reshape(rows, 1, mpad)
    phys, _, count = page_lists(rank, table, kpad=m, block_pages=block_pages, coalesce=True)
    return [np.asarray(phys)[i, 0, : int(count[i, 0])].tolist() for i in range(rows)]


def test_selection_ties_and_signs_equal_the_reference():
    """Scores with only three distinct values (most tie: the lower slots win), and scores of
    both signs with -0.0 beside 0.0 (equal, so ties by index), at every budget."""
    pattern = np.array([0, 0, 2, 1, 2, 1, 2, 0, 2, 1, 0, 0], np.float32)   # 12 slots
    signed = np.array([0.0, -3.0, -0.0, 1.5, -1.0, 0.0, -0.0, 2.5, -7.0, 9.0, 0.0, 0.0],
                      np.float32)
    rows, budgets = [], []
    for s in (pattern, signed):
        for budget in range(3, 13):
            rows.append(s)
            budgets.append(budget)
    got = lists_of(np.stack(rows), [12] * len(rows), budgets)
    for s, budget, pages in zip(rows, budgets, got):
        scores = np.full(12, -np.inf)
        scores[1:10] = s[1:10]
        assert pages == select_pages_np(scores, 12, budget), (s, budget)
    # Worked by hand: budget 6 over the pattern keeps 0, 10, 11 and the 3 best of slots 1..9,
    # whose 'high' (2) slots 2, 4, 6, 8 tie for 3 places -> 2, 4, 6.
    assert got[3] == [0, 2, 4, 6, 10, 11]


@pytest.mark.parametrize("r,dtype", [(3, jnp.float32), (4, jnp.bfloat16)])
def test_quest_matches_float64_reference(r, dtype):
    """scorer="quest" on the TPU kernels: Quest's bound per query head on the matrix unit (the
    positive and negative parts of q against kmax and kmin), the largest over the group."""
    rng = np.random.default_rng(40 + r)
    q, k, v, _, table, lengths = make_case(rng, lengths=KERNEL_LENGTHS, hkv=2, r=r, d=128,
                                           dtype=dtype, page_size=16)
    budgets = jnp.asarray(KERNEL_BUDGETS, jnp.int32)
    out = sparse_decode_tpu(q, k, v, table, lengths, budgets, page_size=16, scorer="quest",
                            summaries=(jnp.min(k, axis=2), jnp.max(k, axis=2)),
                            interpret=INTERPRET)
    want = sparse_decode_np(as64(q), as64(k), as64(v), np.asarray(table), np.asarray(lengths),
                            np.asarray(budgets), page_size=16, scorer="quest")
    assert_kernel_close(as64(out), want, low_precision=dtype == jnp.bfloat16)


def test_page_lists_mark_runs():
    """Runs of entries whose pages follow each other in the pool, cut at block ends and at the
    count (worked by hand)."""
    rank = jnp.asarray([[[0, 1, 2, 3, 4, 5, 6, -1]]], jnp.int32)
    table = jnp.asarray([[7, 8, 9, 3, 4, 5, 11, 12]], jnp.int32)
    phys, runs, count = page_lists(rank, table, kpad=8, block_pages=4, coalesce=True)
    assert np.asarray(phys)[0, 0].tolist() == [7, 8, 9, 3, 4, 5, 11, 0]
    assert int(count[0, 0]) == 7
    # Starts of runs: entry 0 (7, 8, 9), 3 (3: block ends at 4), 4 (4, 5), 6 (11; count 7).
    r = np.asarray(runs)[0, 0]
    assert [r[0], r[3], r[4], r[6]] == [3, 1, 2, 1]
    _, ones, _ = page_lists(rank, table, kpad=8, block_pages=4, coalesce=False)
    assert (np.asarray(ones) == 1).all()


@pytest.mark.parametrize("change,match", [
    (dict(d=64), "head_dim a multiple of 128"),
    (dict(page_size=8), "page_size in"),
    (dict(scorer="top"), "unknown scorer"),
])
def test_unsupported_cases_raise_clearly(change, match):
    d, p = change.pop("d", 128), change.get("page_size", 16)
    q = jnp.zeros((1, 2, d))
    pages = jnp.zeros((1, 4, p, d))
    with pytest.raises(ValueError, match=match):
        sparse_decode_tpu(q, pages, pages, jnp.zeros((1, 2), jnp.int32),
                          jnp.asarray([p], jnp.int32), jnp.asarray([3], jnp.int32),
                          **{"page_size": p, **change}, interpret=True)


def test_tuning_is_validated():
    with pytest.raises(ValueError, match="score_tile"):
        TpuDecodeTuning(score_tile=100)
    with pytest.raises(ValueError, match="block_pages"):
        TpuDecodeTuning(block_pages=0)


def test_engine_greedy_tokens_match_the_reference(monkeypatch):
    """A tiny model with head_dim 128 through the rollout engine: impl="pallas_tpu" (interpret
    mode here) gives the greedy tokens of impl="reference", with the sparse layer really taking
    the TPU kernels (4 of 5-8 pages: scored, selected, attended)."""
    from pallas_kernels import sparse_decode_tpu as tpu
    from sparrow_jax.attention import sparse
    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.qwen3 import init_model
    from sparrow_jax.rollout.engine import RolloutConfig, generate
    from sparrow_jax.schedule import BudgetSchedule

    cfg = ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    model = init_model(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 48, n).tolist() for n in (70, 101)]
    schedule = BudgetSchedule(kind="fixed", pages=4, page_size=16)
    calls = []
    kernel = tpu.sparse_decode_tpu_checked
    monkeypatch.setattr(tpu, "sparse_decode_tpu_checked",
                        lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    runs = {}
    for impl in ("pallas_tpu", "reference"):
        config = RolloutConfig(n=1, max_new_tokens=8, temperature=0.0, page_size=16,
                               dense_layers=(0,), impl=impl, steps_per_call=8, page_seed=1,
                               num_pages=24, table_bucket_pages=8, prompt_multiple=16)
        ro = generate(model, prompts, config, jax.random.key(0), schedule)
        runs[impl] = ro
    assert calls and all(kw["interpret"] == INTERPRET for kw in calls)
    assert "pallas_tpu" in sparse.IMPLS
    got, want = runs["pallas_tpu"], runs["reference"]
    assert (np.asarray(want.budget_pages)[:, 1:] == 4).all()     # the steps ran sparse
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    # Greedy tokens of a random model repeat; the top-k log-probs of every step say more.
    np.testing.assert_allclose(np.asarray(got.topk_logprobs), np.asarray(want.topk_logprobs),
                               rtol=1e-4, atol=1e-4)
