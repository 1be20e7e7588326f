"""A cost model of one attention layer's decode step on TPU, dense beside sparse: bytes moved
between HBM and VMEM, DMA copies issued, and a time estimate from both.

An estimate until a TPU measures it. Time is ``max(bytes / HBM bandwidth, copies x per-copy
cost / TensorCores)``: copies are issued by each core's scalar unit while earlier ones stream,
so whichever of the two runs out first bounds the step. The per-copy cost is an input, not a
measured figure; :data:`ISSUE_COSTS_S` brackets it.
"""

from __future__ import annotations

import dataclasses
import math

from pallas_kernels.sparse_decode_tpu import default_block_pages
from pallas_kernels.tpu_targets import CHIPS

# Two assumed per-copy costs (seconds), not measured: 5 ns, about the time a 4 KiB page (P=16,
# d=128, bf16) takes to stream at v5e's bandwidth, so that page-16 copies and bytes cost alike;
# and 25 ns, five times that (a few tens of scalar-unit cycles per descriptor and semaphore
# wait). At 0.1 us or more a copy, jax's own paged attention (one copy per page) would take
# ~100 ms per layer at batch 32, 32K, far from what TPU serving reports, so the cost must be
# tens of nanoseconds at most.
ISSUE_COSTS_S = (5e-9, 25e-9)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """bytes: HBM traffic of the step; copies: DMAs issued; per-part bytes for the table."""
    bytes: float
    copies: float
    parts: dict

    def seconds(self, chip: str, issue_cost_s: float) -> float:
        c = CHIPS[chip]
        return max(self.bytes / c.hbm_bytes_per_s, self.copies * issue_cost_s / c.cores)


def dense_cost(batch, context, *, kv_heads=8, head_dim=128, page_size=16, dtype_bytes=2):
    """jax's TPU paged attention over the whole context: K and V of every page, one copy per
    page (its copies are per page, grouped into blocks)."""
    pages = math.ceil(context / page_size)
    kv = 2 * batch * kv_heads * context * head_dim * dtype_bytes
    return StepCost(kv, 2 * batch * kv_heads * pages, {"kv": kv})


def sparse_cost(batch, context, budget_tokens, *, kv_heads=8, head_dim=128, page_size=16,
                dtype_bytes=2, copies_per_page=1.0, score_tile=512):
    """The TPU kernels of :mod:`pallas_kernels.sparse_decode_tpu`, the pool full (``batch x
    pages`` pages, as the engine sizes it). ``copies_per_page``: copies per chosen page, 1 for
    scattered pages, less where chosen neighbours are adjacent in the pool and coalesce."""
    m = math.ceil(context / page_size)
    pool = batch * m
    chosen = min(m, math.ceil(budget_tokens / page_size))
    kpad = -(-chosen // default_block_pages(page_size)) * default_block_pages(page_size)
    parts = {
        # Every pool page's centroid, read in tiles of score_tile pages.
        "centroids": kv_heads * pool * head_dim * dtype_bytes,
        # Scores of every sequence against every pool page (float32), written and gathered:
        # this term grows with batch x pool, i.e. with the square of the batch.
        "scores": kv_heads * batch * pool * 4 + batch * kv_heads * m * 4,
        # Keys written and read, ranks written and read, lists written and read (int32).
        "selection": batch * kv_heads * (4 * m + 2 * kpad) * 4,
        "kv": 2 * batch * kv_heads * chosen * page_size * head_dim * dtype_bytes,
    }
    copies = (2 * batch * kv_heads * chosen * copies_per_page
              + kv_heads * math.ceil(pool / score_tile))
    return StepCost(sum(parts.values()), copies, parts)


def estimate_table(batches=(8, 32, 64), context=32768, budget_tokens=2048,
                   page_sizes=(16, 32, 64), chips=("v5e", "v5p", "v6e"),
                   issue_costs=ISSUE_COSTS_S, copies_per_page=None) -> str:
    """The markdown table of :func:`dense_cost` and :func:`sparse_cost` (Qwen3 8 KV heads,
    d = 128, bf16) per batch, page size and chip, times in microseconds per layer for each
    per-copy cost. ``copies_per_page``: {page_size: rate} measured elsewhere (default 1)."""
    copies_per_page = copies_per_page or {}
    head = ["batch", "page", "kind", "MB", "copies"] + [
        f"{chip} us ({c * 1e6:g} us/copy)" for chip in chips for c in issue_costs]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in batches:
        for p in page_sizes:
            for kind, cost in (
                    ("dense", dense_cost(b, context, page_size=p)),
                    ("sparse", sparse_cost(b, context, budget_tokens, page_size=p,
                                           copies_per_page=copies_per_page.get(p, 1.0)))):
                times = [f"{cost.seconds(chip, c) * 1e6:,.0f}" for chip in chips
                         for c in issue_costs]
                rows.append("| " + " | ".join([str(b), str(p), kind, f"{cost.bytes / 1e6:,.0f}",
                                               f"{cost.copies:,.0f}", *times]) + " |")
    return "\n".join(rows)
