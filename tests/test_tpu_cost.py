"""The TPU cost model (sparrow_jax/tpu_cost.py) on cases worked by hand."""

from __future__ import annotations

import pytest

from sparrow_jax.tpu_cost import dense_cost, estimate_table, sparse_cost


def test_dense_counts_every_page_once():
    # 1 sequence, 1 KV head, 40 tokens of d=128 bf16 in pages of 16: K and V, 3 pages each.
    c = dense_cost(1, 40, kv_heads=1, page_size=16)
    assert c.bytes == 2 * 40 * 128 * 2 and c.copies == 6
    # v5e: 20,480 B / 819 GB/s = 25 ns; 6 copies x 10 ns = 60 ns bounds it.
    assert c.seconds("v5e", 10e-9) == pytest.approx(60e-9)
    assert c.seconds("v5e", 0.0) == pytest.approx(20480 / 819e9)


def test_sparse_parts_by_hand():
    # Batch 2, 1 KV head, 64 tokens = 4 pages of 16, budget 2 pages (32 tokens).
    c = sparse_cost(2, 64, 32, kv_heads=1, page_size=16, copies_per_page=0.5)
    assert c.parts["centroids"] == 8 * 128 * 2                 # pool of 2 x 4 pages
    assert c.parts["scores"] == 2 * 8 * 4 + 2 * 4 * 4           # [B, pool] written, [B, M] read
    assert c.parts["kv"] == 2 * 2 * 2 * 16 * 128 * 2            # K+V, 2 rows, 2 pages
    assert c.copies == 2 * 2 * 2 * 0.5 + 1                       # + one scoring tile
    assert c.bytes == sum(c.parts.values())


def test_budget_beyond_the_context_reads_what_dense_reads():
    # 1000 tokens are 63 pages; the partial page is copied whole (1008 tokens).
    assert sparse_cost(4, 1000, 10**6).parts["kv"] == dense_cost(4, 1008).bytes


def test_table_has_a_row_per_case():
    lines = estimate_table(batches=(8,), page_sizes=(16, 64)).splitlines()
    assert len(lines) == 2 + 2 * 2
