"""One training step's metrics line, from its rollout, the dense recompute, rewards, the update's
metrics and timings (docs/design.md, sections 5 and 7).

The acceptance rates come from what the step already holds: the rollout's recorded top-k of the
sparse actor and the recompute's dense log-probs there and its own top-k, so no extra forward
runs. :func:`token_alphas` and :func:`response_positions` give them per response token, for the
metrics here and for the closed-loop schedule (:mod:`sparrow_jax.rl.closed_loop`).
"""

from __future__ import annotations

import contextlib
import time

import jax.numpy as jnp
import numpy as np

from sparrow_jax.mismatch import (acceptance_rate_paper, acceptance_rate_topk_bound,
                                  tail_statistic)
from sparrow_jax.rl.recompute import DenseStats
from sparrow_jax.rollout.types import Rollout


def response_positions(rollout: Rollout) -> np.ndarray:
    """``[S, R]``: the step ``lengths`` at which each response slot was sampled."""
    r = rollout.response_mask.shape[1]
    # Response token j is sampled at the step whose query sits at index p + j - 1, so that
    # step's ``lengths`` (docs/design.md, section 2) is p + j.
    return np.asarray(rollout.prompt_lengths)[:, None] + np.arange(r)[None, :]


def token_alphas(rollout: Rollout, dense: DenseStats) -> dict[str, np.ndarray]:
    """Per response slot ``[S, R]``, alpha by the ``topk_bound`` and ``paper`` estimators."""
    return {
        "topk_bound": np.asarray(acceptance_rate_topk_bound(dense.actor_topk_logprobs,
                                                            rollout.topk_logprobs)),
        "paper": np.asarray(acceptance_rate_paper(dense.topk_ids, dense.topk_logprobs,
                                                  rollout.topk_ids, rollout.topk_logprobs)),
    }


def mismatch_metrics(rollout: Rollout, dense: DenseStats, bin_tokens: int, num_bins: int,
                     min_count: int, page_size: int) -> dict[str, float]:
    """Acceptance rates (``topk_bound`` and ``paper`` estimators, docs/design.md, section 5),
    their mean, 5th percentile over all response tokens and tail statistic per length bin, and
    the fraction of decode steps that ran sparse (``ceil(lengths / P) > budget``)."""
    mask = np.asarray(rollout.response_mask)
    lengths = response_positions(rollout)
    out = {}
    for name, a in token_alphas(rollout, dense).items():
        out[f"alpha_{name}_mean"] = float(a[mask].mean())
        out[f"alpha_{name}_p5"] = float(np.percentile(a[mask], 5))
        tail = np.asarray(tail_statistic(jnp.asarray(a), jnp.asarray(lengths),
                                         bin_tokens=bin_tokens, quantile=0.05,
                                         mask=jnp.asarray(mask), num_bins=num_bins,
                                         min_count=min_count))
        for i, v in enumerate(tail):
            if np.isfinite(v):
                out[f"alpha_{name}_p5_bin{i:02d}"] = float(v)
    budget = np.asarray(rollout.budget_pages)
    pages = -(-lengths // page_size)
    sparse = (budget > 0) & (pages > budget)
    out["sparse_step_fraction"] = float(sparse[mask].mean())
    return out


def step_metrics(cfg, rollout: Rollout, dense: DenseStats, rewards, update_metrics,
                 seconds: dict[str, float]) -> dict[str, float]:
    """The metrics line of one step (``cfg`` a :class:`~sparrow_jax.rl.config.TrainConfig`):
    rewards, lengths, entropy, mismatch, update, timings."""
    mask = np.asarray(rollout.response_mask)
    lengths = np.asarray(rollout.response_lengths)
    return {
        "reward_mean": float(np.mean(rewards)), "reward_std": float(np.std(rewards)),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "entropy": float(dense.entropy[mask].mean()),
        **mismatch_metrics(rollout, dense, cfg.mismatch.bin_tokens, cfg.mismatch.num_bins,
                           cfg.mismatch.min_count, cfg.rollout.engine.page_size),
        **update_metrics,
        "tokens_per_s": float(lengths.sum() / max(seconds["rollout"], 1e-9)),
        **{f"time_{name}": t for name, t in seconds.items()},
    }


class Timer:
    """``with timer("rollout"): ...`` adds the block's wall time to ``seconds["rollout"]``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
