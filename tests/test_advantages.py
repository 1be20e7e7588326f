"""Group advantages against hand-worked values and a float64 NumPy reference."""

import numpy as np
import pytest

from sparrow_jax.rl.advantages import group_advantages


def test_hand_worked_groups():
    # [1,0,0,1]: mean .5, std(ddof=1) = sqrt(1/3) -> +-0.5*sqrt(3) = +-0.8660254
    # [1,1,1,1]: zero std -> 0
    # [.2,.5,.8,.5]: mean .5, std = sqrt(.18/3) = sqrt(.06) -> +-0.3/0.2449490 = +-1.2247449
    r = [1, 0, 0, 1, 1, 1, 1, 1, 0.2, 0.5, 0.8, 0.5]
    s, t = 0.8660254 * (1 - 1e-6 / 0.5773503), 1.2247449 * (1 - 1e-6 / 0.2449490)
    expected = [s, -s, -s, s, 0, 0, 0, 0, -t, 0, t, 0]
    np.testing.assert_allclose(np.asarray(group_advantages(np.array(r), 4)), expected,
                               rtol=1e-5, atol=1e-7)


def test_matches_numpy_ddof1():
    rng = np.random.default_rng(0)
    r = rng.uniform(0, 1, 24)
    g = r.reshape(3, 8)
    ref = ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-6)).ravel()
    np.testing.assert_allclose(np.asarray(group_advantages(r, 8)), ref, rtol=1e-5, atol=1e-6)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(np.zeros(6), 4)
    with pytest.raises(ValueError, match="ddof"):
        group_advantages(np.zeros(6), 1)
