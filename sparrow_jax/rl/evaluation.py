"""Held-out evaluation of the math recipe: Mean@k and pass@k per set, for each way of sampling.

Mean@k: the mean reward of k samples per problem, averaged over problems (the paper reports
Mean@16). pass@k: the unbiased estimator of "at least one of k samples is correct" from n >= k
samples of which c are correct, ``1 - C(n - c, k) / C(n, k)`` (a sample is correct when its
reward is 1), averaged over problems.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import numpy as np

from sparrow_jax.data import PromptSet

# sample(prompts, k) -> len(prompts) * k responses (token ids), the k of a prompt adjacent.
SampleFn = Callable[[list[list[int]], int], list[list[int]]]
# score(prompts, responses, answers) -> (rewards, metrics), e.g. functools.partial(
# rewards.score_batch_with_metrics, reward_fn, **reward_context).
ScoreFn = Callable[[list, list, list], tuple[list[float], dict[str, float]]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with ``c`` correct of ``n`` samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_at_k(rewards: np.ndarray) -> float:
    """Mean@k of a ``[problems, k]`` reward array."""
    rewards = np.asarray(rewards, np.float64)
    if rewards.ndim != 2 or rewards.size == 0:
        raise ValueError(f"mean@k needs a non-empty [problems, k] array, got shape "
                         f"{rewards.shape}")
    return float(rewards.mean())


def mean_pass_at_k(rewards: np.ndarray, k: int) -> float:
    """pass@k averaged over the problems of a ``[problems, n]`` reward array."""
    rewards = np.asarray(rewards, np.float64)
    n = rewards.shape[1]
    return float(np.mean([pass_at_k(n, int(c), k) for c in (rewards == 1.0).sum(1)]))


def sample_and_score(sample: SampleFn, prompt_set: PromptSet, score: ScoreFn, k: int,
                     batch_size: int) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """-> (``[problems, k]`` rewards, ``[problems, k]`` response lengths, the scorer's metrics
    over the set) of k samples per problem. The scorer's metrics add up over batches (counts:
    ``reward_timeouts``), except ``*_frac`` ones, which are weighted by batch size."""
    rewards, lengths, totals = [], [], {}
    for start in range(0, len(prompt_set.prompts), batch_size):
        prompts = prompt_set.prompts[start:start + batch_size]
        answers = prompt_set.answers[start:start + batch_size]
        responses = sample(prompts, k)
        if len(responses) != len(prompts) * k:
            raise ValueError(f"sample returned {len(responses)} responses for {len(prompts)} "
                             f"prompts x k={k}")
        values, metrics = score([p for p in prompts for _ in range(k)], list(responses),
                                [a for a in answers for _ in range(k)])
        rewards += list(values)
        lengths += [len(r) for r in responses]
        for name, value in metrics.items():
            weight = len(responses) if name.endswith("_frac") else 1
            totals[name] = totals.get(name, 0.0) + value * weight
    merged = {name: v / len(rewards) if name.endswith("_frac") else v
              for name, v in totals.items()}
    return (np.asarray(rewards, np.float64).reshape(-1, k),
            np.asarray(lengths, np.float64).reshape(-1, k), merged)


def evaluate_held_out(samplers: Mapping[str, SampleFn], sets: Mapping[str, PromptSet],
                      score: ScoreFn, k: int, *, batch_size: int,
                      pass_ks: Sequence[int] | None = None) -> dict[str, float]:
    """The evaluation the trainer runs every ``eval_every`` steps: each held-out set sampled k
    times per problem by each sampler (``{"sparse": ..., "dense": ...}``: the rollout's budget
    schedule and dense attention) and scored by ``score``. Metrics, flat like the training
    ones, for sampler ``m`` and set ``s``:

    ``eval_{m}_{s}_mean_at_{k}``, ``eval_{m}_{s}_pass_at_{j}`` for j in ``pass_ks`` (default 1
    and k), ``eval_{m}_{s}_response_length_mean``, the scorer's metrics as
    ``eval_{m}_{s}_{name}`` (``reward_timeouts``, ...), and ``eval_{m}_mean_at_{k}``, the mean
    over sets (each set weighs the same, as in the paper's average)."""
    if k < 1 or not sets or not samplers:
        raise ValueError(f"evaluation needs k >= 1, a set and a sampler (k={k}, sets "
                         f"{list(sets)}, samplers {list(samplers)})")
    pass_ks = sorted({1, k}) if pass_ks is None else list(pass_ks)
    bad = [j for j in pass_ks if not 1 <= j <= k]
    if bad:
        raise ValueError(f"pass_ks {bad} outside 1..k={k}")
    out: dict[str, float] = {}
    for mode, sample in samplers.items():
        means = []
        for name, prompt_set in sets.items():
            if not prompt_set.prompts:
                raise ValueError(f"held-out set {name!r} is empty")
            rewards, lengths, metrics = sample_and_score(sample, prompt_set, score, k,
                                                         batch_size)
            prefix = f"eval_{mode}_{name}_"
            means.append(mean_at_k(rewards))
            out[f"{prefix}mean_at_{k}"] = means[-1]
            out.update({f"{prefix}pass_at_{j}": mean_pass_at_k(rewards, j) for j in pass_ks})
            out[f"{prefix}response_length_mean"] = float(lengths.mean())
            out.update({f"{prefix}{m}": v for m, v in metrics.items()})
        out[f"eval_{mode}_mean_at_{k}"] = float(np.mean(means))
    return out
