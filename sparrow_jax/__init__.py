"""sparrow-jax: long-context RL of LLMs with sparse rollouts (paged top-k attention).

The public names (the README's "Using it"; docs/design.md) are importable from here; each is
loaded on first use so that ``import sparrow_jax`` stays cheap and optional dependencies stay
optional.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    # model, checkpoints, tokenizer
    "ModelConfig": "sparrow_jax.config",
    "ConfigError": "sparrow_jax.config",
    "Qwen3": "sparrow_jax.models.qwen3",
    "init_model": "sparrow_jax.models.qwen3",
    "LoRAConfig": "sparrow_jax.models.lora",
    "attach_lora": "sparrow_jax.models.lora",
    "head_outputs": "sparrow_jax.models.lm_head",
    "load_qwen3": "sparrow_jax.models.hf_io",
    "save_qwen3": "sparrow_jax.models.hf_io",
    "load_generation_config": "sparrow_jax.models.hf_io",
    "Tokenizer": "sparrow_jax.models.tokenizer",
    "load_tokenizer": "sparrow_jax.models.tokenizer",
    # sparse attention semantics
    "sparse_decode": "sparrow_jax.attention.sparse",
    "teacher_forced_sparse_attention": "sparrow_jax.attention.teacher_forced",
    "make_teacher_forced_attend": "sparrow_jax.attention.teacher_forced",
    "TeacherForcedBudgets": "sparrow_jax.attention.teacher_forced",
    # mismatch, schedules, cost model
    "acceptance_rate": "sparrow_jax.mismatch",
    "acceptance_rate_topk_bound": "sparrow_jax.mismatch",
    "acceptance_rate_paper": "sparrow_jax.mismatch",
    "tail_statistic": "sparrow_jax.mismatch",
    "fit_scaled_beta": "sparrow_jax.mismatch",
    "BudgetSchedule": "sparrow_jax.schedule",
    "search_schedule": "sparrow_jax.schedule",
    "rollout_cost_dense": "sparrow_jax.schedule",
    "rollout_cost_sparse": "sparrow_jax.schedule",
    "DecodeCost": "sparrow_jax.cost_model",
    "sparse_logits": "sparrow_jax.sparse_actor",
    "sparse_logprobs": "sparrow_jax.sparse_actor",
    "CalibrateConfig": "sparrow_jax.calibrate",
    "load_calibrate_config": "sparrow_jax.calibrate",
    "load_step_times": "sparrow_jax.step_times",
    "measured_speedup": "sparrow_jax.step_times",
    # rollout
    "generate": "sparrow_jax.rollout.engine",
    "RolloutConfig": "sparrow_jax.rollout.engine",
    "Rollout": "sparrow_jax.rollout.types",
    "FinishReason": "sparrow_jax.rollout.types",
    "SamplingParams": "sparrow_jax.rollout.sampling",
    # GRPO
    "TrainConfig": "sparrow_jax.rl.config",
    "load_train_config": "sparrow_jax.rl.config",
    "train": "sparrow_jax.rl.trainer",
    "LossConfig": "sparrow_jax.rl.losses",
    "grpo_loss": "sparrow_jax.rl.losses",
    "group_advantages": "sparrow_jax.rl.advantages",
    "register_reward": "sparrow_jax.rl.rewards",
    "NeedleTask": "sparrow_jax.data",
    "NeedleConfig": "sparrow_jax.data",
    "plot_run": "sparrow_jax.plot",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sparrow_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
