"""The math reward of the paper's recipe against hand-worked cases (the last of several boxes,
nested braces, fractions, sets, wrong and missing answers, text after </think>), on a worker
thread, and batch scoring in the verifier pool: an answer built to hang the verifier scores 0
at the limit while the rest of its batch is scored. One pool for the module (its workers' start
is the cost here)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sparrow_jax.config import ConfigError
from sparrow_jax.rl import math_reward
from sparrow_jax.rl.math_reward import answer_region, judge, last_boxed
from sparrow_jax.rl.rewards import (MathOptions, get_reward, judge_texts,
                                    score_batch_with_metrics)
from sparrow_jax.rl.verifier_pool import PoolConfig, VerifierPool

pytest.importorskip("math_verify")

# 9^(9^9) has ~370 million digits: sympy grinds on it far beyond any limit.
HANG = "so the answer is \\boxed{9^{9^{9}}}"

# (response, gold, reward): each worked out by hand.
CASES = [
    ("first \\boxed{2}, no: \\boxed{\\frac{1}{2}}", "0.5", 1.0),        # the last box counts
    ("\\boxed{0.5} hmm, then \\boxed{3}", "0.5", 0.0),                 # ... even when wrong
    ("\\boxed{\\frac{\\sqrt{3}}{2}} done", "\\frac{\\sqrt3}{2}", 1.0),  # nested braces
    ("thus \\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0),                   # \dfrac = \frac
    ("x is in \\boxed{\\{2, -2\\}}", "\\{-2, 2\\}", 1.0),               # sets, any order
    ("x is in \\boxed{\\{2\\}}", "\\{-2, 2\\}", 0.0),                    # a missing member
    ("\\boxed{41}", "42", 0.0),                                         # wrong
    ("The answer is 42.", "42", 0.0),                                   # no box, no answer
    ("\\boxed{42} and then \\boxed{4", "42", 0.0),                      # last box cut off
    ("\\boxed{24}", "024", 1.0),                                        # AIME's padded gold
    ("\\boxed{42}", "$42$", 1.0),                                       # gold already in $
]


def test_last_boxed_matches_braces():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b}} c") == "\\frac{a}{b}"
    assert last_boxed("\\boxed{\\{1,2\\}} end") == "\\{1,2\\}"      # escaped braces are text
    assert last_boxed("\\boxed {x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed{1} \\boxed{{2}") is None            # the last never closes
    assert last_boxed("no box") is None


def test_answer_region_after_think():
    text = "<think>a</think>b</think>c"
    assert answer_region(text) == text
    assert answer_region(text, after_think=True) == "c"
    assert answer_region("<think>still thinking", after_think=True) is None


@pytest.mark.parametrize("response, gold, reward", CASES)
def test_hand_worked_cases(response, gold, reward):
    assert judge(response, gold)[0] == reward


def test_text_after_think():
    thought = "<think>maybe \\boxed{42}</think> I am not sure."
    assert judge(thought, "42") == (1.0, math_reward.CORRECT)            # whole response
    assert judge(thought, "42", after_think=True) == (0.0, math_reward.NO_ANSWER)
    answered = "<think>maybe \\boxed{41}</think> so \\boxed{42}"
    assert judge(answered, "42", after_think=True)[0] == 1.0
    assert judge("<think>\\boxed{42}", "42", after_think=True)[0] == 0.0   # never closed


def test_on_worker_threads():
    """math-verify's SIGALRM timeouts are off, so any thread may judge."""
    with ThreadPoolExecutor(3) as ex:
        got = list(ex.map(lambda c: judge(c[0], c[1])[0], CASES))
    assert got == [c[2] for c in CASES]
    assert threading.current_thread() is threading.main_thread()


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def _ids(text):
    return [ord(c) for c in text]


def test_registered_reward_decodes_and_checks_options():
    fn, tok = get_reward("math"), _CharTokenizer()
    eos = 7
    assert fn([], _ids(CASES[0][0]) + [eos], "0.5", tokenizer=tok, eos_ids=(eos,)) == 1.0
    thought = _ids("<think>\\boxed{42}</think>")
    assert fn([], thought, 42, tokenizer=tok) == 1.0             # the answer column's int
    assert fn([], thought, 42, tokenizer=tok, after_think=True) == 0.0
    with pytest.raises(ConfigError, match="reward_options.*'after_thinks'.*after_think"):
        fn([], thought, 42, tokenizer=tok, after_thinks=True)


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(math_reward.judge, PoolConfig(workers=2, timeout_s=1.5),
                      warm=math_reward.warm) as p:
        yield p


def test_batch_in_the_pool_matches_in_process(pool):
    texts, golds, rewards = zip(*CASES)
    got, metrics = judge_texts(texts, golds, MathOptions(), pool)
    assert got == list(rewards)
    assert metrics == {"reward_timeouts": 0.0, "reward_errors": 0.0,
                       "reward_no_answer_frac": 2 / len(CASES)}     # "42." and the cut box


def test_a_hanging_answer_scores_zero_at_the_limit(pool):
    texts = ["\\boxed{\\dfrac{1}{2}}", HANG, "\\boxed{7}", "\\boxed{\\{1,2\\}}"]
    golds = ["0.5", "5", "8", "\\{2,1\\}"]
    replaced = pool.replaced
    t0 = time.monotonic()
    got, metrics = judge_texts(texts, golds, MathOptions(), pool)
    elapsed = time.monotonic() - t0
    assert got == [1.0, 0.0, 0.0, 1.0] and metrics["reward_timeouts"] == 1.0
    # it waited for the limit and not much longer (the rest ran on the other worker)
    assert 1.5 <= elapsed < 1.5 + 3.0, elapsed
    assert pool.replaced == replaced + 1
    # the replacement serves the next batch
    assert judge_texts(["\\boxed{3}"] * 3, ["3"] * 3, MathOptions(), pool)[0] == [1.0] * 3


def test_score_batch_uses_the_batch_path(pool):
    tok = _CharTokenizer()
    responses = [_ids("\\boxed{1}"), _ids("\\boxed{5}"), _ids("none")]
    rewards, metrics = score_batch_with_metrics(get_reward("math"), [[0]] * 3, responses,
                                                ["1", "6", "1"], tokenizer=tok, pool=pool)
    assert rewards == [1.0, 0.0, 0.0]
    assert metrics == {"reward_timeouts": 0.0, "reward_errors": 0.0,
                       "reward_no_answer_frac": 1 / 3}
