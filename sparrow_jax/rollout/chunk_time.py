"""The decode time of a run's chunks predicted from fixed-context step times (docs/design.md,
section 11): a refill run's chunks from :func:`~sparrow_jax.rollout.refill_schedule.
simulate_refill`, the static engine's from :func:`static_chunks`, timed at contexts and table
widths a device can hold (``scripts/bench_rollout.py --phase refill-model``).

Model, for a decode step of S slots at table width W whose running rows hold c_1 >= c_2 >=
.. >= c_m tokens::

    t = A_S(W) + g(c_1) + sum_{i > 1} h(c_i)

``A_S(W)``: the step with every slot at a short context in a W-wide table (the weights, the
LM head and sampling of every slot, idle ones included, and what the kernels spend on the
table's width: the sparse selection holds each row's whole table). ``g(c) = T_1(c) - A_b(W_c)``:
what the longest row adds on its own, from ``T_1(c)``, a batch of b rows of which one runs at
c (the others finished): alone, a row's attention runs at its kernels' latency, not at a
share of the bandwidth. ``h(c) = (T_b(c) - T_1(c)) / (b - 1)``: what each further row at c
adds, ``T_b(c)`` the step with all b rows at c. ``T`` is measured at the width ``W_c`` a batch
at c gets, on a batch whose cache fits at full length (the static engine's); ``A_S`` for more
slots from rows that hold only a short context's pages (``profile.fixed_context_batch(
max_context=)``), so the model prices slot counts whose full-length cache would not fit.
Linear between the measured contexts and widths; a chunk of k steps is priced at its rows'
mid-chunk contexts ``c_i + k / 2``. Without ``T_1``, ``g = h = (T_b - A_b) / b``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparrow_jax.rollout.decode_loop import table_width
from sparrow_jax.rollout.refill_schedule import simulate_refill


@dataclasses.dataclass(frozen=True)
class SlotStepTimes:
    """Measured step times of one slot count. ``widths``/``width_ms`` ``[w]``: ``A`` per table
    width; ``contexts`` ``[c]`` (ascending), ``lone_ms``/``row_ms`` ``[c]``: ``g`` and ``h``
    there, per row whatever the slot count."""

    slots: int
    widths: np.ndarray
    width_ms: np.ndarray
    contexts: np.ndarray
    row_ms: np.ndarray
    lone_ms: np.ndarray

    @classmethod
    def from_points(cls, slots: int, short: list[tuple[int, float]],
                    full: list[tuple[int, int, float]],
                    lone: list[tuple[int, int, float]] | None = None) -> "SlotStepTimes":
        """``short``: (width, step ms) with every slot at a short context; ``full``: (context,
        width, step ms) with every slot at that context; ``lone``: the same with one row
        running (at least two contexts, those of ``full``)."""
        if not short or len(full) < 2:
            raise ValueError("SlotStepTimes needs a short-context point and two contexts")
        short = sorted(short)
        widths = np.array([w for w, _ in short], np.float64)
        width_ms = np.array([t for _, t in short], np.float64)
        full = sorted(full)
        contexts = np.array([c for c, _, _ in full], np.float64)
        base = np.interp([w for _, w, _ in full], widths, width_ms)
        total = np.array([t for _, _, t in full])
        if lone is None:
            row_ms = lone_ms = (total - base) / slots
        else:
            lone = sorted(lone)
            if [(c, w) for c, w, _ in lone] != [(c, w) for c, w, _ in full] or slots < 2:
                raise ValueError("lone needs the contexts and widths of full, and 2+ slots")
            one = np.array([t for _, _, t in lone])
            lone_ms, row_ms = one - base, (total - one) / (slots - 1)
        return cls(slots, widths, width_ms, contexts, row_ms, lone_ms)

    def with_slots(self, slots: int, short: list[tuple[int, float]]) -> "SlotStepTimes":
        """These per-row costs with the per-step term ``A`` of ``slots`` slots, from ``short``:
        (width, step ms) with every one of them at a short context."""
        if not short:
            raise ValueError("with_slots needs a short-context point")
        short = sorted(short)
        return dataclasses.replace(
            self, slots=slots, widths=np.array([w for w, _ in short], np.float64),
            width_ms=np.array([t for _, t in short], np.float64))

    def rows_only(self) -> "SlotStepTimes":
        """These times without the per-step term ``A``: a run's rows' own cost (their K/V
        reads and per-row work), which no number of slots removes. A static run's time over
        the refill chunks' ``rows_only`` cost bounds what refill can gain over it."""
        return dataclasses.replace(self, width_ms=np.zeros_like(self.width_ms))

    def step_ms(self, width: int, contexts) -> float:
        """One step at table ``width`` with running rows at ``contexts``."""
        ctx = np.sort(np.asarray(contexts, np.float64))
        t = float(np.interp(width, self.widths, self.width_ms))
        if ctx.size:
            t += float(np.interp(ctx[-1], self.contexts, self.lone_ms)
                       + np.interp(ctx[:-1], self.contexts, self.row_ms).sum())
        return t


def predict_seconds(chunks: list[dict], times: SlotStepTimes | dict[int, SlotStepTimes]
                    ) -> float:
    """Seconds of decode steps in ``chunks`` (dicts of ``width``, ``steps``, ``contexts``, and
    ``slots`` where ``times`` maps slot counts to their times: a run whose tail narrows)."""
    def of(c):
        return times[c["slots"]] if isinstance(times, dict) else times

    return sum(c["steps"] * of(c).step_ms(c["width"], np.asarray(c["contexts"]) + c["steps"] / 2)
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
