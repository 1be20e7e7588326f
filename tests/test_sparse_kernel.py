"""The Pallas sparse decode kernels (pallas_kernels/sparse_decode_gpu.py) against the float64 NumPy
reference of docs/design.md, section 3 (tests/reference_np.py), written independently of the
kernel code.

On CPU the kernels run in Pallas' interpreter; on a GPU the same tests compile them with Triton.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, score_keys, score_keys_xla,
                                              select_page_lists, sparse_decode_pallas)
from reference_np import (KERNEL_BUDGETS, KERNEL_LENGTHS, assert_kernel_close, random_kernel_case,
                          select_pages_np, sparse_decode_np)

INTERPRET = jax.default_backend() == "cpu"
P = 16


def reference(q, k, v, cent, table, lengths, budgets):
    """The float64 reference (tests/reference_np.py, docs/design.md, section 3) scoring the
    stored centroids -> (output, chosen slots per (b, h))."""
    return sparse_decode_np(as64(q), as64(k), as64(v), np.asarray(table), np.asarray(lengths),
                            np.asarray(budgets), page_size=P, centroids=as64(cent),
                            return_pages=True)


# ---------------------------------------------------------------- random cases

def make_case(rng, *, lengths, hkv, r, d, dtype, spare_cols=1, pages_total=None):
    """Random queries and paged cache with pages scattered over the pool in random order, page
    "topics" so that scores spread, and the centroids as the cache stores them (float32 mean of
    the keys, rounded to the cache dtype)."""
    lengths = np.asarray(lengths, np.int32)
    m = int(-(-lengths.max() // P)) + spare_cols
    b = len(lengths)
    pages_total = pages_total or b * m + 5
    table = rng.permutation(pages_total)[: b * m].reshape(b, m).astype(np.int32)
    q = rng.standard_normal((b, hkv * r, d))
    k = rng.standard_normal((hkv, pages_total, P, d)) + 2 * rng.standard_normal(
        (hkv, pages_total, 1, d))
    v = rng.standard_normal((hkv, pages_total, P, d))
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    cent = jnp.mean(k.astype(jnp.float32), axis=2).astype(dtype)
    return q, k, v, cent, jnp.asarray(table), jnp.asarray(lengths)


def as64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def check(rng, *, lengths, budgets, hkv, r, d, dtype, **kw):
    q, k, v, cent, table, lengths = make_case(rng, lengths=lengths, hkv=hkv, r=r, d=d,
                                              dtype=dtype)
    budgets = jnp.asarray(budgets, jnp.int32)
    out = sparse_decode_pallas(q, k, v, table, lengths, budgets, page_size=P, centroids=cent,
                               interpret=INTERPRET, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    want, _ = reference(q, k, v, cent, table, lengths, budgets)
    got = as64(out)
    assert_kernel_close(got, want, low_precision=dtype == jnp.bfloat16)


@pytest.mark.parametrize("r,d,dtype", [(1, 64, jnp.float32), (5, 128, jnp.float32),
                                       (4, 128, jnp.bfloat16), (8, 64, jnp.bfloat16)])
def test_matches_float64_reference(r, d, dtype):
    rng = np.random.default_rng(r * 1000 + d)
    check(rng, lengths=KERNEL_LENGTHS, budgets=KERNEL_BUDGETS, hkv=2, r=r, d=d, dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("r", [1, 2, 3, 4, 5, 6, 7, 8])
def test_full_matrix(r, d, dtype):
    rng = np.random.default_rng(r * 7 + d)
    lengths, budgets = random_kernel_case(rng)
    check(rng, lengths=lengths, budgets=budgets, hkv=2, r=r, d=d, dtype=dtype)


@pytest.mark.parametrize("r,d,dtype", [(5, 128, jnp.float32), (2, 64, jnp.bfloat16)])
def test_quest_matches_float64_reference(r, d, dtype):
    """scorer="quest": each page's bound from its elementwise min and max of keys, the largest
    over the group's heads (the reference scores from the keys themselves)."""
    rng = np.random.default_rng(r * 100 + d)
    q, k, v, _, table, lengths = make_case(rng, lengths=KERNEL_LENGTHS, hkv=2, r=r, d=d,
                                           dtype=dtype)
    budgets = jnp.asarray(KERNEL_BUDGETS, jnp.int32)
    out = sparse_decode_pallas(q, k, v, table, lengths, budgets, page_size=P, scorer="quest",
                               interpret=INTERPRET)
    want = sparse_decode_np(as64(q), as64(k), as64(v), np.asarray(table), np.asarray(lengths),
                            np.asarray(budgets), page_size=P, scorer="quest")
    assert_kernel_close(as64(out), want, low_precision=dtype == jnp.bfloat16)


@pytest.mark.parametrize("score", ["pallas", "xla"])
def test_quest_selection_equals_reference(score):
    """The Quest lists, page for page (a group of 3: the largest over heads matters), from the
    summaries as the cache stores them, by either scoring."""
    rng = np.random.default_rng(13)
    q, k, v, _, table, lengths = make_case(rng, lengths=[1000, 17, 600], hkv=2, r=3, d=64,
                                           dtype=jnp.float32)
    budgets = np.array([30, 3, 64], np.int32)
    minmax = (jnp.min(k, axis=2), jnp.max(k, axis=2))
    phys, slots, count = select_page_lists(q, minmax, table, lengths, jnp.asarray(budgets),
                                           page_size=P, max_pages=64, interpret=INTERPRET,
                                           tuning=GpuDecodeTuning(score=score))
    got, _ = lists_as_sets(phys, slots, count)
    _, want = sparse_decode_np(as64(q), as64(k), as64(v), np.asarray(table),
                               np.asarray(lengths), budgets, page_size=P, scorer="quest",
                               return_pages=True)
    assert got == want


@pytest.mark.parametrize("tuning", [
    GpuDecodeTuning(block_pages=4, splits=3, score_chunk=16, score_warps=2),
    GpuDecodeTuning(block_pages=8, splits=1, score_chunk=128, select_warps=8, attend_warps=4,
                    attend_stages=2),
    GpuDecodeTuning(block_pages=2, splits=5),
    GpuDecodeTuning(score="xla")])
def test_settings_do_not_change_the_result(tuning):
    """Splits (also ones that leave some empty), block sizes, scoring chunks, warps, stages
    and the scoring's implementation are tuning only."""
    rng = np.random.default_rng(7)
    check(rng, lengths=[700, 33, 260], budgets=[17, 5, 9], hkv=1, r=3, d=64,
          dtype=jnp.float32, tuning=tuning)


@pytest.mark.parametrize("change,match", [(dict(block_pages=3), "block_pages"),
                                          (dict(splits=0), "splits"),
                                          (dict(score_chunk=8), "score_chunk"),
                                          (dict(attend_warps=3), "attend_warps"),
                                          (dict(attend_stages=0), "attend_stages"),
                                          (dict(score="triton"), "score")])
def test_bad_tuning_is_named(change, match):
    with pytest.raises(ValueError, match=match):
        GpuDecodeTuning(**change)


def lists_as_sets(phys, slots, count):
    c = np.asarray(count)[..., 0]
    s = np.asarray(slots)
    return {(b, h): s[b, h, : c[b, h]].tolist() for b in range(c.shape[0])
            for h in range(c.shape[1])}, np.asarray(phys)


@pytest.mark.parametrize("score", ["pallas", "xla"])
def test_selection_equals_reference_and_lists_are_padded(score):
    rng = np.random.default_rng(11)
    q, k, v, cent, table, lengths = make_case(rng, lengths=[1000, 17, 600], hkv=2, r=2, d=64,
                                              dtype=jnp.float32)
    budgets = np.array([30, 3, 64], np.int32)
    max_pages = 64
    phys, slots, count = select_page_lists(
        q, cent, table, lengths, jnp.asarray(budgets), page_size=P,
        max_pages=max_pages, interpret=INTERPRET, tuning=GpuDecodeTuning(score=score))
    got, phys = lists_as_sets(phys, slots, count)
    _, want = reference(q, k, v, cent, table, lengths, budgets)
    assert got == want
    tab = np.asarray(table)
    for (b, h), pages in want.items():
        c = len(pages)
        assert phys[b, h, :c].tolist() == tab[b, pages].tolist()
        # Entries past the count repeat the last page (read from cache, masked out).
        assert (phys[b, h, c:max_pages] == tab[b, pages[-1]]).all()


def test_selection_in_a_wide_table_follows_each_row():
    """The selection searches the smallest power of two of slots (from 256) that holds a row's
    pages, and nothing under budget: rows of 5, 150, 256, 257, 300 and 700 pages in a
    1024-slot table (one branch each side of every size boundary) give the reference's
    pages, and so does the whole decode step."""
    rng = np.random.default_rng(12)
    pages = np.array([5, 150, 256, 257, 300, 700])
    lengths = pages * P - rng.integers(0, P, pages.size)
    q, k, v, cent, table, lengths = make_case(rng, lengths=lengths, hkv=1, r=2, d=16,
                                              dtype=jnp.float32, spare_cols=200)
    assert table.shape[1] > 512
    budgets = jnp.asarray([40, 40, 64, 40, 200, 100], jnp.int32)
    phys, slots, count = select_page_lists(
        q, cent, table, lengths, budgets, page_size=P, max_pages=256,
        interpret=INTERPRET)
    got, _ = lists_as_sets(phys, slots, count)
    want_out, want = reference(q, k, v, cent, table, lengths, budgets)
    assert got == want
    out = sparse_decode_pallas(q, k, v, table, lengths, budgets, page_size=P, centroids=cent,
                               max_budget_pages=256, interpret=INTERPRET)
    assert_kernel_close(as64(out), want_out, low_precision=False)


@pytest.mark.parametrize("score", ["pallas", "xla"])
def test_scoring_marks_every_slot_past_each_row(score):
    """Scoring programs wholly past a row's eligible pages skip the scoring: in a 1024-slot
    table, rows of 3, 70 and 700 pages get, at every slot past page n - 3 and at page 0, the
    smallest key, and at pages 1 .. n - 3 keys in the order of the float64 scores
    ``mean(q of the group) . centroid``; the same from the scoring in XLA."""
    rng = np.random.default_rng(13)
    pages = np.array([3, 70, 700])
    q, _, _, cent, table, lengths = make_case(rng, lengths=pages * P, hkv=2, r=3, d=16,
                                              dtype=jnp.float32, spare_cols=300)
    mpad = 1024
    padded = jnp.pad(table, ((0, 0), (0, mpad - table.shape[1])))
    if score == "xla":
        keys = np.asarray(score_keys_xla(q, cent, padded, lengths, page_size=P))
    else:
        keys = np.asarray(score_keys(q, cent, padded, lengths, page_size=P,
                                     interpret=INTERPRET))
    assert keys.shape == (2, 3, mpad)
    qbar = as64(q).reshape(3, 2, 3, -1).mean(axis=2)
    for b, n in enumerate(pages):
        for h in range(2):
            assert (keys[h, b, 0] == keys[h, b, n - 2:]).all()
            assert (keys[h, b, 1:n - 2] > keys[h, b, 0]).all()
            want = as64(cent)[h, np.asarray(table)[b, 1:n - 2]] @ qbar[b, h]
            assert (np.argsort(keys[h, b, 1:n - 2], kind="stable")
                    == np.argsort(want, kind="stable")).all()


@pytest.mark.parametrize("score", ["pallas", "xla"])
def test_ties_past_the_first_sizes_go_to_the_lower_page_index(score):
    """Three centroid values over 600 pages (a 1024-slot search): slot j is high when
    j % 12 == 2, mid when j % 12 == 5, low otherwise, so 50 high slots tie for the budget's
    37 places by score, which go to the lowest: 2, 14, .., 434 (past the first 256 slots);
    plus pages 0, 598 and 599."""
    d, n = 16, 600
    levels = np.array([-1.0, 0.5, 2.0])
    cent = np.zeros((1, n + 4, d), np.float32)
    table = np.arange(2, n + 2, dtype=np.int32)[None, :]
    for j in range(n):
        cent[0, table[0, j]] = levels[{2: 2, 5: 1}.get(j % 12, 0)]
    q = np.ones((1, 2, d), np.float32)
    phys, slots, count = select_page_lists(
        jnp.asarray(q), jnp.asarray(cent), jnp.asarray(table),
        jnp.asarray([n * P], jnp.int32), jnp.asarray([40], jnp.int32), page_size=P,
        max_pages=40, interpret=INTERPRET, tuning=GpuDecodeTuning(score=score))
    got, _ = lists_as_sets(phys, slots, count)
    assert got[0, 0] == [0] + list(range(2, 435, 12)) + [598, 599]


def test_ties_go_to_the_lower_page_index():
    """Centroids with only three distinct values: most scores tie, and the lower slots win.
    Worked by hand: n = 12 pages, budget 6 -> pages 0, 10, 11 and the 3 best of slots 1..9.
    Slots 1..9 score (per the pattern below) low, high, mid, high, mid, high, low, high, mid:
    the four 'high' slots 2, 4, 6, 8 tie for 3 places -> 2, 4, 6."""
    d, hkv = 16, 1
    pattern = [0, 0, 2, 1, 2, 1, 2, 0, 2, 1, 0, 0]          # 0 low, 1 mid, 2 high (slots 0..11)
    levels = np.array([-1.0, 0.5, 2.0])
    n_total = len(pattern) + 4
    cent = np.zeros((hkv, n_total, d), np.float32)
    table = np.arange(3, 3 + len(pattern), dtype=np.int32)[None, :]
    for j, lvl in enumerate(pattern):
        cent[0, table[0, j]] = levels[lvl]
    q = np.ones((1, 2, d), np.float32)
    phys, slots, count = select_page_lists(
        jnp.asarray(q), jnp.asarray(cent), jnp.asarray(table),
        jnp.asarray([12 * P - 5], jnp.int32), jnp.asarray([6], jnp.int32), page_size=P,
        max_pages=12, interpret=INTERPRET)
    got, _ = lists_as_sets(phys, slots, count)
    assert got[0, 0] == [0, 2, 4, 6, 10, 11]


def assert_selects_by_value(vals, table, budgets):
    """One KV head, one query head q = e_0 and centroids whose first coordinate is ``vals``
    (``[N]``, by physical page), so a page's score is its value; one row per budget, each over
    ``table`` (``[n]``): the kernel's page lists against the reference's ranking."""
    n, d = len(table), 8
    cent = np.zeros((1, len(vals), d), np.float32)
    cent[0, :, 0] = vals
    q = np.zeros((1, 1, d), np.float32)
    q[0, 0, 0] = 1.0
    rows = len(budgets)
    phys, slots, count = select_page_lists(
        jnp.asarray(np.repeat(q, rows, 0)), jnp.asarray(cent),
        jnp.asarray(np.tile(table, (rows, 1))), jnp.full((rows,), n * P, jnp.int32),
        jnp.asarray(budgets, jnp.int32), page_size=P, max_pages=n, interpret=INTERPRET)
    got, _ = lists_as_sets(phys, slots, count)
    scores = np.full(n, -np.inf)
    scores[1:n - 2] = cent[0, table[1:n - 2], 0]
    for i, budget in enumerate(budgets):
        assert got[i, 0] == select_pages_np(scores, n, int(budget)), budget


def test_negative_and_zero_scores_order_correctly():
    """The float -> int key order across signs, -0.0 equal to 0.0 (ties by index)."""
    vals = np.array([0.0, -3.0, -0.0, 1.5, -1.0, 0.0, -0.0, 2.5, -7.0, 9.0, 0.0, 0.0],
                    np.float32)
    n = len(vals)
    assert_selects_by_value(vals, np.arange(n, dtype=np.int32), np.arange(3, n + 1))


@pytest.mark.parametrize("shape", ["geometric", "outlier", "clusters", "two_values"])
def test_threshold_search_on_hard_score_shapes(shape):
    """Score shapes hard for a threshold search (growth over many orders of magnitude, both
    signs; one outlier far above a narrow band; tight clusters far apart; two values), each at
    budgets from one chosen page to all but one candidate, pages scattered over the pool."""
    n = 300
    j = np.arange(n, dtype=np.float64)
    rng = np.random.default_rng(21)
    vals = {"geometric": np.where(j % 2 == 0, 1.0, -1.0) * 2.0 ** (j / 5 - 30),
            "outlier": np.where(j == 7, 1e30, 1.0 + 1e-5 * rng.standard_normal(n)),
            "clusters": rng.choice([-1e6, 0.0, 3e4], n) + 1e-3 * rng.standard_normal(n),
            "two_values": np.where(j % 3 == 0, 2.0, 1.0)}[shape].astype(np.float32)
    assert_selects_by_value(vals, rng.permutation(n).astype(np.int32),
                            [4, 5, 20, 64, 150, n - 2, n - 1])


def test_zero_length_row_gives_zeros():
    """Under jit (lengths traced, not checkable) a row of length 0 returns zeros, not NaN; a
    concrete 0 is rejected, as by sparse_decode."""
    rng = np.random.default_rng(3)
    q, k, v, cent, table, _ = make_case(rng, lengths=[40, 40], hkv=1, r=2, d=64,
                                        dtype=jnp.float32)
    fn = jax.jit(lambda lens: sparse_decode_pallas(q, k, v, table, lens,
                                                   jnp.asarray([3, 3], jnp.int32), page_size=P,
                                                   centroids=cent, interpret=INTERPRET))
    out = np.asarray(fn(jnp.asarray([40, 0], jnp.int32)))
    assert np.isfinite(out).all()
    assert (out[1] == 0).all()
    with pytest.raises(ValueError, match="lengths must be in"):
        sparse_decode_pallas(q, k, v, table, jnp.asarray([40, 0], jnp.int32),
                             jnp.asarray([3, 3], jnp.int32), page_size=P, interpret=True)


def test_centroids_default_to_the_page_means():
    rng = np.random.default_rng(5)
    q, k, v, cent, table, lengths = make_case(rng, lengths=[300, 90], hkv=2, r=2, d=64,
                                              dtype=jnp.float32)
    args = (q, k, v, table, lengths, jnp.asarray([6, 4], jnp.int32))
    a = sparse_decode_pallas(*args, page_size=P, interpret=INTERPRET)
    b = sparse_decode_pallas(*args, page_size=P, centroids=cent, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("change,match", [
    (dict(scorer="top"), "unknown scorer"),
    (dict(scorer="quest", centroids=jnp.zeros((2, 5, 64))), "takes summaries"),
    (dict(scorer="quest", summaries=(jnp.zeros((2, 5, 64)),) * 2), "kmin"),
    (dict(page_size=8), "page_size"),
    (dict(max_budget_pages=2), "max_budget_pages"),
    (dict(q=jnp.zeros((2, 3, 64))), "multiple"),
    (dict(lengths=jnp.zeros((3,), jnp.int32)), "lengths"),
    (dict(budget_pages=jnp.zeros((2,), jnp.float32)), "integer"),
    (dict(centroids=jnp.zeros((2, 5, 64))), "centroids"),
    (dict(budget_pages=jnp.asarray([3, 2], jnp.int32)), ">= 3"),
    (dict(lengths=jnp.asarray([40, 10_000], jnp.int32)), "lengths must be in"),
    (dict(page_table=jnp.full((2, 4), 10_000, jnp.int32)), "pages_total"),
    (dict(budget_pages=jnp.asarray([3, 4], jnp.int32), max_budget_pages=3,
          lengths=jnp.asarray([40, 64], jnp.int32)), "need more than max_budget_pages"),
    (dict(budget_pages=jnp.asarray([3, 4], jnp.int32), max_budget_pages=3,
          lengths=jnp.asarray([40, 40], jnp.int32)), None),
])
def test_bad_input_is_named(change, match):
    rng = np.random.default_rng(0)
    q, k, v, cent, table, lengths = make_case(rng, lengths=[40, 40], hkv=2, r=2, d=64,
                                              dtype=jnp.float32)
    args = dict(q=q, k_pages=k, v_pages=v, page_table=table, lengths=lengths,
                budget_pages=jnp.asarray([3, 3], jnp.int32), page_size=P)
    args.update(change)
    if match is None:   # the control: valid input passes the checks and runs
        sparse_decode_pallas(**args, interpret=True)
        return
    with pytest.raises(ValueError, match=match):
        sparse_decode_pallas(**args, interpret=True)


@pytest.mark.parametrize("scorer", ["centroid", "quest"])
def test_decode_step_through_the_kernels(monkeypatch, scorer):
    """decode_step(impl="pallas") on a tiny model: the sparse layer runs the kernels and gives
    the hidden state of impl="reference" (float32 cache), with either scorer reading the
    summaries the cache keeps."""
    from flax import nnx

    from sparrow_jax.attention import sparse
    from sparrow_jax.attention.allocator import PageAllocator
    from sparrow_jax.attention.decode import decode_step, prefill_jit
    from sparrow_jax.attention.paged_cache import init_cache
    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.qwen3 import init_model

    cfg = ModelConfig(vocab_size=ModelConfig.preset("tiny").vocab_size, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    model = init_model(cfg, seed=0)
    page, lengths = 4, [41, 30]
    alloc = PageAllocator(60, page, seed=6).allocate(lengths, 1, 2)
    rng = np.random.default_rng(7)
    toks = np.zeros((2, max(lengths)), np.int32)
    for i, n in enumerate(lengths):
        toks[i, :n] = rng.integers(1, cfg.vocab_size, n)
    cache = init_cache(cfg, 60, alloc.page_table, page_size=page, dtype=jnp.float32,
                       scorer=scorer)
    _, cache = prefill_jit(model, cache, jnp.asarray(toks), jnp.asarray(lengths))
    kernel_calls = []
    kernel = sparse.sparse_decode_pallas_checked
    monkeypatch.setattr(sparse, "sparse_decode_pallas_checked",
                        lambda *a, **kw: kernel_calls.append(kw) or kernel(*a, **kw))
    step = functools.partial(nnx.jit(decode_step, static_argnames=("dense_layers", "impl",
                                                                   "scorer")), scorer=scorer)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, 2).astype(np.int32))
    budget = jnp.asarray([5, 4], jnp.int32)          # of 11 and 8 pages: sparse
    got, _ = step(model, cache, tokens, budget_pages=budget, dense_layers=(0,), impl="pallas")
    assert len(kernel_calls) == 1                    # layer 1 (traced once)
    assert kernel_calls[0]["interpret"] == (jax.default_backend() != "gpu")
    want, _ = step(model, cache, tokens, budget_pages=budget, dense_layers=(0,),
                   impl="reference")
    assert len(kernel_calls) == 1
    rel = np.abs(np.asarray(got) - np.asarray(want)).max() / np.abs(np.asarray(want)).max()
    assert rel < 1e-5, rel
