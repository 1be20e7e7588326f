"""Measure how many DMA copies per chosen page the TPU sparse kernels issue (runs of chosen pages
adjacent in the pool are one copy per power-of-two piece, cut at blocks of block_pages), for
pages handed out scattered or by PageAllocator(contiguous=True), under two score patterns:
"topics" (random keys with page topics: the pages' scores are independent draws) and "local"
(a sink and recency pattern: scores rise with position, so the most recent pages are chosen).
Prints a markdown table; feed the rates to scripts/estimate_tpu.py --copies-per-page."""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_decode_tpu import default_block_pages, page_lists
from sparrow_jax.attention.allocator import PageAllocator
from sparrow_jax.attention.selection import select_pages


def copies_per_page(scores, table, lengths, budget, page_size):
    """Copies the attention kernel issues per chosen page, over all rows (one KV head)."""
    b, m = table.shape
    n = -(-lengths // page_size)
    mask = np.asarray(select_pages(jnp.asarray(scores, jnp.float32), jnp.asarray(n),
                                   jnp.full((b,), budget)))
    rank = np.where(mask, np.cumsum(mask, axis=1) - 1, -1)[:, None, :]
    bp = default_block_pages(page_size)
    kpad = -(-m // bp) * bp
    _, runs, count = map(np.asarray, page_lists(jnp.asarray(rank), jnp.asarray(table),
                                                kpad=kpad, block_pages=bp, coalesce=True))
    copies = 0
    for row in range(b):
        i = 0
        while i < count[row, 0]:
            length = int(runs[row, 0, i])
            copies += bin(length).count("1")
            i += length
    return copies / count.sum()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget-tokens", type=int, default=2048)
    ap.add_argument("--contexts", default="8192,32768")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print("| context | page | pattern | scattered copies/page | contiguous copies/page |")
    print("|---|---|---|---|---|")
    for context in map(int, args.contexts.split(",")):
        for p in (16, 32, 64):
            m = context // p
            lengths = np.full(args.batch, context - p // 2)      # the last page partial
            tables = {}
            for name, contiguous, seed in (("scattered", False, 0), ("contiguous", True, 0)):
                alloc = PageAllocator(args.batch * m + 1, p, seed=seed, contiguous=contiguous)
                # Requests arrive in several batches, as in a refilling engine.
                rows = [alloc.allocate([context - p // 2] * 2).page_table
                        for _ in range(args.batch // 2)]
                tables[name] = np.concatenate(rows)
            for pattern in ("topics", "local"):
                if pattern == "topics":
                    scores = rng.standard_normal((args.batch, m))
                else:
                    scores = np.arange(m)[None, :] + 0.1 * rng.standard_normal((args.batch, m))
                rates = [copies_per_page(scores, tables[k], lengths, args.budget_tokens // p, p)
                         for k in ("scattered", "contiguous")]
                print(f"| {context} | {p} | {pattern} | {rates[0]:.3f} | {rates[1]:.3f} |")


if __name__ == "__main__":
    main()
