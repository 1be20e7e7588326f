"""The trainer's held-out evaluation of the math recipe (``data.eval_sets``): each set sampled k
times per problem at the rollout's schedule and dense, scored by the math reward, reported as
Mean@k and pass@k; checked against a hand-worked case (the first of two samples right)."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np

from sparrow_jax.config import from_dict
from sparrow_jax.rl.config import TrainConfig

FIX = Path(__file__).parent / "fixtures"


def test_eval_sets_are_scored_per_set_sparse_and_dense(tmp_path):
    from sparrow_jax.rl.trainer import Trainer

    config = from_dict(TrainConfig, {
        "run_dir": str(tmp_path / "run"), "steps": 1, "reward": "math",
        "reward_options": {"timeout_s": 20.0},
        "model": {"path": str(FIX / "hf" / "chat")},
        "data": {"task": None, "recipe": "aime24", "path": str(FIX / "math" / "aime_2024"),
                 "eval_sets": {"amc": str(FIX / "math" / "aimo_validation_amc"),
                               "gsm8k": str(FIX / "math" / "gsm8k")},
                 "prompts_per_step": 2},
        "schedule": {"kind": "fixed", "pages": 4},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 16},
        "eval_every": 1, "eval_samples": 2, "tensorboard": False, "progress": False})
    calls = []
    trainer = None

    def rollout_fn(model, prompts, key, n, schedule="the rollout's", **extra):
        # sample 0 of each prompt boxes the gold answer, sample 1 a wrong one
        calls.append(schedule)
        answers = {tuple(p): a for s in trainer.eval_sets.values()
                   for p, a in zip(s.prompts, s.answers)}
        tok = trainer.reward_context["tokenizer"]
        rows = [p + tok.encode(f"so \\boxed{{{answers[tuple(p)] if j == 0 else 'x+1'}}}")
                for p in prompts for j in range(n)]
        width = max(map(len, rows))
        return types.SimpleNamespace(
            tokens=np.asarray([r + [0] * (width - len(r)) for r in rows]),
            prompt_lengths=np.asarray([len(p) for p in prompts for _ in range(n)]),
            response_lengths=np.asarray([len(r) - len(p) for r, p in
                                         zip(rows, [p for p in prompts for _ in range(n)])]))

    trainer = Trainer(config, rollout_fn=rollout_fn)
    metrics = trainer.evaluate(0)
    for mode in ("sparse", "dense"):
        for name in ("amc", "gsm8k"):
            prefix = f"eval_{mode}_{name}_"
            assert metrics[prefix + "mean_at_2"] == 0.5, metrics
            assert metrics[prefix + "pass_at_1"] == 0.5 and metrics[prefix + "pass_at_2"] == 1.0
            assert metrics[prefix + "reward_timeouts"] == 0
        assert metrics[f"eval_{mode}_mean_at_2"] == 0.5
    # two sets, one batch each, per mode: the schedule's rollouts, then dense ones
    assert calls == ["the rollout's"] * 2 + [None] * 2
