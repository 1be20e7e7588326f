"""Rewards: registry, exact match, math-verify, the synthetic verifiers, bad values."""

import sys

import pytest

from sparrow_jax.data import EOS
from sparrow_jax.rl.rewards import get_reward, register_reward, reward_names, score_batch


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def _ids(text):
    return [ord(c) for c in text]


def test_registry_builtins_and_user_functions():
    assert {"needle", "reverse", "exact_match", "math"} <= set(reward_names())

    @register_reward("test_length")
    def length_reward(prompt_ids, response_ids, answer, **context):
        return len(response_ids) / 10

    assert get_reward("test_length")([1], [1, 2, 3], None) == 0.3
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_length", lambda *a, **k: 0.0)
    with pytest.raises(KeyError, match="unknown reward 'nope'"):
        get_reward("nope")


def test_needle_partial_credit():
    fn = get_reward("needle")
    assert fn([1], [5, 6, 9, EOS], [5, 6, 7, EOS]) == pytest.approx(2 / 3)


def test_exact_match_tokens_and_text():
    fn = get_reward("exact_match")
    assert fn([], [4, 5, EOS], [4, 5, EOS], eos_ids=(EOS,)) == 1.0
    assert fn([], [4, 5], [4, 5, EOS]) == 1.0
    assert fn([], [4, 6, EOS], [4, 5, EOS]) == 0.0
    tok = _CharTokenizer()
    assert fn([], _ids(" 42 ") + [7], "42", tokenizer=tok, eos_ids=(7,)) == 1.0
    assert fn([], _ids("41"), "42", tokenizer=tok) == 0.0
    with pytest.raises(ValueError, match="tokenizer"):
        fn([], _ids("42"), "42")


def test_math_verify_boxed():
    pytest.importorskip("math_verify")
    fn, tok = get_reward("math"), _CharTokenizer()
    assert fn([], _ids("so the answer is \\boxed{\\frac{1}{2}}"), "0.5", tokenizer=tok) == 1.0
    assert fn([], _ids("thus \\boxed{3}"), "4", tokenizer=tok) == 0.0
    assert fn([], _ids("I do not know"), "4", tokenizer=tok) == 0.0


def test_math_without_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match="pip install math-verify"):
        get_reward("math")([], _ids("\\boxed{1}"), "1", tokenizer=_CharTokenizer())


def test_score_batch_rejects_non_finite():
    assert score_batch(lambda p, r, a: float(a), [[1], [2]], [[3], [4]], [1, 0]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="row 1"):
        score_batch(lambda p, r, a: a, [[1], [2]], [[3], [4]], [1.0, float("nan")])
