"""Verifiers: ``reward(prompt_ids, response_ids, answer, **context) -> float``.

A reward function sees the prompt and response token ids (the response cut at its length, its
EOS included) and the prompt set's answer; ``context`` carries ``tokenizer`` (for text rewards)
and ``eos_ids``, and functions ignore what they do not use. Register your own with
:func:`register_reward` and name it in the config's ``reward``.
"""

from __future__ import annotations

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


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ImportError("the `math` reward needs math-verify: pip install math-verify") from None
    return math_verify


@register_reward("math")
def math_reward(prompt_ids, response_ids, answer, *, tokenizer=None, eos_ids=(),
                **context) -> float:
    """1.0 when the response's final (preferably ``\\boxed{}``) answer is mathematically equal to
    the reference, as judged by math-verify."""
    mv = _math_verify()
    ref = str(answer)
    gold = mv.parse(ref if "\\boxed" in ref or "$" in ref else f"\\boxed{{{ref}}}")
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {ref!r}")
    pred = mv.parse(response_text(response_ids, tokenizer, eos_ids))
    return float(bool(pred) and mv.verify(gold, pred))


def score_batch(reward_fn: RewardFn, prompts: Sequence[Sequence[int]],
                responses: Sequence[Sequence[int]], answers: Sequence[Any],
                **context) -> list[float]:
    """Rewards of aligned lists; a non-finite or non-numeric reward is an error naming the row."""
    import math

    out = []
    for i, (p, r, a) in enumerate(zip(prompts, responses, answers, strict=True)):
        value = reward_fn(p, r, a, **context)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"reward function returned {value!r} for row {i}; rewards must be "
                             "finite numbers")
        out.append(float(value))
    return out

