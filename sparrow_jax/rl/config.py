"""Frozen configs of the GRPO trainer; a YAML file maps key for key onto :class:`TrainConfig`.

Example (``configs/*.yaml``)::

    run_dir: runs/demo
    steps: 40
    model: {path: checkpoints/demo}
    data: {task: needle, prompts_per_step: 8}
    rollout: {samples_per_prompt: 8, max_new_tokens: 8, temperature: 1.0}
    optim: {learning_rate: 1.0e-4}
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from sparrow_jax.config import ConfigError, from_dict
from sparrow_jax.data import DataConfig
from sparrow_jax.rl.losses import LossConfig

DTYPES = ("auto", "float32", "bfloat16")


def _positive(obj, *names):
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Where the policy comes from: an HF folder (``path``), or an architecture initialised at
    random from ``seed`` (tests, benchmarks): a preset of ``configs/models`` or an inline
    ``hf_config`` (the keys of an HF config.json)."""

    path: str | None = None
    preset: str | None = None
    hf_config: dict[str, Any] | None = None
    seed: int = 0
    dtype: str = "auto"          # compute dtype (auto: bfloat16 on an accelerator, float32 on
    #                              CPU); master weights are always float32 (DESIGN 3.0)

    def __post_init__(self):
        given = [k for k in ("path", "preset", "hf_config") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ConfigError(f"model: give exactly one of `path` (HF folder), `preset` or "
                              f"`hf_config`, got {given or 'none'}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """Sampling for training rollouts. ``engine`` holds further keys of the rollout engine's
    ``RolloutConfig`` (page size, dense layers, ...), passed through unchanged."""

    samples_per_prompt: int = 8
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _positive(self, "max_new_tokens")
        if not isinstance(self.samples_per_prompt, int) or self.samples_per_prompt < 2:
            raise ConfigError("rollout.samples_per_prompt must be an int >= 2 (group advantages "
                              f"need a std), got {self.samples_per_prompt!r}")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature must be > 0 for training, got "
                              f"{self.temperature}")
        # DESIGN 3.4: truncation would bias the TIS ratios.
        if self.top_p != 1.0 or self.top_k != 0:
            raise ConfigError(
                f"training rollouts sample with temperature only (got top_p={self.top_p}, "
                f"top_k={self.top_k}): top-p/top-k truncation biases the importance ratios "
                "(DESIGN 3.4); use them for generation and evaluation only")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW on the float32 master weights (``nnx.Param``, never ``LoRAParam``)."""

    learning_rate: float = 1e-6
    weight_decay: float = 0.01
    warmup_steps: int = 0           # optimizer steps of linear warmup from 0
    max_grad_norm: float | None = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        if self.learning_rate <= 0:
            raise ConfigError(f"optim.learning_rate must be positive, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(f"optim.max_grad_norm must be positive or null, got "
                              f"{self.max_grad_norm}")


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """How one rollout batch becomes optimizer steps: ``epochs`` passes over it, each split into
    ``mini_batches`` optimizer steps, each accumulated over micro-batches of
    ``micro_batch_size`` rows (length-bucketed; this never changes the gradient)."""

    mini_batches: int = 1
    epochs: int = 1
    micro_batch_size: int = 8
    length_multiple: int = 64      # micro-batch lengths round up to this (bounds recompiles)
    chunk_size: int = 1024         # LM-head positions per chunk
    fuse_recompute: bool = True    # the first mini-batch's forward is its rows' dense recompute
    remat: bool = True             # rematerialise layers in the update's backward (DESIGN 3.0)
    loss: LossConfig = LossConfig()

    def __post_init__(self):
        _positive(self, "mini_batches", "epochs", "micro_batch_size", "length_multiple",
                  "chunk_size")


@dataclasses.dataclass(frozen=True)
class MismatchSettings:
    """Tail statistic of DESIGN 3.4 (bins of the step's ``lengths``)."""

    bin_tokens: int = 2000
    num_bins: int = 20
    min_count: int = 100
    top_k: int = 20                # dense top-k for the ``paper`` estimator

    def __post_init__(self):
        _positive(self, "bin_tokens", "num_bins", "top_k")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    run_dir: str = "runs/default"
    steps: int = 100
    seed: int = 0
    model: ModelSpec = ModelSpec(preset="tiny")
    data: DataConfig = DataConfig()
    reward: str = "needle"                      # a name in sparrow_jax.rl.rewards' registry
    reward_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    rollout: RolloutSettings = RolloutSettings()
    schedule: dict[str, Any] | None = None      # budget schedule (see trainer.build_schedule)
    update: UpdateConfig = UpdateConfig()
    optim: OptimConfig = OptimConfig()
    mismatch: MismatchSettings = MismatchSettings()
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    eval_every: int = 0                         # 0: no evaluation
    eval_samples: int = 4                       # k of mean@k
    tensorboard: bool = True
    progress: bool = True

    def __post_init__(self):
        _positive(self, "steps", "checkpoint_every", "keep_checkpoints", "eval_samples")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every must be >= 0, got {self.eval_every}")
        rows = self.data.prompts_per_step * self.rollout.samples_per_prompt
        if rows % self.update.mini_batches:
            raise ConfigError(
                f"the rollout batch ({self.data.prompts_per_step} prompts x "
                f"{self.rollout.samples_per_prompt} samples = {rows} rows) does not split into "
                f"update.mini_batches={self.update.mini_batches} equal mini-batches")


def load_train_config(path: str | Path) -> TrainConfig:
    """Reads a YAML file into a :class:`TrainConfig` (unknown keys are an error)."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    return from_dict(TrainConfig, data)
