"""The refill scheduler replayed without a device (``simulate_refill``) against real refill runs
whose rows run to their caps: the same chunks (table width, steps, every row's context) and the
same counts, with preemption, admission in calls of a few rows and table-width buckets."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import random_prompts
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rollout.engine import RolloutConfig
from sparrow_jax.rollout.refill import run_refill
from sparrow_jax.rollout.refill_schedule import simulate_refill

P, V, N, R = 4, 48, 3, 12
CFG = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
LENGTHS = (5, 8, 21, 3, 13)
CAPS = (3, 12, 7, 1, 9)      # prompt 3's rows finish at their prefill


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


@pytest.mark.parametrize("slots,pool,prefill_rows,bucket,tail", [
    (2, 11, 2, None, None), (5, 11, None, None, None), (4, 200, 2, 4, None),
    (8, 11, 2, None, 1), (16, 200, 4, None, 2)])
def test_simulated_chunks_are_the_real_ones(model, slots, pool, prefill_rows, bucket, tail):
    prompts = random_prompts(LENGTHS, vocab=V)
    config = RolloutConfig(n=N, max_new_tokens=R, temperature=1.0, page_size=P,
                           prompt_multiple=32, steps_per_call=3, page_seed=3, eos_ids=(),
                           table_bucket_pages=bucket, num_pages=pool)
    real = []
    _, stats = run_refill(model, prompts, config, jax.random.key(1), slots=slots,
                          prefill_rows=prefill_rows, max_new_tokens=CAPS, on_chunk=real.append,
                          tail_slots=tail)
    width = -(-(32 + R) // P)     # the padded prompt width + R, in pages
    sim, sim_stats = simulate_refill(LENGTHS, CAPS, n=N, slots=slots, num_pages=pool,
                                     page_size=P, steps_per_call=3, width=width,
                                     prefill_rows=prefill_rows, table_bucket_pages=bucket,
                                     page_seed=3, tail_slots=tail)
    assert sim_stats == stats
    assert len(sim) == len(real) == stats.chunks
    assert sum(r["prefills"] for r in real) == stats.prefills
    assert all(r["chunk_seconds"] > 0 for r in real)
    for i, (s, r) in enumerate(zip(sim, real)):
        assert (s["width"], s["steps"], s["slots"]) == (r["width"], r["steps"], r["slots"]), i
        np.testing.assert_array_equal(s["contexts"], r["contexts"], err_msg=str(i))
    if slots == 5:             # the small pool preempted
        assert stats.preemptions > 0
    if bucket is not None:     # the widths followed the longest row
        assert len({c["width"] for c in real}) >= 2
    slot_counts = [c["slots"] for c in real]
    if tail is None:
        assert set(slot_counts) == {slots}
    else:                      # the tail ran narrower, never widening again
        assert slot_counts[0] == slots and min(slot_counts) < slots
        assert slot_counts == sorted(slot_counts, reverse=True)


def test_growth_continues_a_contiguous_run():
    from sparrow_jax.rollout.refill_schedule import GrowingPageAllocator

    alloc = GrowingPageAllocator(20, 4, contiguous=True)
    a = alloc.allocate([6], 1, 2)                  # 8 tokens: pages 1, 2
    b = alloc.allocate([3], 1, 1)                  # page 3
    np.testing.assert_array_equal(a.page_table[0], [1, 2])
    np.testing.assert_array_equal(b.page_table[0], [3])
    np.testing.assert_array_equal(alloc.extend(int(b.seq_ids[0]), 3), [4, 5, 6])   # goes on
    # a's next page (3) is b's: the lowest free run of 2 instead
    np.testing.assert_array_equal(alloc.extend(int(a.seq_ids[0]), 2), [7, 8])
    np.testing.assert_array_equal(alloc.extend(int(a.seq_ids[0]), 1), [9])        # goes on
    alloc.release(int(b.seq_ids[0]))
    assert alloc.num_free == 19 - 5
    # without contiguous: the free list's order
    plain = GrowingPageAllocator(20, 4, seed=0)
    c = plain.allocate([3], 1, 1)
    got = plain.extend(int(c.seq_ids[0]), 2)
    assert got.tolist() != list(range(c.page_table[0, 0] + 1, c.page_table[0, 0] + 3))


def test_contiguous_refill_samples_as_scattered(model):
    """Placement changes nothing a row computes: the same tokens with contiguous pages, and the
    same chunks as the replay."""
    prompts = random_prompts(LENGTHS, vocab=V)
    outs = []
    for contiguous in (False, True):
        config = RolloutConfig(n=N, max_new_tokens=R, temperature=1.0, page_size=P,
                               prompt_multiple=32, steps_per_call=3, eos_ids=(),
                               table_bucket_pages=None, num_pages=40,
                               contiguous_pages=contiguous)
        outs.append(run_refill(model, prompts, config, jax.random.key(1), slots=5,
                               max_new_tokens=CAPS)[0])
    np.testing.assert_array_equal(np.asarray(outs[0].tokens), np.asarray(outs[1].tokens))
    np.testing.assert_allclose(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs),
                               rtol=1e-6, atol=1e-6)
