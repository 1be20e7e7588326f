"""The benchmark length mixes (sparrow_jax/rollout/length_mix.py) against their distributions,
computed here in float64 from the error function."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sparrow_jax.rollout.length_mix import length_mix

ROWS = 40_000


def _lognormal_cdf(x, median, sigma=1.0):
    return 0.5 * math.erfc(-(math.log(x) - math.log(median)) / (sigma * math.sqrt(2)))


@pytest.mark.parametrize("cap", [512, 8192])
def test_lognormal_mix_statistics(cap):
    lengths = length_mix("lognormal", ROWS, cap, seed=3)
    assert lengths.dtype == np.int32 and lengths.shape == (ROWS,)
    assert lengths.min() >= 1 and lengths.max() == cap
    # P(L <= x) for x below the cap: the 90% not forced, each ceil(X) <= x iff X <= x.
    for x in (cap // 20, cap // 5, cap // 2, cap - 1):
        want = 0.9 * _lognormal_cdf(x, cap / 5)
        assert abs(np.mean(lengths <= x) - want) < 0.01, (x, np.mean(lengths <= x), want)
    # At the cap: the forced 10% plus the clipped tail of the rest.
    want = 0.1 + 0.9 * (1 - _lognormal_cdf(cap, cap / 5))
    assert abs(np.mean(lengths == cap) - want) < 0.01
    assert np.sum(lengths == cap) >= round(0.1 * ROWS)


def test_uniform_mix_statistics():
    cap = 1000
    lengths = length_mix("uniform", ROWS, cap, seed=3)
    assert lengths.min() >= 1 and lengths.max() <= cap
    assert abs(lengths.mean() - (cap + 1) / 2) < 0.01 * cap
    for x in (100, 500, 900):
        assert abs(np.mean(lengths <= x) - x / cap) < 0.01


def test_seeded_and_checked():
    a = length_mix("lognormal", 100, 256, seed=1)
    np.testing.assert_array_equal(a, length_mix("lognormal", 100, 256, seed=1))
    assert not np.array_equal(a, length_mix("lognormal", 100, 256, seed=2))
    with pytest.raises(ValueError, match="kind='normal'"):
        length_mix("normal", 10, 100)
    with pytest.raises(ValueError, match="cap=0"):
        length_mix("uniform", 10, 0)
