"""``sparrow train --dry-run``: a run config checked against a chip without weights, devices or
compilation: the mesh it would build on N devices and the memory per device of its update and
its rollout (:mod:`sparrow_jax.memory`), against the chip's memory.

A run file may carry a ``target`` key beside the :class:`~sparrow_jax.rl.config.TrainConfig`
keys: what the config is sized for (``configs/presets/*.yaml``)::

    target: {chip: h100, devices: 8, max_prompt_tokens: 2048}

The architecture comes from the model folder's ``config.json``; a folder that does not exist
(a preset's ``/path/to/Qwen3-8B``) falls back to ``configs/models/<folder name>.json``, which the
report says. The update and the rollout never hold their buffers at once (the rollout's page
pool and decode copy of the weights are freed when it returns), so the peak per device is

    weights + optimizer + reference_weights + max(grads + activations, rollout_weights + kv_pages)

and it must stay under the chip's memory less :data:`MARGIN` (XLA's workspace, fragmentation,
and the activation figure being a model). A run checks the same count against its devices'
allocator when it starts (:func:`check_device_memory`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sparrow_jax.config import (CONFIG_DIR, ConfigError, ModelConfig, from_dict, load_yaml_config,
                                unknown_name)
from sparrow_jax.memory import GIB, MemoryEstimate, memory_per_device, param_bytes_per_device
from sparrow_jax.sharding import MeshConfig

MARGIN = 0.10   # of the chip's memory, kept free


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    memory: int        # bytes of one chip
    platform: str      # "tpu" or "gpu": which attention the update's forward runs
    host_devices: int  # devices per host (one process each) in a multi-host slice or cluster


CHIPS: dict[str, Chip] = {
    "v5e": Chip("TPU v5e", 16 * GIB, "tpu", 4),
    "v5p": Chip("TPU v5p", 95 * GIB, "tpu", 4),
    "h100": Chip("NVIDIA H100", 80 * GIB, "gpu", 8),
    "h200": Chip("NVIDIA H200", 141 * GIB, "gpu", 8),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """What a run config is sized for. ``chip``: a key of :data:`CHIPS`; ``devices``: the device
    count the dry run assumes without ``--devices``; ``max_prompt_tokens``: the longest prompt
    of the data (needed for files; the synthetic tasks know theirs)."""

    chip: str | None = None
    devices: int | None = None
    max_prompt_tokens: int | None = None

    def __post_init__(self):
        if self.chip is not None and self.chip not in CHIPS:
            raise unknown_name("target.chip", self.chip, CHIPS)
        for name in ("devices", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"target.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RunFile:
    config: Any            # TrainConfig
    target: Target
    mesh: MeshConfig       # the config's mesh (MeshConfig() when it has none: with several
    #                        processes the trainer's mesh over all devices)


def load_run_file(path: str | Path) -> RunFile:
    """A run YAML -> its TrainConfig, ``target`` and mesh; every error names the file and key."""
    return load_yaml_config(path, run_file_from_dict)


def run_file_from_dict(data: dict[str, Any]) -> RunFile:
    """:func:`load_run_file` of a mapping already read."""
    from sparrow_jax.rl.config import TrainConfig

    data = dict(data)
    target = from_dict(Target, data.pop("target", None), where="target")
    config = from_dict(TrainConfig, data)
    return RunFile(config, target, config.mesh or MeshConfig())


def architecture(spec) -> tuple[ModelConfig, str]:
    """The :class:`ModelConfig` of a ``model`` spec without reading weights, and where it came
    from (a line of the report)."""
    if spec.preset is not None:
        return ModelConfig.preset(spec.preset), f"preset configs/models/{spec.preset}.json"
    if spec.hf_config is not None:
        return ModelConfig.from_hf_dict(spec.hf_config), "model.hf_config"
    folder = Path(spec.path)
    if (folder / "config.json").is_file():
        cfg = json.loads((folder / "config.json").read_text())
        return ModelConfig.from_hf_dict(cfg), f"{folder / 'config.json'} (weights not read)"
    name = folder.name.lower()
    if (CONFIG_DIR / "models" / f"{name}.json").is_file():
        return ModelConfig.preset(name), (f"{spec.path} not found: architecture from "
                                          f"configs/models/{name}.json")
    known = sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.json"))
    raise ConfigError(f"model.path: {spec.path} has no config.json and {name!r} is no preset of "
                      f"configs/models ({', '.join(known)}); give model.preset for a dry run")


def _max_prompt_tokens(config, target: Target) -> int:
    if target.max_prompt_tokens is not None:
        return target.max_prompt_tokens
    data = config.data
    if data.task == "needle":
        return data.needle.max_prompt_len
    if data.task == "reverse":
        return data.reverse.max_len + 2     # BOS and QUERY around the values
    raise ConfigError(f"target.max_prompt_tokens: give the longest prompt of {data.path} (the "
                      "dry run sizes the update and the page pool by it)")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class DryRun:
    """One device's share of a run on ``devices`` devices of ``chip`` (None: no verdict)."""

    model: ModelConfig
    model_source: str
    devices: int
    mesh: tuple[int, int, int]          # (data, fsdp, tensor)
    chip: Chip | None
    rows_per_shard: int                 # rollout rows of one data x fsdp shard
    seq_len: int                        # the update's longest micro-batch row
    pool_pages: int                     # one shard's page pool (its null page included)
    memory: MemoryEstimate
    rollout_weights: int                # the rollout's decode copy of the weights (compute dtype)
    reference_weights: int = 0          # the KL term's reference (compute dtype, sharded)
    notes: tuple[str, ...] = ()

    @property
    def update_peak(self) -> int:
        m = self.memory
        return m.weights + m.optimizer + self.reference_weights + m.grads + m.activations

    @property
    def rollout_peak(self) -> int:
        m = self.memory
        return m.weights + m.optimizer + self.reference_weights + self.rollout_weights + m.kv_pages

    @property
    def peak(self) -> int:
        return max(self.update_peak, self.rollout_peak)

    @property
    def floor(self) -> int:
        """The peak without the activations, the one part modelled rather than laid out: what
        the run holds at least (Qwen3-14B on two H200s held 1.1-1.4% over the whole count)."""
        m = self.memory
        return (m.weights + m.optimizer + self.reference_weights
                + max(m.grads, self.rollout_weights + m.kv_pages))

    @property
    def limit(self) -> int | None:
        return None if self.chip is None else int(self.chip.memory * (1 - MARGIN))

    def components(self) -> dict[str, int]:
        parts = {**dataclasses.asdict(self.memory), "rollout_weights": self.rollout_weights}
        if self.reference_weights:
            parts["reference_weights"] = self.reference_weights
        return parts

    def check_fits(self) -> None:
        """ConfigError, one line naming the largest component of the peak phase, when the peak
        per device exceeds the chip's memory less the margin."""
        if self.limit is None or self.peak <= self.limit:
            return
        parts = self.components()
        phase = (("grads", "activations") if self.update_peak >= self.rollout_peak
                 else ("rollout_weights", "kv_pages"))
        held = ("weights", "optimizer") + (("reference_weights",) if self.reference_weights
                                           else ())
        name = max(held + phase, key=parts.__getitem__)
        raise ConfigError(
            f"does not fit: {self.peak / GIB:.1f} GiB per device > {self.limit / GIB:.1f} GiB "
            f"({self.chip.name}, {self.chip.memory / GIB:.0f} GiB less {MARGIN:.0%}); largest "
            f"part: {name} {parts[name] / GIB:.1f} GiB")


def dry_run(run: RunFile, *, devices: int | None = None,
            chip: str | Chip | None = None) -> DryRun:
    """The memory per device of ``run`` on ``devices`` devices (default the target's, else the
    mesh's fixed size, else 1) of ``chip`` (a key of :data:`CHIPS` or a :class:`Chip`; default
    the target's; None: no verdict). Raises a one-line ConfigError for a config the mesh or the
    model cannot run."""
    config, target = run.config, run.target
    if isinstance(chip, str) and chip not in CHIPS:
        raise unknown_name("--chip", chip, CHIPS)
    chip_spec = chip if isinstance(chip, Chip) else CHIPS.get(chip or target.chip)
    fixed = [getattr(run.mesh, a) for a in ("data", "fsdp", "tensor")]
    n = devices or target.devices or (math.prod(fixed) if -1 not in fixed else 1)
    try:
        sizes = run.mesh.axis_sizes(n)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model, source = architecture(config.model)
    data_size, fsdp_size, tensor = sizes
    for what, size in (("KV heads", model.num_key_value_heads),
                       ("MLP width", model.intermediate_size)):
        if size % tensor:
            raise ConfigError(f"mesh.tensor={tensor} must divide the model's {size} {what} "
                              "(the rollout splits them)")
    bad = [x for x in config.rollout.engine.dense_layers
           if not 0 <= x < model.num_hidden_layers]
    if bad:
        raise ConfigError(f"rollout.engine.dense_layers {bad} outside the model's "
                          f"{model.num_hidden_layers} layers")

    from sparrow_jax.attention.allocator import pages_needed

    engine, n_samples = config.rollout.engine, config.rollout.samples_per_prompt
    max_new, page = config.rollout.max_new_tokens, engine.page_size
    prompt = _max_prompt_tokens(config, target)
    # With several processes (one per host) each samples its share of the prompts on a mesh of
    # its own devices, KV heads over `tensor` only where that divides them (rl/trainer.py).
    processes = 1 if chip_spec is None or n <= chip_spec.host_devices else -(
        -n // chip_spec.host_devices)
    local = n // processes
    kv_split = tensor if local % tensor == 0 else 1
    groups = local // kv_split
    prompts_per_shard = -(-(-(-config.data.prompts_per_step // processes)) // groups)
    notes = [] if groups * processes * prompts_per_shard == config.data.prompts_per_step else [
        f"data.prompts_per_step={config.data.prompts_per_step} does not split evenly over "
        f"{groups * processes} rollout shards: the last ones are padded"]
    if kv_split != tensor:
        notes.append(f"mesh.tensor={tensor} spans hosts of {local} devices: rollouts keep "
                     f"every KV head and a whole copy of the weights on each device")
    accelerator = chip_spec is not None
    compute_bytes = 4 if config.model.dtype == "float32" or (
        config.model.dtype == "auto" and not accelerator) else 2
    kv_bytes = {"float32": 4, "bfloat16": 2, "float16": 2, None: compute_bytes}[
        engine.cache_dtype]
    if isinstance(engine.num_pages, int):
        pool = engine.num_pages
    elif engine.max_total_tokens is not None:
        pool = -(-engine.max_total_tokens // page) + 1
    else:
        need = int(pages_needed([prompt] * prompts_per_shard, n_samples, max_new, page).sum())
        pool = _round_up(need + 1, engine.pool_multiple)
        if engine.num_pages == "memory":
            notes.append("rollout.engine.num_pages=memory fills what is free: shown at the "
                         "request's size")
    need = int(pages_needed([prompt] * prompts_per_shard, n_samples, max_new, page).sum()) + 1
    if pool < need:
        raise ConfigError(f"rollout.engine: a pool of {pool} pages per shard holds less than "
                          f"{prompts_per_shard} prompts of {prompt} tokens x {n_samples} samples "
                          f"x {max_new} new tokens ({need} pages)")
    seq_len = _round_up(prompt + max_new, config.update.length_multiple)
    axis_sizes = dict(zip(("data", "fsdp", "tensor"), sizes))
    memory = memory_per_device(
        model, axis_sizes, micro_batch_size=config.update.micro_batch_size, seq_len=seq_len,
        response_len=max_new, kv_pages=pool, page_size=page, kv_bytes=kv_bytes,
        compute_bytes=compute_bytes, chunk_size=config.update.chunk_size,
        remat=config.update.remat,
        flash_attention=chip_spec is not None and chip_spec.platform == "gpu"
        and compute_bytes == 2)
    memory = dataclasses.replace(memory, kv_pages=memory.kv_pages * tensor // kv_split)
    # The rollout decodes from a copy of the weights in the compute dtype, split over the KV
    # heads' axis and whole over the rest (rollout/engine.py, model_params; with several
    # processes, the trainer's gather).
    rollout_weights = param_bytes_per_device(model, {"tensor": kv_split},
                                             bytes_per_element=compute_bytes)
    # The KL term's reference: the initial weights in the compute dtype, in the weights' layout,
    # held for the whole run (rl/recompute.py, reference_policy).
    reference = param_bytes_per_device(model, axis_sizes, bytes_per_element=compute_bytes) \
        if config.update.loss.kl_coef else 0
    return DryRun(model=model, model_source=source, devices=n, mesh=sizes, chip=chip_spec,
                  rows_per_shard=prompts_per_shard * n_samples, seq_len=seq_len,
                  pool_pages=pool, memory=memory, rollout_weights=rollout_weights,
                  reference_weights=reference, notes=tuple(notes))


_LABELS = {
    "weights": "weights (float32 masters, sharded)",
    "grads": "gradients",
    "optimizer": "AdamW moments",
    "activations": "activations (one micro-batch)",
    "kv_pages": "KV pages (one shard's pool)",
    "rollout_weights": "rollout weights (decode copy)",
    "reference_weights": "KL reference (compute dtype, sharded)",
}


def format_report(r: DryRun) -> str:
    """The dry run's table: one line per component, the two phases, the peak against the chip."""
    d, f, t = r.mesh
    lines = [f"model: {r.model_source} ({r.model.num_params() / 1e6:,.0f}M parameters)",
             f"mesh on {r.devices} devices: data={d}, fsdp={f}, tensor={t}",
             f"rollout: {r.rows_per_shard} rows and {r.pool_pages} pages per shard; update: "
             f"rows of up to {r.seq_len} tokens",
             *(f"note: {x}" for x in r.notes),
             f"{'memory per device':<42}{'GiB':>9}"]
    row = "{:<42}{:>9.2f}".format
    lines += [row(f"  {_LABELS[k]}", v / GIB) for k, v in r.components().items()]
    ref = ", reference" if r.reference_weights else ""
    lines += [row(f"  update: weights, moments{ref}, grads, acts", r.update_peak / GIB),
              row(f"  rollout: weights, moments{ref}, copy, KV", r.rollout_peak / GIB),
              row("peak", r.peak / GIB)]
    if r.chip is not None:
        verdict = "fits" if r.peak <= r.limit else "DOES NOT FIT"
        lines.append(row(f"limit: {r.chip.name} less {MARGIN:.0%}", r.limit / GIB)
                     + f"  {verdict}")
    return "\n".join(lines)


def check_device_memory(config, local_devices: Sequence, devices: int, *,
                        engine: bool = True) -> None:
    """A run's memory against the allocator of this process's first device (``local_devices``
    of ``devices`` in all), before any weight loads: ConfigError, one line, when the dry run's
    :attr:`DryRun.floor` exceeds the allocator's limit (the run would run out of memory minutes
    later, in its first step); a warning when only the whole count does. Nothing where the
    device reports no limit (CPU). Counted as floors: prompt files as one-token prompts (their
    lengths are read later), refill's pool as empty (it sizes its own), and without ``engine``
    (a rollout function of the caller's) no decode copy or pages."""
    device = local_devices[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return
    limit = int(stats["bytes_limit"])
    known = config.data.task in ("needle", "reverse")
    chip = Chip(device.device_kind, limit, device.platform, host_devices=len(local_devices))
    try:
        r = dry_run(RunFile(config, Target(max_prompt_tokens=None if known else 1),
                            config.mesh or MeshConfig()), devices=devices, chip=chip)
    except ConfigError:
        return      # not a question of memory: the trainer's own checks say what is wrong
    if not engine or config.rollout.refill_slots is not None:
        r = dataclasses.replace(r, memory=dataclasses.replace(r.memory, kv_pages=0),
                                rollout_weights=r.rollout_weights if engine else 0)
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    allocator = (f"{device.device_kind}'s allocator gives {limit / GIB:.1f} GiB "
                 + (f"(XLA_PYTHON_CLIENT_MEM_FRACTION={fraction})" if fraction else
                    "(XLA_PYTHON_CLIENT_MEM_FRACTION unset: JAX's default, 75% on GPUs)"))
    if r.floor > limit:
        raise ConfigError(
            f"memory: the run holds at least {r.floor / GIB:.1f} GiB a device (weights, moments "
            f"and the larger of the gradients and the rollout's decode copy and pages; `sparrow "
            f"train --dry-run` counts each) but {allocator}: give JAX more (`sparrow train` "
            f"sets 0.95 unless told), or the run more devices or fewer rollout rows")
    if r.peak > limit:
        warnings.warn(f"memory: the dry run counts {r.peak / GIB:.1f} GiB a device at the peak "
                      f"and {allocator}: the run may run out of memory", stacklevel=2)
