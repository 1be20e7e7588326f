"""Held-out evaluation: pass@k (the unbiased estimator) and Mean@k against hand-computed values,
and the trainer's evaluation over sets and samplers on hand-built responses."""

import numpy as np
import pytest

from sparrow_jax.data import PromptSet
from sparrow_jax.rl.evaluation import evaluate_held_out, mean_at_k, mean_pass_at_k, pass_at_k


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 1 / 4),          # 1 - C(3,1)/C(4,1)
    (4, 1, 2, 1 / 2),          # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 2, 2, 5 / 6),          # 1 - C(2,2)/C(4,2) = 1 - 1/6
    (4, 3, 2, 1.0),            # one wrong sample cannot fill k = 2: C(1,2) = 0
    (4, 0, 4, 0.0),
    (4, 1, 4, 1.0),
    (16, 4, 8, 25 / 26),       # 1 - C(12,8)/C(16,8) = 1 - 495/12870 = 1 - 1/26
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_and_mean_at_k_refuse_bad_input():
    for n, c, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)
    with pytest.raises(ValueError, match=r"\[problems, k\]"):
        mean_at_k(np.zeros(4))


def test_mean_at_k_and_pass_at_k_over_problems():
    rewards = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], float)
    assert mean_at_k(rewards) == 3 / 12
    assert mean_pass_at_k(rewards, 1) == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    assert mean_pass_at_k(rewards, 2) == pytest.approx((1 / 2 + 5 / 6 + 0) / 3)
    # a partial reward is not a correct sample
    assert mean_pass_at_k(np.array([[0.5, 0.5]]), 2) == 0.0


def _dense(prompts, k):
    """Prompt [x]: x - 1 of its k responses right (first token x), response j is j + 1 long."""
    assert len(prompts) <= 2              # the batch size
    return [[p[0] if j < p[0] - 1 else 0] * (j + 1) for p in prompts for j in range(k)]


def _sparse(prompts, k):
    return [[0] for _ in prompts for _ in range(k)]


def _score(prompts, responses, answers):
    rewards = [float(r[0] == a) for r, a in zip(responses, answers)]
    no_answer = [r[0] == 0 for r in responses]
    return rewards, {"reward_timeouts": float(sum(len(r) == 4 and r[0] == 0
                                                  for r in responses)),
                     "reward_no_answer_frac": sum(no_answer) / len(responses)}


def test_evaluate_held_out_by_hand():
    sets = {"a": PromptSet([[1], [2], [3]], [1, 2, 3]), "b": PromptSet([[3]], [3])}
    got = evaluate_held_out({"sparse": _sparse, "dense": _dense}, sets, _score, 4,
                            batch_size=2, pass_ks=[1, 2, 4])
    # set a, dense: rewards [0,0,0,0], [1,0,0,0], [1,1,0,0]
    assert got["eval_dense_a_mean_at_4"] == 3 / 12
    assert got["eval_dense_a_pass_at_1"] == pytest.approx((0 + 1 / 4 + 2 / 4) / 3)
    assert got["eval_dense_a_pass_at_2"] == pytest.approx((0 + 1 / 2 + 5 / 6) / 3)
    assert got["eval_dense_a_pass_at_4"] == pytest.approx(2 / 3)
    assert got["eval_dense_a_response_length_mean"] == 2.5
    # two batches (2 prompts, then 1): the count adds up, the fraction is the set's
    assert got["eval_dense_a_reward_timeouts"] == 3.0
    assert got["eval_dense_a_reward_no_answer_frac"] == (4 + 3 + 2) / 12
    # set b, dense: [1,1,0,0]
    assert got["eval_dense_b_mean_at_4"] == 0.5 and got["eval_dense_b_pass_at_4"] == 1.0
    assert got["eval_dense_mean_at_4"] == (0.25 + 0.5) / 2      # sets weigh the same
    assert got["eval_sparse_mean_at_4"] == 0.0 and got["eval_sparse_b_pass_at_4"] == 0.0
    assert len(got) == 2 * (2 * 7 + 1)


def test_evaluate_held_out_defaults_and_errors():
    sets = {"b": PromptSet([[3]], [3])}
    got = evaluate_held_out({"dense": _dense}, sets, _score, 4, batch_size=2)
    assert {n for n in got if "pass_at" in n} == {"eval_dense_b_pass_at_1",
                                                  "eval_dense_b_pass_at_4"}
    with pytest.raises(ValueError, match=r"pass_ks \[8\] outside 1..k=4"):
        evaluate_held_out({"dense": _dense}, sets, _score, 4, batch_size=2, pass_ks=[8])
    with pytest.raises(ValueError, match="sample returned 1 responses for 1 prompts x k=4"):
        evaluate_held_out({"dense": lambda p, k: [[3]]}, sets, _score, 4, batch_size=2)
