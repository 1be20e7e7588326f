"""sparse_decode against the float64 NumPy reference (tests/reference_np.py)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reference_np import sparse_decode_np
from sparrow_jax.attention.selection import page_centroids, page_minmax
from sparrow_jax.attention.sparse import resolve_impl, sparse_decode

P = 4  # small pages keep the cases small while giving many pages per sequence


def _scattered_case(rng, *, batch, hkv, r, d, lengths, pages_total=None, share=False):
    """Random q and paged cache; each sequence's pages are scattered over the pool in random
    order (optionally some slots shared between sequences, as n samples share prompt pages)."""
    m = max(-(-int(x) // P) for x in lengths) + 1  # one spare column, never read
    pages_total = pages_total or batch * m + 3
    perm = rng.permutation(pages_total)
    table = perm[: batch * m].reshape(batch, m).astype(np.int32)
    if share:
        table[1:, :2] = table[0, :2]
    q = rng.standard_normal((batch, hkv * r, d)).astype(np.float32)
    k = rng.standard_normal((hkv, pages_total, P, d)).astype(np.float32)
    v = rng.standard_normal((hkv, pages_total, P, d)).astype(np.float32)
    # Give pages distinct "topics" so that selection is far from uniform.
    k += 2.0 * rng.standard_normal((hkv, pages_total, 1, d)).astype(np.float32)
    return q, k, v, table, np.asarray(lengths, np.int32)


def _run(q, k, v, table, lengths, budgets, scorer, **kw):
    return np.asarray(sparse_decode(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                    jnp.asarray(table), jnp.asarray(lengths),
                                    jnp.asarray(budgets, jnp.int32), page_size=P, scorer=scorer,
                                    **kw))


def _check(rng, r, scorer, lengths, budgets, hkv=2, d=8, share=False):
    q, k, v, table, lengths = _scattered_case(rng, batch=len(lengths), hkv=hkv, r=r, d=d,
                                              lengths=lengths, share=share)
    got = _run(q, k, v, table, lengths, budgets, scorer)
    want = sparse_decode_np(q, k, v, table, lengths, budgets, page_size=P, scorer=scorer)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


# Lengths: 1 token, partial pages, exact page boundaries (8, 40, 64), long ragged ones.
LENGTHS = [1, 5, 8, 13, 40, 41, 64, 70]


@pytest.mark.parametrize("scorer", ["centroid", "quest"])
@pytest.mark.parametrize("r", [1, 2, 4, 5, 8])
def test_matches_numpy_reference(r, scorer):
    rng = np.random.default_rng(r + (scorer == "quest") * 100)
    # Budgets from the minimum 3 to more than any sequence needs, one per sequence.
    budgets = [3, 3, 4, 3, 5, 7, 9, 30]
    _check(rng, r, scorer, LENGTHS, budgets, share=True)


@pytest.mark.slow
@pytest.mark.parametrize("scorer,r,budget,seed", list(itertools.product(
    ["centroid", "quest"], [1, 2, 4, 5, 8], [3, 4, 6, 10, 17, 18, 19], [0, 1])))
def test_matches_numpy_reference_matrix(scorer, r, budget, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 72, size=6).tolist() + [68, 72]  # 68 = 17 pages, 72 = 18
    _check(rng, r, scorer, lengths, [budget] * len(lengths), d=16)


def test_budget_covering_all_pages_is_dense_exactly():
    rng = np.random.default_rng(7)
    lengths = [3, 16, 29, 40]
    q, k, v, table, lengths = _scattered_case(rng, batch=4, hkv=2, r=4, d=8, lengths=lengths)
    n = -(-lengths // P)
    got = _run(q, k, v, table, lengths, np.maximum(n, 3), "centroid")
    big = _run(q, k, v, table, lengths, n + 50, "quest")
    # Dense attention written directly: gather each sequence's tokens, causal softmax.
    dense = np.zeros_like(got)
    for b in range(4):
        tok = np.concatenate([np.arange(P) + P * table[b, j] for j in range(n[b])])[:lengths[b]]
        kk = k.reshape(2, -1, 8)[:, tok]
        vv = v.reshape(2, -1, 8)[:, tok]
        qq = jnp.asarray(q[b].reshape(2, 4, 8))
        logits = jnp.einsum("hrd,htd->hrt", qq, kk, precision="highest") * 8 ** -0.5
        dense[b] = np.asarray(jnp.einsum("hrt,htd->hrd", jax.nn.softmax(logits, -1), vv,
                                         precision="highest")).reshape(8, 8)
    np.testing.assert_allclose(got, dense, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got, big)


def _dyadic(rng, shape):
    # Multiples of 1/4 in [-4, 4]: sums and means of 4 of them are exact in float32, so pages
    # built to tie do tie exactly in every implementation.
    return (rng.integers(-16, 17, size=shape) / 4).astype(np.float32)


@pytest.mark.parametrize("scorer", ["centroid", "quest"])
def test_score_ties_go_to_the_lower_page_index(scorer):
    """Pages 2..9 have equal summaries but different keys and values: only the tie rule decides
    which are attended to, and the wrong choice changes the output."""
    rng = np.random.default_rng(3)
    hkv, r, d, n = 2, 2, 8, 12
    k = _dyadic(rng, (hkv, n, P, d))
    base = _dyadic(rng, (hkv, 1, P, d))
    for j in range(2, 10):
        if scorer == "centroid":  # same mean, different keys: a zero-mean perturbation
            delta = _dyadic(rng, (hkv, 1, d))
            k[:, j] = base[:, 0]
            k[:, j, 0] += delta[:, 0]
            k[:, j, 1] -= delta[:, 0]
        else:  # same elementwise min/max, different interior rows
            k[:, j] = base[:, 0]
            lo, hi = base[:, 0].min(axis=1), base[:, 0].max(axis=1)
            k[:, j, 0], k[:, j, 1] = lo, hi
            k[:, j, 2:] = np.clip(_dyadic(rng, (hkv, P - 2, d)), lo[:, None], hi[:, None])
    # Make the tied pages the best so that the tie decides the selection.
    q = np.zeros((1, hkv * r, d), np.float32)
    for h in range(hkv):
        summary = k[h, 2].mean(0) if scorer == "centroid" else k[h, 2].max(0)
        q[0, h * r:(h + 1) * r] = np.sign(summary) + _dyadic(rng, (r, d)) / 64
    k[:, 1] = -np.abs(k[:, 1]) * np.sign(q[0, ::r, None, :])  # page 1 scores low
    k[:, 10:] = k[:, 1:2]
    v = rng.standard_normal((hkv, n, P, d)).astype(np.float32)
    table = np.arange(n, dtype=np.int32)[None]
    length = np.array([n * P], np.int32)
    want, pages = sparse_decode_np(q, k, v, table, length, [6], page_size=P, scorer=scorer,
                                   return_pages=True)
    # ties go to the lower page index (docs/design.md, section 3)
    assert pages[0, 0] == [0, 2, 3, 4, 10, 11]
    got = _run(q, k, v, table, length, [6], scorer)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # A selection of other tied pages would give a visibly different output.
    other = sparse_decode_np(q, k[:, [0, 1, 7, 8, 9, 5, 6, 2, 3, 4, 10, 11]], v[:, [
        0, 1, 7, 8, 9, 5, 6, 2, 3, 4, 10, 11]], table, length, [6], page_size=P, scorer=scorer)
    assert np.abs(other - want).max() > 1e-3


def test_given_summaries_equal_computed_ones():
    rng = np.random.default_rng(11)
    q, k, v, table, lengths = _scattered_case(rng, batch=3, hkv=2, r=2, d=8, lengths=[30, 41, 9])
    budgets = [4, 5, 3]
    c = page_centroids(jnp.asarray(k))
    np.testing.assert_allclose(np.asarray(c), k.astype(np.float64).mean(axis=2), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_array_equal(_run(q, k, v, table, lengths, budgets, "centroid", centroids=c),
                                  _run(q, k, v, table, lengths, budgets, "centroid"))
    mm = page_minmax(jnp.asarray(k))
    np.testing.assert_array_equal(_run(q, k, v, table, lengths, budgets, "quest", summaries=mm),
                                  _run(q, k, v, table, lengths, budgets, "quest"))


def test_jit_with_runtime_budgets_and_static_max():
    rng = np.random.default_rng(5)
    q, k, v, table, lengths = _scattered_case(rng, batch=4, hkv=2, r=4, d=8,
                                              lengths=[33, 40, 7, 70])
    fn = jax.jit(lambda q, k, v, t, l, bud: sparse_decode(q, k, v, t, l, bud, page_size=P,
                                                          max_budget_pages=6))
    for budgets in ([3, 6, 4, 5], [6, 4, 3, 6]):
        got = np.asarray(fn(q, k, v, table, lengths, np.asarray(budgets, np.int32)))
        want = sparse_decode_np(q, k, v, table, lengths, budgets, page_size=P)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_bfloat16_cache_close_to_float64():
    rng = np.random.default_rng(9)
    q, k, v, table, lengths = _scattered_case(rng, batch=2, hkv=2, r=2, d=16, lengths=[50, 29])
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    got = sparse_decode(bf(q), bf(k), bf(v), jnp.asarray(table), jnp.asarray(lengths),
                        jnp.asarray([20, 20], jnp.int32), page_size=P)  # dense: no selection flip
    assert got.dtype == jnp.bfloat16
    want = sparse_decode_np(*(np.asarray(bf(x), np.float64) for x in (q, k, v)), table, lengths,
                            [20, 20], page_size=P)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=3e-2)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("kwargs,match", [
    (dict(budget_pages=[2, 5]), "budget_pages must be >= 3"),
    (dict(lengths=[0, 5]), "lengths must be in"),
    (dict(scorer="mean"), "unknown scorer"),
    (dict(impl="cuda"), "unknown impl"),
    (dict(page_size=8), "page_size=8"),
    (dict(max_budget_pages=4, budget_pages=[9, 3]), "more than max_budget_pages"),
    (dict(max_budget_pages=2), r"max_budget_pages must be in \[3"),
    (dict(page_table=np.full((2, 9), 99)), "pages_total"),
    (dict(centroids=np.zeros((2, 4, 8), np.float32)), "centroids must be"),
])
def test_bad_input_is_named(kwargs, match, impl):
    """Both implementations check their arguments alike (sparrow_jax.attention.sparse_args)."""
    rng = np.random.default_rng(0)
    q, k, v, table, lengths = _scattered_case(rng, batch=2, hkv=2, r=2, d=8, lengths=[30, 5])
    args = dict(budget_pages=[4, 4], lengths=lengths)
    args.update(kwargs)
    budgets = jnp.asarray(args.pop("budget_pages"), jnp.int32)
    lens = jnp.asarray(args.pop("lengths"), jnp.int32)
    args.setdefault("page_size", P)
    args.setdefault("impl", impl)
    for name in ("page_table", "centroids"):
        if name in args:
            args[name] = jnp.asarray(args[name])
    table = args.pop("page_table", table)
    with pytest.raises(ValueError, match=match):
        sparse_decode(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), lens,
                      budgets, **args)


def test_pallas_kernel_matches_numpy_reference():
    """impl="pallas": the Pallas kernels (interpreted off GPU, so CPU CI checks them) against the
    float64 reference, ragged lengths and budgets from the minimum to dense. head_dim 16: the
    kernels' smallest (matrix-unit tiles)."""
    rng = np.random.default_rng(21)
    lengths, budgets = [1, 13, 40, 70], [3, 4, 5, 30]
    q, k, v, table, lengths = _scattered_case(rng, batch=4, hkv=2, r=3, d=16, lengths=lengths)
    got = _run(q, k, v, table, lengths, budgets, "centroid", impl="pallas")
    want = sparse_decode_np(q, k, v, table, lengths, budgets, page_size=P)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_impl_choice(monkeypatch):
    """auto: the kernels of the platform where they apply, else the reference."""
    assert jax.default_backend() != "gpu" or resolve_impl("auto", "centroid", 128, 16) == "pallas"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert resolve_impl("auto", "centroid", 128, 16) == "reference"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_impl("auto", "centroid", 128, 16) == "pallas_tpu"
    assert resolve_impl("auto", "centroid", 64, 16) == "reference"      # below the lane width
    assert resolve_impl("auto", "centroid", 128, 8) == "reference"      # not a TPU page size
    assert resolve_impl("auto", "quest", 128, 16) == "pallas_tpu"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_impl("auto", "centroid", 128, 16) == "pallas"
    assert resolve_impl("auto", "quest", 128, 16) == "pallas"
    assert resolve_impl("auto", "centroid", 8, 16) == "reference"       # below the kernels' tile
    assert resolve_impl("auto", "centroid", 96, 16) == "reference"      # not a power of two
    assert resolve_impl("reference", "centroid", 128, 16) == "reference"
    assert resolve_impl("pallas", "centroid", 128, 16) == "pallas"
    with pytest.raises(ValueError, match="head_dim"):
        resolve_impl("pallas", "centroid", 96, 16)
    assert resolve_impl("triton", "centroid", 128, 16) == "triton"
    assert resolve_impl("triton", "quest", 128, 16) == "triton"
    with pytest.raises(ValueError, match=r"impl='triton'.*head_dim"):
        resolve_impl("triton", "quest", 96, 16)
    with pytest.raises(ValueError, match="unknown scorer"):
        resolve_impl("pallas", "minmax", 128, 16)


def test_auto_runs_the_kernels_exactly_on_gpu():
    """impl="auto" compiles to the GPU kernels on a GPU (the Pallas scoring, then the CUDA
    attention choosing its lists where it can be built, else the Pallas selection and
    attention) and to the reference elsewhere, and matches the float64 reference either way
    (bf16 cache, page 16, head_dim 128)."""
    from pallas_kernels.sparse_attend_cuda import SELECT_TARGET, TARGET, unavailable
    rng = np.random.default_rng(4)
    lengths = np.array([150, 77], np.int32)                  # 10 and 5 pages of 16
    q = rng.standard_normal((2, 8, 128))
    k = rng.standard_normal((2, 24, 16, 128)) + 2 * rng.standard_normal((2, 24, 1, 128))
    v = rng.standard_normal((2, 24, 16, 128))
    table = rng.permutation(24)[:20].reshape(2, 10).astype(np.int32)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    args = (bf(q), bf(k), bf(v), jnp.asarray(table), jnp.asarray(lengths),
            jnp.asarray([5, 4], jnp.int32))
    fn = jax.jit(lambda *a: sparse_decode(*a, page_size=16))
    hlo = fn.lower(*args).as_text()
    gpu = jax.default_backend() == "gpu"
    assert ("sparse_decode_score" in hlo) == gpu
    cuda = gpu and unavailable() is None
    # Two rows of 2 KV heads: the lists chosen inside the CUDA attention (one call).
    assert (f"@{SELECT_TARGET}(" in hlo) == cuda and f"@{TARGET}(" not in hlo
    assert ("sparse_decode_attend" in hlo) == (gpu and not cuda)
    want = sparse_decode_np(*(np.asarray(x, np.float64) for x in args[:3]), table, lengths,
                            [5, 4], page_size=16)
    got = np.asarray(fn(*args), np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2
