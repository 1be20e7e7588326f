"""The budget schedule as a runtime array of the decode loop (docs/design.md, section 4).

A :class:`~sparrow_jax.schedule.BudgetSchedule` splits into what the jitted loop specialises on
(:class:`BudgetShape`: the bin count and width) and its values (an int32 array of total pages
per bin, an argument of the loop). A new table of the same shape therefore reuses the loop's
compilation. A fixed budget is a one-bin table; a fraction schedule stays whole in the shape
(its budget grows with the context: there is no table to pass).

The loop gathers a static number of pages per (sequence, KV head): the largest budget that the
*bound* (another schedule, by default the schedule itself) gives a length the call's page table
can hold. A caller that changes tables between calls declares one bound above all of them, so
the gather width, and with it the compilation, stays the same.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention.selection import MIN_BUDGET_PAGES
from sparrow_jax.schedule import BudgetSchedule


@dataclasses.dataclass(frozen=True)
class BudgetShape:
    """The static part of a schedule: ``bins`` bins of ``bin_tokens`` tokens (tables and fixed
    budgets), or a fraction schedule whole (``fraction``; then ``bins`` is 0)."""

    bins: int = 0
    bin_tokens: int = 1
    fraction: BudgetSchedule | None = None


def split_schedule(schedule: BudgetSchedule) -> tuple[BudgetShape, np.ndarray]:
    """-> (shape, values ``[bins]`` int32: each bin's total budget in pages, the reserved pages
    included)."""
    if schedule.kind == "table":
        values = np.asarray(schedule.table, np.int32) + MIN_BUDGET_PAGES
        return BudgetShape(bins=len(values), bin_tokens=schedule.bin_tokens), values
    if schedule.kind == "fixed":
        return BudgetShape(bins=1), np.array([schedule.pages], np.int32)
    # The name only labels the schedule: it must not split compilations.
    return BudgetShape(fraction=dataclasses.replace(schedule, name="")), np.zeros(0, np.int32)


def budget_pages(shape: BudgetShape, values: jax.Array, lengths: jax.Array) -> jax.Array:
    """lengths ``[...]`` int32 -> total budget pages ``[...]`` int32, as
    :meth:`BudgetSchedule.budget_pages` of the schedule ``(shape, values)`` came from."""
    if shape.fraction is not None:
        return shape.fraction.budget_pages(lengths)
    return values[jnp.clip(lengths // shape.bin_tokens, 0, shape.bins - 1)]


@functools.lru_cache(maxsize=256)   # asked before every decode chunk
def gather_width(bound: BudgetSchedule, width: int) -> int:
    """The static gather width of the sparse layers for a page table ``width`` pages wide: the
    largest budget ``bound`` gives any length the table holds, capped at ``width``."""
    lengths = np.arange(1, width * bound.page_size + 1)
    return int(min(int(np.max(np.asarray(bound.budget_pages(lengths)))), width))


def check_bound(schedule: BudgetSchedule, bound: BudgetSchedule, width: int) -> None:
    """Raises ValueError unless ``bound`` gives every length at least the budget ``schedule``
    gives it: every length a ``width``-page table holds, and every bin of either table (a table
    above its bound is refused even in a bin this call cannot reach)."""
    if bound.page_size != schedule.page_size:
        raise ValueError(f"schedule_bound counts pages of {bound.page_size} tokens, the schedule "
                         f"{schedule.page_size}")
    spans = [s.bin_tokens * len(s.table) for s in (schedule, bound) if s.kind == "table"]
    lengths = np.arange(1, max([width * schedule.page_size] + spans) + 1)
    got = np.asarray(schedule.budget_pages(lengths))
    limit = np.asarray(bound.budget_pages(lengths))
    over = np.flatnonzero(got > limit)
    if over.size:
        i = over[0]
        raise ValueError(f"schedule_bound: the schedule gives {int(got[i])} pages at length "
                         f"{int(lengths[i])}, above the bound's {int(limit[i])}")


def runtime_schedule(schedule: BudgetSchedule | None, bound: BudgetSchedule | None,
                     width: int) -> tuple[BudgetShape | None, np.ndarray, BudgetSchedule | None]:
    """A call's schedule for the decode loop -> (its shape, its values, the bound of its gather
    width): ``bound`` checked (:func:`check_bound`), or the schedule itself when None; (None,
    an empty table, None) when dense (``schedule`` None; the bound is then ignored)."""
    if schedule is None:
        return None, np.zeros(0, np.int32), None
    if bound is None:
        return *split_schedule(schedule), schedule
    check_bound(schedule, bound, width)
    return *split_schedule(schedule), bound


__all__ = ["BudgetShape", "split_schedule", "budget_pages", "gather_width", "check_bound",
           "runtime_schedule"]
