"""Acceptance-rate estimators, tail statistic and Beta fit against hand computations and NumPy."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reference_np import (alpha_exact_np, alpha_paper_np, alpha_topk_bound_np, softmax_np,
                          tail_statistic_np)
from sparrow_jax.mismatch import (_betainc, acceptance_rate, acceptance_rate_paper,
                                  acceptance_rate_topk_bound, fit_scaled_beta, tail_statistic)

P_HAND = np.array([0.5, 0.3, 0.15, 0.05])
Q_HAND = np.array([0.2, 0.3, 0.4, 0.1])


def _topk(logprobs, k):
    ids = np.argsort(-logprobs, axis=-1, kind="stable")[..., :k]
    return ids, np.take_along_axis(logprobs, ids, axis=-1)


def _estimators(lp, lq, k):
    q_ids, q_lp = _topk(lq, k)
    p_ids, p_lp = _topk(lp, k)
    bound = acceptance_rate_topk_bound(jnp.asarray(np.take_along_axis(lp, q_ids, -1)),
                                       jnp.asarray(q_lp))
    paper = acceptance_rate_paper(*map(jnp.asarray, (p_ids, p_lp, q_ids, q_lp)))
    return np.asarray(paper), np.asarray(bound)


def test_hand_computed_example():
    lp, lq = np.log(P_HAND), np.log(Q_HAND)
    # exact: min per id = .2 + .3 + .15 + .05
    assert float(acceptance_rate(jnp.asarray(lp), jnp.asarray(lq))) == pytest.approx(0.70, abs=1e-6)
    paper, bound = _estimators(lp, lq, k=2)
    # q's top-2 = {2, 1}: min(.15, .4) + min(.3, .3); with p's top-2 = {0, 1} they share only 1.
    assert float(bound) == pytest.approx(0.45, abs=1e-6)
    assert float(paper) == pytest.approx(0.30, abs=1e-6)
    # Temperature 2: both become sqrt(.) renormalised.
    p2, q2 = np.sqrt(P_HAND) / np.sqrt(P_HAND).sum(), np.sqrt(Q_HAND) / np.sqrt(Q_HAND).sum()
    got = float(acceptance_rate(jnp.asarray(lp), jnp.asarray(lq), temperature=2.0))
    assert got == pytest.approx(np.minimum(p2, q2).sum(), abs=1e-6)


def test_identical_distributions_accept_everything():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 50)) * 3)
    np.testing.assert_allclose(np.asarray(acceptance_rate(logits, logits + 7.0)), 1.0, atol=1e-6)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_random_distributions_against_numpy_and_ordered(k):
    rng = np.random.default_rng(k)
    v = 64
    base = rng.standard_normal((40, v)) * 2.5
    logits_p = base
    logits_q = base + rng.standard_normal((40, v)) * rng.uniform(0.05, 2.0, size=(40, 1))
    for temperature in (1.0, 0.7):
        p, q = softmax_np(logits_p, temperature), softmax_np(logits_q, temperature)
        exact = np.asarray(acceptance_rate(jnp.asarray(logits_p, jnp.float32),
                                           jnp.asarray(logits_q, jnp.float32), temperature))
        np.testing.assert_allclose(exact, alpha_exact_np(p, q), atol=2e-6)
        paper, bound = _estimators(np.log(p), np.log(q), k)
        np.testing.assert_allclose(bound, alpha_topk_bound_np(p, q, k), atol=2e-6)
        np.testing.assert_allclose(paper, alpha_paper_np(p, q, k), atol=2e-6)
        assert (paper <= bound + 1e-6).all() and (bound <= exact + 1e-6).all()
        if k == 1:
            assert (paper < exact - 1e-3).any()  # the bounds are not trivially tight here


def test_paper_estimator_with_different_k_per_side():
    # p stores 3 ids, q stores 2; the intersection is {1}: min(.3, .3).
    lp, lq = np.log(P_HAND), np.log(Q_HAND)
    p_ids, p_lp = _topk(lp, 3)   # {0, 1, 2}
    q_ids, q_lp = _topk(lq, 2)   # {2, 1}
    got = acceptance_rate_paper(*map(jnp.asarray, (p_ids, p_lp, q_ids, q_lp)))
    assert float(got) == pytest.approx(0.15 + 0.30, abs=1e-6)


def test_tail_statistic_hand_computed():
    # bin_tokens 10, 3 bins; bin 2 is open-ended.
    alpha = np.array([0.5, 0.1, 0.4, 0.2, 0.3,      # bin 0 (positions 1..9)
                      0.9, 0.7,                      # bin 1: too few
                      0.6, 0.8, 0.95, 0.0])          # bin 2 (positions >= 20); last masked out
    positions = np.array([1, 2, 5, 9, 3, 10, 19, 20, 500, 10_000, 25])
    mask = np.ones(11, bool)
    mask[-1] = False
    got = np.asarray(tail_statistic(jnp.asarray(alpha), jnp.asarray(positions), bin_tokens=10,
                                    quantile=0.1, mask=jnp.asarray(mask), num_bins=3,
                                    min_count=3))
    # bin 0 sorted .1 .2 .3 .4 .5: h = 0.1 * 4 = 0.4 -> .1 + .4 * .1 = .14
    # bin 2 sorted .6 .8 .95: h = 0.2 -> .6 + .2 * .2 = .64
    np.testing.assert_allclose(got, [0.14, np.nan, 0.64], atol=1e-6)


def test_tail_statistic_matches_numpy_percentile_and_jits():
    rng = np.random.default_rng(3)
    alpha = 1 - rng.beta(0.3, 8.0, size=(16, 700))
    positions = np.broadcast_to(np.arange(700) * 60 + 1900, (16, 700)) + rng.integers(
        0, 100, size=(16, 1))  # bin 0 gets ~30 tokens: NaN
    mask = rng.random((16, 700)) < 0.8
    fn = jax.jit(lambda a, p, m: tail_statistic(a, p, mask=m))
    got = np.asarray(fn(jnp.asarray(alpha, jnp.float32), jnp.asarray(positions), jnp.asarray(mask)))
    want = tail_statistic_np(alpha.astype(np.float32), positions, mask)
    assert np.isnan(want).any() and not np.isnan(want).all()
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_beta_fit_recovers_parameters_and_ks_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(5)
    a, b, cut = 6.0, 0.8, 0.999
    u = rng.beta(a, b, size=20_000)
    alpha = np.concatenate([u * cut, np.ones(3000)])   # a pile at 1 that must be dropped
    fit = fit_scaled_beta(alpha, cutoff=cut)
    assert fit.dropped == 3000 and fit.count == 20_000
    assert fit.a == pytest.approx(a, rel=0.05) and fit.b == pytest.approx(b, rel=0.05)
    want_ks = stats.kstest(u, stats.beta(fit.a, fit.b).cdf).statistic
    assert fit.ks == pytest.approx(want_ks, rel=1e-6, abs=1e-9)
    grid = np.array([0.2, 0.5, 0.9, 0.99])
    np.testing.assert_allclose(fit.cdf(grid), stats.beta(fit.a, fit.b).cdf(grid / cut),
                               rtol=1e-9, atol=1e-12)
    assert fit.quantile(0.05) == pytest.approx(stats.beta(fit.a, fit.b).ppf(0.05) * cut,
                                               rel=1e-9)


def test_beta_cdf_hand_values():
    # I_x(1, 1) = x; I_x(2, 1) = x^2; I_x(1, 3) = 1 - (1 - x)^3.
    for a, b, f in [(1, 1, lambda x: x), (2, 1, lambda x: x * x),
                    (1, 3, lambda x: 1 - (1 - x) ** 3)]:
        for x in (0.01, 0.3, 0.5, 0.77, 0.99):
            assert _betainc(a, b, x) == pytest.approx(f(x), rel=1e-12, abs=1e-14)
    assert math.isclose(_betainc(2.5, 2.5, 0.5), 0.5, rel_tol=1e-12)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="temperature"):
        acceptance_rate(jnp.zeros(4), jnp.zeros(4), temperature=0.0)
    with pytest.raises(ValueError, match="differ"):
        acceptance_rate(jnp.zeros(4), jnp.zeros(5))
    with pytest.raises(ValueError, match="one shape"):
        tail_statistic(jnp.zeros(4), jnp.zeros(5, jnp.int32))
    with pytest.raises(ValueError, match="at least 2 distinct"):
        fit_scaled_beta([1.0, 1.0, 0.5])
