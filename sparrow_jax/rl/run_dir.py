"""One run, one folder: what a fresh run and a resume may find in a run folder.

A run folder holds one run: ``checkpoints/`` (each with the config it was made with),
``metrics.jsonl``, ``tb/``, ``plots/`` and ``config.yaml``. A fresh run refuses a folder that
holds another run's checkpoints or metrics unless told to ``overwrite`` it; a resume refuses a
config that differs from the checkpoint's in anything that changes the run's results.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from sparrow_jax.config import ConfigError

# What a resume may change: how long, how often, where, how fast. Everything else (model, data,
# seed, reward, optimiser, loss, schedule, rollout sampling and selection) changes the results.
# Dotted key paths of the TrainConfig; a path covers the keys below it.
RESUMABLE_CHANGES = (
    "run_dir", "steps", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_samples",
    "tensorboard", "progress", "mesh", "step_timeout_s", "distill.eval_every",
    "model.path", "data.path", "data.eval_path",
    "update.micro_batch_size", "update.length_multiple", "update.chunk_size", "update.remat",
    "rollout.engine.num_pages", "rollout.engine.max_total_tokens",
    "rollout.engine.memory_fraction", "rollout.engine.pool_multiple",
    "rollout.engine.prefill_chunk", "rollout.engine.steps_per_call",
    "rollout.engine.table_bucket_pages", "rollout.engine.prompt_multiple",
    "rollout.engine.contiguous_pages", "rollout.refill_slots", "rollout.refill_tail_slots",
)

# What a fresh run would overwrite; anything else in the folder is left alone.
RUN_FILES = ("checkpoints", "metrics.jsonl", "tb", "plots", "config.yaml", "summary.json")


class RunDirError(ConfigError):
    """The run folder holds something this run must not mix with."""


def previous_run(run_dir: str | Path) -> list[str]:
    """What of another run ``run_dir`` holds (empty: nothing)."""
    run_dir = Path(run_dir)
    found = []
    ckpt = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.is_dir() else []
    if steps:
        found.append(f"checkpoints {', '.join(map(str, steps))}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append("metrics.jsonl")
    return found


def prepare_fresh(run_dir: str | Path, overwrite: bool) -> None:
    """Makes ``run_dir`` ready for a run from step 0: refuses one that holds another run, or
    with ``overwrite`` deletes that run's files first."""
    run_dir = Path(run_dir)
    found = previous_run(run_dir)
    if found and not overwrite:
        raise RunDirError(
            f"run folder {run_dir} holds another run ({'; '.join(found)}): continue it with "
            f"--resume, delete it with --overwrite, or choose another --run-dir")
    if overwrite:
        for name in RUN_FILES:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _resumable(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in RESUMABLE_CHANGES)


def result_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys where two configs (as :func:`sparrow_jax.config.to_dict` writes them) differ
    in something that changes a run's results."""
    a, b = _flatten(saved), _flatten(current)
    return sorted(k for k in set(a) | set(b)
                  if not _resumable(k) and _plain(a.get(k)) != _plain(b.get(k)))


def _plain(v):
    # JSON turns tuples into lists; compare them as equal.
    return tuple(_plain(x) for x in v) if isinstance(v, (list, tuple)) else v


def check_resume(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Refuses to resume the run whose checkpoint (``where``) was made with ``saved`` under
    ``current`` when they differ in what changes the results."""
    changed = result_changes(saved, current)
    if changed:
        a, b = _flatten(saved), _flatten(current)
        shown = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed[:6])
        more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
        raise RunDirError(
            f"cannot resume {where} under a different config ({shown}{more}): these change the "
            f"run's results; restore the checkpoint's values, or start a new run with "
            f"--overwrite or another --run-dir")
