"""sparrow-jax: long-context RL of LLMs with sparse rollouts (paged top-k attention).

The public names of DESIGN section 4 are importable from here; each is loaded on first use so
that ``import sparrow_jax`` stays cheap and optional dependencies stay optional.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ModelConfig": "sparrow_jax.config",
    "ConfigError": "sparrow_jax.config",
    "Qwen3": "sparrow_jax.models.qwen3",
    "init_model": "sparrow_jax.models.qwen3",
    "LoRAConfig": "sparrow_jax.models.lora",
    "attach_lora": "sparrow_jax.models.lora",
    "head_outputs": "sparrow_jax.models.lm_head",
    "load_qwen3": "sparrow_jax.models.hf_io",
    "save_qwen3": "sparrow_jax.models.hf_io",
    "sparse_decode": "sparrow_jax.attention.sparse",
    "acceptance_rate": "sparrow_jax.mismatch",
    "tail_statistic": "sparrow_jax.mismatch",
    "BudgetSchedule": "sparrow_jax.schedule",
    "rollout_cost_dense": "sparrow_jax.schedule",
    "rollout_cost_sparse": "sparrow_jax.schedule",
    "generate": "sparrow_jax.rollout.engine",
    "RolloutConfig": "sparrow_jax.rollout.engine",
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
