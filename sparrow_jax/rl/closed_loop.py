"""The closed-loop schedule: a controller that moves each length bin's page budget during training
to hold the tail of the acceptance rate at a target (docs/design.md, section 9).

Pure functions over a small state pytree (:class:`ControllerState`, host NumPy arrays, one entry per
bin of the budget table):

- :func:`init_state`: the starting table (the configured, calibrated one) and its bounds.
- :func:`bin_tail`: per bin, the tail statistic of alpha and its token count, from the step's
  per-token alphas (the dense recompute at the rollout's recorded top-k: no extra forward).
- :func:`advance`: one step of the rule. A bin whose statistic rests on at least ``min_count``
  tokens moves one rung up the budget ladder at once when it is below ``target``, and one rung
  down only after ``patience`` consecutive steps at or above ``target + margin``; a bin with
  too few tokens is left alone and its streak starts again (a lowering needs unbroken
  evidence). Then every bin is clipped to its bounds, a bin no response token has reached yet
  is brought down to the smallest budget of the later bins that have held tokens, and the table
  is made non-decreasing by a running maximum (raising a later bin is always safe; lowering one
  below an earlier bin is not done). A bin whose budget changed, by its own rule or the running
  maximum, starts its streak again: its statistic was measured at the old budget.
- :func:`changes` and :func:`loop_metrics`: what a step changed, as metric names and numbers.
- :func:`observe`: all of it for one training step, as the trainer calls it; :func:`bound`:
  the schedule of the upper bounds, which the rollout engine takes as ``schedule_bound`` so that
  every table the controller may reach runs on one compilation of the decode loop
  (:mod:`sparrow_jax.rollout.budget`).

Several processes: every process holds the whole step's batch (the trainer gathers the rollout
and runs the recompute over the global mesh), so the statistic is already pooled and
:func:`advance` computes the same state everywhere; :func:`agree` adopts process 0's state all
the same, so the tables cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from sparrow_jax.mismatch import tail_statistic


class ControllerState(NamedTuple):
    """The controller's whole state; ``[num_bins]`` int64 each. ``table``: top-k pages per bin
    (the 3 reserved pages excluded, as in :class:`~sparrow_jax.schedule.BudgetSchedule`);
    ``streak``: consecutive comfortable steps; ``lower``/``upper``: the bounds; ``held``: 1
    where a step has had response tokens in the bin (ever), else 0."""

    table: np.ndarray
    streak: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    held: np.ndarray

    def to_dict(self) -> dict[str, list[int]]:
        """JSON-ready (the checkpoint record)."""
        return {k: [int(x) for x in v] for k, v in self._asdict().items()}

    @classmethod
    def from_dict(cls, data: dict[str, list[int]]) -> "ControllerState":
        """The record's state; one written before ``held`` existed counts every bin as held
        (the rule it ran under)."""
        data = {"held": [1] * len(data["table"]), **data}
        return cls(**{k: np.asarray(data[k], np.int64) for k in cls._fields})


def init_state(table, config) -> ControllerState:
    """``table [num_bins]`` (non-decreasing top-k pages) -> the state before the first step.
    Bounds per bin: ``floor(lower x t)`` to ``max(ceil(upper x t), 1)`` (so a bin of 0 pages
    may still rise), capped at ``max_pages``; both non-decreasing, like ``table``."""
    t = np.asarray(table, np.int64)
    if t.ndim != 1 or t.size == 0 or np.any(np.diff(t) < 0) or np.any(t < 0):
        raise ValueError(f"closed loop: the starting table must be non-empty, non-decreasing "
                         f"ints >= 0, got {t.tolist()}")
    lower = np.floor(config.lower * t).astype(np.int64)
    upper = np.maximum(np.ceil(config.upper * t).astype(np.int64), 1)
    if config.max_pages is not None:
        if t.max() > config.max_pages:
            raise ValueError(f"closed loop: the starting table reaches {int(t.max())} pages, "
                             f"above closed_loop.max_pages={config.max_pages}")
        upper = np.minimum(upper, config.max_pages)
    return ControllerState(t, np.zeros_like(t), lower, upper, np.zeros_like(t))


def bin_tail(alpha, positions, mask, bin_tokens: int, num_bins: int, quantile: float):
    """Per-token ``alpha [S, R]`` at ``positions [S, R]`` (each token's step ``lengths``),
    ``mask [S, R]`` -> (tail ``[num_bins]`` float64, NaN in an empty bin; tokens ``[num_bins]``
    int64). Bins as the schedule's: ``min(position // bin_tokens, num_bins - 1)``."""
    mask = np.asarray(mask, bool)
    positions = np.asarray(positions)
    tail = tail_statistic(jnp.asarray(alpha, jnp.float32), jnp.asarray(positions),
                          bin_tokens=bin_tokens, quantile=quantile, mask=jnp.asarray(mask),
                          num_bins=num_bins, min_count=1)
    bins = np.minimum(positions[mask] // bin_tokens, num_bins - 1)
    return np.asarray(tail, np.float64), np.bincount(bins, minlength=num_bins).astype(np.int64)


def rung_up(b: np.ndarray, config) -> np.ndarray:
    """The next budget above each of ``b``: the smallest ladder rung above it (``b`` itself
    when none is), or without a ladder ``max(b + 1, ceil(growth x b))``."""
    if config.ladder:
        rungs = np.asarray(sorted(config.ladder), np.int64)
        i = np.searchsorted(rungs, b, side="right")
        return np.where(i < rungs.size, rungs[np.minimum(i, rungs.size - 1)], b)
    return np.maximum(b + 1, np.ceil(config.growth * b).astype(np.int64))


def rung_down(b: np.ndarray, config) -> np.ndarray:
    """The next budget below each of ``b``: the largest ladder rung below it (``b`` itself when
    none is), or without a ladder ``max(0, min(b - 1, floor(b / growth)))``."""
    if config.ladder:
        rungs = np.asarray(sorted(config.ladder), np.int64)
        i = np.searchsorted(rungs, b, side="left") - 1
        return np.where(i >= 0, rungs[np.maximum(i, 0)], b)
    return np.maximum(0, np.minimum(b - 1, np.floor(b / config.growth).astype(np.int64)))


def advance(state: ControllerState, tail, tokens, config) -> ControllerState:
    """One step of the rule (module docstring) on the step's ``tail [num_bins]`` and
    ``tokens [num_bins]`` -> the next state."""
    tail = np.asarray(tail, np.float64)
    measured = np.asarray(tokens) >= config.min_count
    low = measured & (tail < config.target)
    comfortable = measured & (tail >= config.target + config.margin)
    streak = np.where(comfortable, state.streak + 1, 0)
    lower = comfortable & (streak >= config.patience)
    table = np.where(low, rung_up(state.table, config),
                     np.where(lower, rung_down(state.table, config), state.table))
    table = np.clip(table, state.lower, state.upper)
    # A bin no response has reached (the prompts' span, say) has no statistic, and through the
    # running maximum its starting budget would floor every later bin: it takes at most the
    # smallest budget of the later bins that have held tokens. Its bounds still hold: both are
    # non-decreasing, so a later bin's budget is at least this bin's lower bound.
    held = (state.held > 0) | (np.asarray(tokens) > 0)
    big = np.iinfo(np.int64).max
    later = np.minimum.accumulate(np.where(held, table, big)[::-1])[::-1]
    later = np.append(later[1:], big)           # over the bins after each one
    table = np.maximum.accumulate(np.where(held, table, np.minimum(table, later)))
    streak = np.where((table != state.table) | lower, 0, streak)
    return state._replace(table=table.astype(np.int64), streak=streak.astype(np.int64),
                          held=held.astype(np.int64))


def changes(before: ControllerState, after: ControllerState, tail, tokens) -> list[dict]:
    """The bins a step changed: ``{"bin", "old", "new", "tail", "tokens"}`` each."""
    return [{"bin": int(i), "old": int(before.table[i]), "new": int(after.table[i]),
             "tail": float(tail[i]), "tokens": int(tokens[i])}
            for i in np.flatnonzero(before.table != after.table)]


def loop_metrics(before: ControllerState, after: ControllerState, tail, tokens) -> dict[str, float]:
    """The metrics line's part: each bin's statistic and token count (``closed_loop_p5_binNN``,
    ``closed_loop_tokens_binNN``, measured bins only), the table after the step
    (``schedule_pages_binNN``), the number of changed bins (``schedule_changes``), and for
    each change its old and new budget (``schedule_old_binNN``, ``schedule_new_binNN``)."""
    out: dict[str, float] = {}
    for i, (t, n) in enumerate(zip(tail, tokens)):
        if n and math.isfinite(t):
            out[f"closed_loop_p5_bin{i:02d}"] = float(t)
            out[f"closed_loop_tokens_bin{i:02d}"] = float(n)
    out.update({f"schedule_pages_bin{i:02d}": float(v) for i, v in enumerate(after.table)})
    moved = changes(before, after, tail, tokens)
    out["schedule_changes"] = float(len(moved))
    for c in moved:
        out[f"schedule_old_bin{c['bin']:02d}"] = float(c["old"])
        out[f"schedule_new_bin{c['bin']:02d}"] = float(c["new"])
    return out


def agree(state: ControllerState) -> ControllerState:
    """Process 0's state on every process (one process: ``state`` itself)."""
    import jax

    if jax.process_count() == 1:
        return state
    from sparrow_jax import distributed

    rows = distributed.allgather_rows(np.stack(state)[None])   # [processes, 5, num_bins]
    return ControllerState(*(np.asarray(x, np.int64) for x in rows[0]))


def observe(state: ControllerState, config, schedule, rollout, dense):
    """One training step: the statistic of ``config.estimator`` per bin of ``schedule`` (a
    ``table`` :class:`~sparrow_jax.schedule.BudgetSchedule`) from the step's ``rollout`` and
    dense recompute ``dense`` -> (next state, the schedule of its table, metrics)."""
    from sparrow_jax.rl.step_metrics import response_positions, token_alphas

    alpha = token_alphas(rollout, dense)[config.estimator]
    tail, tokens = bin_tail(alpha, response_positions(rollout), rollout.response_mask,
                            schedule.bin_tokens, len(schedule.table), config.quantile)
    new = agree(advance(state, tail, tokens, config))
    return (new, dataclasses.replace(schedule, table=tuple(int(x) for x in new.table)),
            loop_metrics(state, new, tail, tokens))


def bound(state: ControllerState, schedule):
    """``schedule`` with the upper bounds as its table: above every table the state may reach."""
    return dataclasses.replace(schedule, table=tuple(int(x) for x in state.upper))
