"""Sampling: truncation never emits excluded tokens; frequencies match the softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.rollout.sampling import SamplingParams, sample


def _np_softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _draw(logits, params, n, seed=0):
    keys = jax.random.split(jax.random.key(seed), n)
    batch = jnp.broadcast_to(logits, (1, logits.shape[-1]))
    fn = jax.jit(jax.vmap(lambda k: sample(k, batch, params)))
    tokens, logps = fn(keys)
    return np.asarray(tokens[:, 0]), np.asarray(logps[:, 0])


def test_temperature_one_frequencies_match_softmax():
    logits = jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40_000
    tokens, logps = _draw(logits, SamplingParams(temperature=1.0), n)
    p = _np_softmax(logits)
    freq = np.bincount(tokens, minlength=6) / n
    # 5 standard errors of a binomial proportion
    assert np.all(np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / n) + 1e-9)
    np.testing.assert_allclose(logps, np.log(p)[tokens], rtol=1e-5)


def test_temperature_scales_distribution_and_recorded_logprob():
    logits = jnp.array([1.0, 0.0, -1.0])
    n, t = 30_000, 0.5
    tokens, logps = _draw(logits, SamplingParams(temperature=t), n)
    p = _np_softmax(np.array([1.0, 0.0, -1.0]) / t)
    freq = np.bincount(tokens, minlength=3) / n
    assert np.all(np.abs(freq - p) < 5 * np.sqrt(p * (1 - p) / n))
    np.testing.assert_allclose(logps, np.log(p)[tokens], rtol=1e-5)


@pytest.mark.parametrize("top_k,top_p,allowed", [
    (2, 1.0, {0, 1}),
    (0, 0.6, {0, 1}),      # p = [.5, .3, .1, ...]: 0.5 < 0.6, so token 1 crosses 0.6 and is kept
    (0, 0.45, {0}),        # token 0 alone already holds 0.5 >= 0.45
    (3, 0.95, {0, 1, 2}),
])
def test_truncation_never_emits_excluded_tokens(top_k, top_p, allowed):
    p = np.array([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = jnp.asarray(np.log(p), jnp.float32)
    tokens, logps = _draw(logits, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p), 5000)
    assert set(np.unique(tokens)) == allowed
    # the recorded log-prob is the untruncated one
    np.testing.assert_allclose(logps, np.log(p)[tokens], rtol=1e-5)
    # within the kept set, the proportions follow the renormalised distribution
    kept = sorted(allowed)
    q = p[kept] / p[kept].sum()
    freq = np.array([(tokens == k).mean() for k in kept])
    assert np.all(np.abs(freq - q) < 5 * np.sqrt(q * (1 - q) / 5000) + 1e-9)


def test_greedy_is_argmax():
    logits = jax.random.normal(jax.random.key(1), (8, 50))
    tokens, logps = sample(jax.random.key(0), logits, SamplingParams(temperature=0.0))
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), -1))
    ref = np.log(_np_softmax(logits))[np.arange(8), tokens]
    np.testing.assert_allclose(logps, ref, rtol=1e-5)


def test_bad_params_rejected():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
