"""Verifiers: ``reward(prompt_ids, response_ids, answer, **context) -> float``.

A reward function sees the prompt and response token ids (the response cut at its length, its
EOS included) and the prompt set's answer; ``context`` carries ``tokenizer`` (for text rewards)
and ``eos_ids`` (and the config's ``reward_options``), and functions ignore what they do not
use. A reward may also have a ``batch(prompts, responses, answers, **context) -> (rewards,
metrics)`` method, which :func:`score_batch` then calls once per batch (the ``math`` reward
scores its batch in a pool of verifier processes). Register your own with
:func:`register_reward` and name it in the config's ``reward``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

from sparrow_jax.data import EOS, positional_credit


class RewardFn(Protocol):
    def __call__(self, prompt_ids: Sequence[int], response_ids: Sequence[int], answer: Any,
                 **context: Any) -> float: ...


_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str, fn: RewardFn | None = None):
    """``register_reward("mine", fn)`` or as a decorator ``@register_reward("mine")``."""
    def add(f):
        if name in _REGISTRY and _REGISTRY[name] is not f:
            raise ValueError(f"a reward named {name!r} is already registered")
        _REGISTRY[name] = f
        return f
    return add if fn is None else add(fn)


def get_reward(name: str) -> RewardFn:
    if name not in _REGISTRY:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def reward_names() -> list[str]:
    return sorted(_REGISTRY)


def _strip_eos(ids: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    ids = list(ids)
    while ids and ids[-1] in eos_ids:
        ids.pop()
    return ids


def response_text(response_ids: Sequence[int], tokenizer, eos_ids: Sequence[int] = ()) -> str:
    if tokenizer is None:
        raise ValueError("this reward compares text: pass the tokenizer in the reward context")
    return tokenizer.decode(_strip_eos(response_ids, eos_ids), skip_special_tokens=True)


@register_reward("needle")
def needle_reward(prompt_ids, response_ids, answer, **context) -> float:
    """Partial credit: the fraction of needle values reproduced in order (see
    :func:`sparrow_jax.data.positional_credit`)."""
    return positional_credit(response_ids, answer, eos=EOS)


register_reward("reverse", needle_reward)


@register_reward("exact_match")
def exact_match_reward(prompt_ids, response_ids, answer, *, tokenizer=None, eos_ids=(),
                       **context) -> float:
    """1.0 when the response equals the answer: token lists compare ids (trailing EOS
    ignored on both sides), strings compare decoded text with surrounding whitespace stripped."""
    if isinstance(answer, str):
        return float(response_text(response_ids, tokenizer, eos_ids).strip() == answer.strip())
    eos = tuple(eos_ids) or (EOS,)
    return float(_strip_eos(response_ids, eos) == _strip_eos(answer, eos))


@dataclasses.dataclass(frozen=True)
class MathOptions:
    """``reward_options`` of the ``math`` reward. after_think: read only the text after the
    last ``</think>`` (a response that never closes its thinking scores 0); workers, timeout_s,
    memory_mb: the verifier pool of batch scoring (:class:`~sparrow_jax.rl.verifier_pool.
    PoolConfig`): each answer gets ``timeout_s`` of wall clock, then scores 0 as a timeout."""

    after_think: bool = False
    workers: int = 4
    timeout_s: float = 10.0
    memory_mb: int | None = 8192

    def pool_config(self):
        from sparrow_jax.rl.verifier_pool import PoolConfig

        return PoolConfig(workers=self.workers, timeout_s=self.timeout_s,
                          memory_mb=self.memory_mb)


def math_options(options: dict[str, Any]) -> MathOptions:
    """``reward_options`` (the reward context less tokenizer and eos_ids) -> MathOptions; a
    misspelt key is an error naming it."""
    from sparrow_jax.config import from_dict

    return from_dict(MathOptions, options, where="reward_options")


def judge_texts(texts: Sequence[str], golds: Sequence[Any], options: MathOptions = MathOptions(),
                pool=None) -> tuple[list[float], dict[str, float]]:
    """Math rewards of decoded responses against gold answers, in the verifier pool (``pool``,
    else the shared one of ``options``), and the batch's verifier metrics:
    ``reward_timeouts`` and ``reward_errors`` (answers scored 0 because the verifier overran
    its limit or failed), ``reward_no_answer_frac`` (responses without a closed box)."""
    from sparrow_jax.rl import math_reward
    from sparrow_jax.rl.verifier_pool import OK, TIMEOUT, shared_pool

    if pool is None:
        pool = shared_pool(math_reward.judge, options.pool_config(), warm=math_reward.warm)
    out = pool.map([(t, str(g), options.after_think)
                    for t, g in zip(texts, golds, strict=True)])
    rewards = [value[0] if status == OK else 0.0 for status, value in out]
    n = max(len(out), 1)
    metrics = {
        "reward_timeouts": float(sum(s == TIMEOUT for s, _ in out)),
        "reward_errors": float(sum(s not in (OK, TIMEOUT) for s, _ in out)),
        "reward_no_answer_frac": sum(s == OK and v[1] == math_reward.NO_ANSWER
                                     for s, v in out) / n,
    }
    return rewards, metrics


class MathReward:
    """The ``math`` reward (:mod:`sparrow_jax.rl.math_reward`): 1.0 when the last ``\\boxed{}``
    of the response equals the gold answer by math-verify, else 0.0.

    Called for one response it judges in this process, without a time limit (math-verify's
    signal timeouts are off, so any thread may call it); :meth:`batch`, which
    :func:`score_batch` uses, judges a whole batch in the verifier pool under the limit."""

    def __call__(self, prompt_ids, response_ids, answer, *, tokenizer=None, eos_ids=(),
                 **options) -> float:
        from sparrow_jax.rl.math_reward import judge

        opts = math_options(options)
        return judge(response_text(response_ids, tokenizer, eos_ids), str(answer),
                     opts.after_think)[0]

    def batch(self, prompts, responses, answers, *, tokenizer=None, eos_ids=(), pool=None,
              **options) -> tuple[list[float], dict[str, float]]:
        texts = [response_text(r, tokenizer, eos_ids) for r in responses]
        return judge_texts(texts, answers, math_options(options), pool)


register_reward("math", MathReward())


def score_batch(reward_fn: RewardFn, prompts: Sequence[Sequence[int]],
                responses: Sequence[Sequence[int]], answers: Sequence[Any],
                **context) -> list[float]:
    """Rewards of aligned lists; a non-finite or non-numeric reward is an error naming the row."""
    return score_batch_with_metrics(reward_fn, prompts, responses, answers, **context)[0]


def score_batch_with_metrics(reward_fn: RewardFn, prompts: Sequence[Sequence[int]],
                             responses: Sequence[Sequence[int]], answers: Sequence[Any],
                             **context) -> tuple[list[float], dict[str, float]]:
    """:func:`score_batch` and the reward's own metrics of the batch (the ``math`` reward's
    timeouts, ...; empty for rewards scored one by one). A reward with a ``batch`` method
    scores the whole batch at once."""
    import math

    if not len(prompts) == len(responses) == len(answers):
        raise ValueError(f"score_batch: {len(prompts)} prompts, {len(responses)} responses and "
                         f"{len(answers)} answers; they must align")
    batch = getattr(reward_fn, "batch", None)
    if batch is not None:
        values, metrics = batch(prompts, responses, answers, **context)
    else:
        values = [reward_fn(p, r, a, **context) for p, r, a in zip(prompts, responses, answers)]
        metrics = {}
    out = []
    for i, value in enumerate(values):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"reward function returned {value!r} for row {i}; rewards must be "
                             "finite numbers")
        out.append(float(value))
    return out, metrics
