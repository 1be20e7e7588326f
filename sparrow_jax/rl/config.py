"""Frozen configs of the GRPO trainer; a YAML file maps key for key onto :class:`TrainConfig`.

Example (``configs/*.yaml``)::

    run_dir: runs/demo
    steps: 40
    model: {path: checkpoints/demo}
    data: {task: needle, prompts_per_step: 8}
    rollout: {samples_per_prompt: 8, max_new_tokens: 8, temperature: 1.0}
    optim: {learning_rate: 1.0e-4}
    distill: {enabled: true}    # optional: DistillSparse, the sparse actor's LoRA
    closed_loop: {enabled: true}   # optional, with a table schedule: its budgets follow alpha
    mesh: {data: 1, fsdp: -1, tensor: 1}   # optional: every device, parameters split (FSDP)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from sparrow_jax.config import ConfigError, from_dict, load_yaml_config, unknown_name
from sparrow_jax.data import DataConfig
from sparrow_jax.models.lora import LORA_TARGETS, LoRAConfig
from sparrow_jax.rl.losses import LossConfig
from sparrow_jax.rollout.engine import RolloutConfig
from sparrow_jax.sharding import MeshConfig

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
    #                              CPU); master weights are always float32

    def __post_init__(self):
        given = [k for k in ("path", "preset", "hf_config") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ConfigError(f"model: give exactly one of `path` (HF folder), `preset` or "
                              f"`hf_config`, got {given or 'none'}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")


# RolloutConfig fields the trainer sets from ``rollout.*`` itself; ``rollout.engine`` must leave
# them at their defaults.
_TRAINER_SET = ("n", "max_new_tokens", "temperature", "top_p", "top_k", "eos_ids", "progress")


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """Sampling for training rollouts. ``engine`` is the rollout engine's
    :class:`~sparrow_jax.rollout.engine.RolloutConfig` (page size, dense layers, pool, ...),
    checked when the config loads; the trainer fills in its samples, length, temperature and
    EOS ids from the fields here. ``eos_ids``: the tokens that end a response; None: the
    model's (config.json and generation_config.json); ``[]``: none (responses run to
    ``max_new_tokens``). ``refill_slots``: sample with continuous refill
    (:func:`~sparrow_jax.rollout.refill.generate_refill`: this many decode slots refilled as
    rows finish, pages allocated as rows grow; the same tokens per sample); None: static
    batches. ``refill_tail_slots``: with refill, the run's tail (nothing left to admit) narrows
    onto fewer slots, down to this many (``generate_refill``'s ``tail_slots``; the same tokens
    per sample); None: it keeps ``refill_slots``."""

    samples_per_prompt: int = 8
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_ids: tuple[int, ...] | None = None
    engine: RolloutConfig = RolloutConfig()
    refill_slots: int | None = None
    refill_tail_slots: int | None = None

    def __post_init__(self):
        _positive(self, "max_new_tokens")
        if self.refill_slots is not None and (not isinstance(self.refill_slots, int)
                                              or self.refill_slots < 1):
            raise ConfigError(f"rollout.refill_slots must be an int >= 1 or null, got "
                              f"{self.refill_slots!r}")
        tail = self.refill_tail_slots
        if tail is not None and (self.refill_slots is None or not isinstance(tail, int)
                                 or not 1 <= tail <= self.refill_slots):
            raise ConfigError(f"rollout.refill_tail_slots must be an int in [1, "
                              f"rollout.refill_slots={self.refill_slots}] or null, got {tail!r}")
        if not isinstance(self.samples_per_prompt, int) or self.samples_per_prompt < 2:
            raise ConfigError("rollout.samples_per_prompt must be an int >= 2 (group advantages "
                              f"need a std), got {self.samples_per_prompt!r}")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature must be > 0 for training, got "
                              f"{self.temperature}")
        # Truncation would bias the TIS ratios (docs/design.md, mismatch).
        if self.top_p != 1.0 or self.top_k != 0:
            raise ConfigError(
                f"training rollouts sample with temperature only (got top_p={self.top_p}, "
                f"top_k={self.top_k}): top-p/top-k truncation biases the importance ratios; "
                "use them for generation and evaluation only")
        defaults = {f.name: f.default for f in dataclasses.fields(RolloutConfig)}
        for name in _TRAINER_SET:
            value = getattr(self.engine, name)
            if value != defaults[name]:
                raise ConfigError(
                    f"rollout.engine.{name}: the trainer sets it from rollout.* (got {value!r}); "
                    f"remove it from rollout.engine" + (
                        "; training rollouts sample with temperature only"
                        if name in ("top_p", "top_k") else ""))

    def rollout_config(self, n: int, model_eos_ids) -> RolloutConfig:
        """The engine config of one training rollout of ``n`` samples per prompt."""
        eos = tuple(model_eos_ids) if self.eos_ids is None else self.eos_ids
        return dataclasses.replace(self.engine, n=n, max_new_tokens=self.max_new_tokens,
                                   temperature=self.temperature, eos_ids=eos)


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
class DistillConfig:
    """DistillSparse settings (``distill:`` in a train YAML).

    enabled: train the sparse actor's LoRA each step (rollouts then run with it on).
    rank, alpha, targets: the adapter (:class:`~sparrow_jax.models.lora.LoRAConfig`).
    lambda_kl: weight of the k3 pull toward the dense policy.
    lr_multiple: the adapter's learning rate as a multiple of the policy's (``optim``); the
      other AdamW settings are the policy's.
    eval_every: every this many steps, the step's rollout is also scored by the sparse actor
      without its adapter (``alpha_paper_*_nolora`` metrics), so the adapter's gain is measured;
      0: never.
    """

    enabled: bool = False
    rank: int = 16
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS
    lambda_kl: float = 0.001
    lr_multiple: float = 5.0
    eval_every: int = 1

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ConfigError(f"distill.rank must be a positive int, got {self.rank!r}")
        if not self.alpha > 0:
            raise ConfigError(f"distill.alpha must be positive, got {self.alpha!r}")
        bad = sorted(set(self.targets) - set(LORA_TARGETS))
        if bad or not self.targets:
            raise ConfigError(f"distill.targets must be a non-empty subset of {LORA_TARGETS}, "
                              f"got {self.targets!r}")
        if not self.lambda_kl >= 0:
            raise ConfigError(f"distill.lambda_kl must be >= 0, got {self.lambda_kl!r}")
        if not self.lr_multiple > 0:
            raise ConfigError(f"distill.lr_multiple must be positive, got {self.lr_multiple!r}")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ConfigError(f"distill.eval_every must be an int >= 0, got {self.eval_every!r}")

    @property
    def lora(self) -> LoRAConfig:
        return LoRAConfig(rank=self.rank, alpha=self.alpha, targets=self.targets)

    def optim(self, policy: OptimConfig) -> OptimConfig:
        """The adapter's AdamW: the policy's, at ``lr_multiple`` times its learning rate."""
        return dataclasses.replace(policy, learning_rate=policy.learning_rate * self.lr_multiple)


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
    remat: bool = True             # rematerialise layers in the update's backward
    #                                (docs/design.md, section 1)
    loss: LossConfig = LossConfig()

    def __post_init__(self):
        _positive(self, "mini_batches", "epochs", "micro_batch_size", "length_multiple",
                  "chunk_size")


@dataclasses.dataclass(frozen=True)
class MismatchSettings:
    """Tail statistic of docs/design.md, section 5 (bins of the step's ``lengths``)."""

    bin_tokens: int = 2000
    num_bins: int = 20
    min_count: int = 100
    top_k: int = 20                # dense top-k for the ``paper`` estimator

    def __post_init__(self):
        _positive(self, "bin_tokens", "num_bins", "top_k")


CLOSED_LOOP_ESTIMATORS = ("paper", "topk_bound")


@dataclasses.dataclass(frozen=True)
class ClosedLoopConfig:
    """The closed-loop schedule (``closed_loop:`` in a train YAML; docs/design.md, section 9;
    :mod:`sparrow_jax.rl.closed_loop`). Needs a ``table`` schedule, whose bins it controls.

    estimator, quantile: the per-bin tail statistic (``paper``/``topk_bound`` alpha, computed
      from the recompute at the rollout's recorded top-k). target: a bin below it rises one
      rung at once. margin, patience: a bin lowers one rung after ``patience`` consecutive
      steps at or above ``target + margin``. min_count: a bin with fewer tokens in a step is
      left alone. ladder: the budgets (top-k pages) to move between, e.g. the calibrated
      candidates; empty: steps of ``growth`` (at least one page). lower, upper: each bin stays
      within these multiples of its starting budget; max_pages: an absolute cap (top-k pages).
    """

    enabled: bool = False
    estimator: str = "paper"
    quantile: float = 0.05
    target: float = 0.86
    margin: float = 0.03
    patience: int = 5
    min_count: int = 100
    ladder: tuple[int, ...] = ()
    growth: float = 1.25
    lower: float = 0.5
    upper: float = 2.0
    max_pages: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "ladder", tuple(self.ladder))
        if self.estimator not in CLOSED_LOOP_ESTIMATORS:
            raise ConfigError(f"closed_loop.estimator must be one of {CLOSED_LOOP_ESTIMATORS} "
                              f"(computed from the rollout's top-k), got {self.estimator!r}")
        for name in ("quantile", "target"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ConfigError(f"closed_loop.{name} must be in (0, 1), got "
                                  f"{getattr(self, name)!r}")
        if not self.margin >= 0:
            raise ConfigError(f"closed_loop.margin must be >= 0, got {self.margin!r}")
        _positive(self, "patience", "min_count")
        if any(not isinstance(v, int) or v < 0 for v in self.ladder):
            raise ConfigError(f"closed_loop.ladder must hold ints >= 0 (top-k pages), got "
                              f"{self.ladder!r}")
        if not self.growth > 1.0:
            raise ConfigError(f"closed_loop.growth must be > 1, got {self.growth!r}")
        if not 0.0 <= self.lower <= 1.0 <= self.upper:
            raise ConfigError(f"closed_loop.lower and closed_loop.upper must satisfy 0 <= lower "
                              f"<= 1 <= upper, got lower={self.lower!r}, upper={self.upper!r}")
        if self.max_pages is not None and (not isinstance(self.max_pages, int)
                                           or self.max_pages < 0):
            raise ConfigError(f"closed_loop.max_pages must be an int >= 0 or null, got "
                              f"{self.max_pages!r}")


def build_schedule(spec: dict[str, Any] | None):
    """``{"paper": "qwen3-1.7b"}`` or the fields of :class:`sparrow_jax.schedule.BudgetSchedule`
    (``{kind: fixed, pages: 6}``); None: dense rollouts."""
    if spec is None:
        return None
    from sparrow_jax.schedule import PAPER_TABLES, BudgetSchedule

    if "paper" in spec:
        if set(spec) != {"paper"}:
            raise ConfigError(f"schedule: `paper` takes no other keys, got {sorted(spec)}")
        if spec["paper"] not in PAPER_TABLES:
            error = unknown_name("paper schedule", spec["paper"], PAPER_TABLES)
            raise ConfigError(f"schedule.paper: {error}")
        return BudgetSchedule.paper(spec["paper"])
    try:
        return from_dict(BudgetSchedule, spec, where="schedule")
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"schedule: {e}") from None


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
    schedule: dict[str, Any] | None = None      # budget schedule (see build_schedule)
    update: UpdateConfig = UpdateConfig()
    optim: OptimConfig = OptimConfig()
    distill: DistillConfig = DistillConfig()    # DistillSparse (docs/design.md, section 8)
    mismatch: MismatchSettings = MismatchSettings()
    closed_loop: ClosedLoopConfig = ClosedLoopConfig()   # docs/design.md, section 9
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    eval_every: int = 0                         # 0: no evaluation
    eval_samples: int = 4                       # k of mean@k
    tensorboard: bool = True
    progress: bool = True
    # Device mesh (data, fsdp, tensor; docs/design.md, section 10). None: one device, or with
    # several processes the default MeshConfig() over all of their devices.
    mesh: MeshConfig | None = None
    # Seconds a step (with its evaluation and checkpoint) may take before the process ends
    # itself with status 124, to be resumed (sparrow_jax/rl/watchdog.py); None: no limit.
    step_timeout_s: float | None = None

    def __post_init__(self):
        from sparrow_jax.rl.rewards import reward_names

        _positive(self, "steps", "checkpoint_every", "keep_checkpoints", "eval_samples")
        timeout = self.step_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)) or not timeout > 0):
            raise ConfigError(f"step_timeout_s must be a positive number of seconds or null, "
                              f"got {timeout!r}")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.eval_every and self.data.num_eval < 1:
            raise ConfigError(f"data.num_eval must be >= 1 when eval_every is set (eval_every="
                              f"{self.eval_every}), got {self.data.num_eval}")
        if self.reward not in reward_names():
            raise unknown_name("reward", self.reward, reward_names())
        rows = self.data.prompts_per_step * self.rollout.samples_per_prompt
        if rows % self.update.mini_batches:
            raise ConfigError(
                f"the rollout batch ({self.data.prompts_per_step} prompts x "
                f"{self.rollout.samples_per_prompt} samples = {rows} rows) does not split into "
                f"update.mini_batches={self.update.mini_batches} equal mini-batches")
        schedule = self.budget_schedule
        page_size = self.rollout.engine.page_size
        if schedule is not None and schedule.page_size != page_size:
            raise ConfigError(f"schedule.page_size: the schedule counts pages of "
                              f"{schedule.page_size} tokens, rollout.engine.page_size is "
                              f"{page_size}")
        if self.closed_loop.enabled and (schedule is None or schedule.kind != "table"):
            raise ConfigError(f"closed_loop.enabled needs a `table` schedule, whose bins it "
                              f"controls; got schedule={self.schedule!r}")

    @property
    def budget_schedule(self):
        """The :class:`~sparrow_jax.schedule.BudgetSchedule` of ``schedule`` (None: dense)."""
        return build_schedule(self.schedule)


def load_train_config(path: str | Path) -> TrainConfig:
    """Reads a YAML file into a :class:`TrainConfig`; every error names the file and the key."""
    return load_yaml_config(path, lambda data: from_dict(TrainConfig, data))
