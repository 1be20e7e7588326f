"""The decode time of a run's chunks predicted from fixed-context step times (docs/design.md,
section 11): a refill run's chunks from :func:`~sparrow_jax.rollout.refill_schedule.
simulate_refill`, the static engine's from :func:`static_chunks`, timed at contexts and table
widths a device can hold (``scripts/bench_rollout.py --phase refill-model``).

Model, for a decode step of S slots at table width W whose running rows hold c_1 .. c_m
tokens::

    t = A_S(W) + sum_i h(c_i)

``A_S(W)``: the step with every slot at a short context in a W-wide table (the weights, the
LM head and sampling of every slot, idle ones included, and what the kernels spend on the
table's width: the sparse selection holds each row's whole table). ``h(c) = (T_b(c) -
A_b(W_c)) / b``: what one row at context c adds, from ``T_b(c)``, the step with a batch of b
rows all at c (measured at the width ``W_c`` a batch at c gets). ``h`` comes from a batch
whose cache fits at full length (the static engine's); ``A_S`` for more slots from rows that
hold only a short context's pages (``profile.fixed_context_batch(max_context=)``), so the
model prices slot counts whose full-length cache would not fit. Linear between the measured
contexts and widths; a chunk of k steps is priced at its rows' mid-chunk contexts
``c_i + k / 2``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparrow_jax.rollout.decode_loop import table_width
from sparrow_jax.rollout.refill_schedule import simulate_refill


@dataclasses.dataclass(frozen=True)
class SlotStepTimes:
    """Measured step times of one slot count. ``widths``/``width_ms`` ``[w]``: ``A`` per table
    width; ``contexts``/``row_ms`` ``[c]``: ``h`` per context (ascending), per row whatever
    the slot count."""

    slots: int
    widths: np.ndarray
    width_ms: np.ndarray
    contexts: np.ndarray
    row_ms: np.ndarray

    @classmethod
    def from_points(cls, slots: int, short: list[tuple[int, float]],
                    full: list[tuple[int, int, float]]) -> "SlotStepTimes":
        """``short``: (width, step ms) with every slot at a short context; ``full``: (context,
        width, step ms) with every slot at that context."""
        if not short or len(full) < 2:
            raise ValueError("SlotStepTimes needs a short-context point and two contexts")
        short = sorted(short)
        widths = np.array([w for w, _ in short], np.float64)
        width_ms = np.array([t for _, t in short], np.float64)
        full = sorted(full)
        contexts = np.array([c for c, _, _ in full], np.float64)
        base = np.interp([w for _, w, _ in full], widths, width_ms)
        row_ms = (np.array([t for _, _, t in full]) - base) / slots
        return cls(slots, widths, width_ms, contexts, row_ms)

    def with_slots(self, slots: int, short: list[tuple[int, float]]) -> "SlotStepTimes":
        """These per-row costs with the per-step term ``A`` of ``slots`` slots, from ``short``:
        (width, step ms) with every one of them at a short context."""
        if not short:
            raise ValueError("with_slots needs a short-context point")
        short = sorted(short)
        return dataclasses.replace(
            self, slots=slots, widths=np.array([w for w, _ in short], np.float64),
            width_ms=np.array([t for _, t in short], np.float64))

    def step_ms(self, width: int, contexts) -> float:
        """One step at table ``width`` with running rows at ``contexts``."""
        rows = np.interp(np.asarray(contexts, np.float64), self.contexts, self.row_ms)
        return float(np.interp(width, self.widths, self.width_ms) + rows.sum())


def predict_seconds(chunks: list[dict], times: SlotStepTimes) -> float:
    """Seconds of decode steps in ``chunks`` (dicts of ``width``, ``steps``, ``contexts``)."""
    return sum(c["steps"] * times.step_ms(c["width"], np.asarray(c["contexts"]) + c["steps"] / 2)
               for c in chunks if c["steps"]) / 1e3


def static_chunks(prompt_lengths, caps, *, batch: int, page_size: int, steps_per_call: int,
                  width: int, table_bucket_pages: int | None = None) -> list[dict]:
    """The chunks of the static engine run on batches of ``batch`` consecutive prompts (one
    sample each) whose rows run to their caps: each batch is admitted whole and decodes until
    its longest row ends, its table as wide as its longest prompt plus the steps so far
    (``generate``'s reach), finished rows or not."""
    lengths, caps = np.asarray(prompt_lengths), np.asarray(caps)
    chunks = []
    for i in range(0, len(lengths), batch):
        part = slice(i, i + batch)
        need = (-(-(lengths[part] + caps[part]) // page_size)).sum() + 1
        ran = simulate_refill(lengths[part], caps[part], n=1, slots=len(lengths[part]),
                              num_pages=int(need), page_size=page_size,
                              steps_per_call=steps_per_call, width=width)[0]
        longest = int(lengths[part].max())
        for j, chunk in enumerate(ran):
            reach = longest + (j + 1) * steps_per_call + 1
            chunks.append({**chunk, "width": table_width(reach, page_size, width,
                                                         table_bucket_pages)})
    return chunks


__all__ = ["SlotStepTimes", "predict_seconds", "static_chunks"]
