"""Measured decode-step times, and the speedup of a budget schedule they predict
(docs/design.md, section 6).

The cost model (:mod:`sparrow_jax.cost_model`) counts FLOPs and bytes; this module uses what a
device actually took. A step-time file is JSON with the per-step milliseconds of one batch size
on one device, dense at several contexts and sparse at several (context, budget) points::

    {"batch": 19,
     "dense":  [{"context": 8192, "step_ms": 10.74}, ...],
     "sparse": [{"context": 8192, "budget_pages": 67, "step_ms": 5.26}, ...]}

``budget_pages`` counts every page the step may read, reserved ones included (as
``BudgetSchedule.budget_pages`` returns). ``sparrow bench --what rollout --out FILE`` writes
this format; the JSON that ``scripts/bench_rollout.py --phase profile`` writes is read too (its
``modes.dense.rows`` and ``modes.sparse.rows``).

Model: a dense step's time interpolates linearly in the context; a sparse step's is the least
squares fit ``a + b * context + c * read`` over the sparse points, ``read = min(context,
budget_pages * page_size)`` tokens: each step reads the weights (a), scores every page's summary
(b) and reads its budget's keys and values (c). The fit's largest relative residual is reported,
and so is any length outside the measured contexts (extrapolated, not trusted silently).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Measured step times. dense_context / dense_ms ``[n]`` (n >= 2), sparse_context /
    sparse_budget_pages / sparse_ms ``[m]`` (m >= 3), from ``source``; ``batch``: the rows
    each step decoded (None when the file does not say)."""

    source: str
    dense_context: np.ndarray
    dense_ms: np.ndarray
    sparse_context: np.ndarray
    sparse_budget_pages: np.ndarray
    sparse_ms: np.ndarray
    batch: int | None = None

    def dense_step_ms(self, lengths: np.ndarray) -> np.ndarray:
        """lengths ``[N]`` -> dense ms a step ``[N]`` (flat beyond the measured contexts)."""
        order = np.argsort(self.dense_context)
        return np.interp(lengths, self.dense_context[order], self.dense_ms[order])

    def sparse_fit(self, page_size: int) -> tuple[np.ndarray, float]:
        """-> ((a, b, c), the fit's largest relative residual over the sparse points)."""
        design = _design(self.sparse_context, self.sparse_budget_pages, page_size)
        if np.linalg.matrix_rank(design) < 3:
            raise ValueError(f"{self.source}: sparse: the points do not determine a + b * context "
                             "+ c * read (measure at least three contexts or budgets that are "
                             "not all proportional)")
        coef, *_ = np.linalg.lstsq(design, self.sparse_ms, rcond=None)
        residual = np.abs(design @ coef - self.sparse_ms) / self.sparse_ms
        return coef, float(residual.max())

    def sparse_step_ms(self, lengths: np.ndarray, budget_pages: np.ndarray,
                       page_size: int) -> np.ndarray:
        """lengths, budget_pages ``[N]`` -> sparse ms a step ``[N]``; a step whose budget holds
        every page is dense (the kernel reads all of them, as the decode step does)."""
        coef, _ = self.sparse_fit(page_size)
        sparse = _design(lengths, budget_pages, page_size) @ coef
        dense = np.ceil(np.asarray(lengths) / page_size) <= np.asarray(budget_pages)
        return np.where(dense, self.dense_step_ms(lengths), sparse)


def _design(context, budget_pages, page_size) -> np.ndarray:
    context = np.asarray(context, np.float64)
    read = np.minimum(context, np.asarray(budget_pages, np.float64) * page_size)
    return np.stack([np.ones_like(context), context, read], axis=-1)


def measured_speedup(times: StepTimes, schedule, prompt_len: int, gen_len: int, *,
                     page_size: int) -> dict:
    """Dense seconds over the schedule's seconds for the decode steps at lengths ``prompt_len
    + 1 .. prompt_len + gen_len`` (the cost model's lengths), each step at the measured batch ->
    a dict: speedup, dense_s, schedule_s, fit_residual, extrapolated (lengths outside a
    measured range), file."""
    lengths = np.arange(prompt_len + 1, prompt_len + gen_len + 1)
    budgets = np.asarray(schedule.budget_pages(lengths))
    dense_s = float(times.dense_step_ms(lengths).sum()) / 1e3
    sparse_s = float(times.sparse_step_ms(lengths, budgets, page_size).sum()) / 1e3
    _, residual = times.sparse_fit(page_size)
    lo = max(times.dense_context.min(), times.sparse_context.min())
    hi = min(times.dense_context.max(), times.sparse_context.max())
    return {"file": times.source, "batch": times.batch, "speedup": round(dense_s / sparse_s, 4),
            "dense_s": dense_s, "schedule_s": sparse_s, "fit_residual": residual,
            "extrapolated": bool(lengths.min() < lo or lengths.max() > hi)}


def load_step_times(path: str | Path) -> StepTimes:
    """A step-time file (module docstring) -> :class:`StepTimes`; a bad file, key or value is a
    one-line ValueError naming the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"step_times: no file {path}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object with dense and sparse, got "
                         f"{type(data).__name__}")
    if "modes" in data:   # scripts/bench_rollout.py --phase profile
        modes = data["modes"] if isinstance(data["modes"], dict) else {}
        dense, sparse = (modes.get(m, {}).get("rows") for m in ("dense", "sparse"))
        # Its rows' mean_context is where the timed steps ran (context, what was asked).
        where, context = "modes.{}.rows", "mean_context"
    else:
        dense, sparse = data.get("dense"), data.get("sparse")
        where, context = "{}", "context"
    d_ctx, d_ms = _points(path, where.format("dense"), dense, (context, "step_ms"), 2)
    s_ctx, s_budget, s_ms = _points(path, where.format("sparse"), sparse,
                                    (context, "budget_pages", "step_ms"), 3)
    batch = data.get("batch")
    if batch is not None and (not isinstance(batch, int) or batch < 1):
        raise ValueError(f"{path}: batch: must be a positive int, got {batch!r}")
    return StepTimes(str(path), d_ctx, d_ms, s_ctx, s_budget, s_ms, batch)


def _points(path, key, rows, fields, least) -> tuple[np.ndarray, ...]:
    if not isinstance(rows, list) or len(rows) < least:
        raise ValueError(f"{path}: {key}: needs a list of at least {least} points, got "
                         f"{rows!r:.80}")
    cols = []
    for name in fields:
        col = []
        for i, row in enumerate(rows):
            value = row.get(name) if isinstance(row, dict) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{path}: {key}[{i}].{name}: must be a positive number, got "
                                 f"{value!r}")
            col.append(float(value))
        cols.append(np.asarray(col))
    return tuple(cols)


__all__ = ["StepTimes", "load_step_times", "measured_speedup"]
