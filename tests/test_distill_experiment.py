"""scripts/distill_experiment.py's statistics (docs/distill.md) against hand-worked values: the
paired reward difference and its standard error, the bootstrap error of the tail gain, the
moving average over the steps that have a value."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("distill_experiment")


def test_reward_check_hand_worked(script):
    # differences 0, 0.25, 0.25, -0.25: mean 0.0625, sample std sqrt(0.171875 / 3), n 4
    got = script.reward_check({"reward_per_prompt": [0.5, 0.75, 1.0, 0.25]},
                              {"reward_per_prompt": [0.5, 0.5, 0.75, 0.5]})
    assert got["reward_diff"] == pytest.approx(0.0625)
    assert got["reward_diff_se"] == pytest.approx(np.sqrt(0.171875 / 3) / 2)
    assert got["within_2se"]
    worse = script.reward_check({"reward_per_prompt": [0.0, 0.25, 0.0, 0.25]},
                                {"reward_per_prompt": [0.5, 0.75, 0.5, 0.5]})
    assert worse["reward_diff"] == pytest.approx(-0.4375) and not worse["within_2se"]


def test_bootstrap_gain_se(script):
    rng = np.random.default_rng(0)
    alpha = rng.uniform(0.5, 1.0, 400)
    prompts = np.repeat(np.arange(40), 10)
    # A constant shift moves every resample's 5th percentile by exactly that much.
    assert script.bootstrap_gain_se(alpha, alpha - 0.1, prompts, 0) < 1e-9
    # A gain carried by a few prompts varies with which prompts a resample draws.
    lifted = np.where(prompts < 4, 0.0, alpha)
    assert script.bootstrap_gain_se(alpha, lifted, prompts, 0) > 0.01


def test_smooth_skips_missing_steps(script):
    steps, values = script._smooth([1.0, None, 3.0, None, 5.0, 7.0], 2)
    np.testing.assert_array_equal(steps, [2, 4, 5])
    np.testing.assert_allclose(values, [2.0, 4.0, 6.0])
    steps, values = script._smooth([1.0, None, 3.0], 1)
    np.testing.assert_array_equal(steps, [0, 2])
    np.testing.assert_allclose(values, [1.0, 3.0])
