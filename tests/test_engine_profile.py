"""Fixed-context profiling (sparrow_jax/rollout/profile.py): rows put at a context run the
engine's chunk from there, at the table and gather widths worked out here by hand."""

from __future__ import annotations

import jax
from jax._src import monitoring
from jax._src.dispatch import BACKEND_COMPILE_EVENT
import numpy as np
import pytest

from conftest import TINY_ENGINE
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rollout.engine import RolloutConfig, decode_chunk
from sparrow_jax.rollout.profile import _normal_like, at_context, fixed_context_batch, time_context
from sparrow_jax.schedule import BudgetSchedule

P = 4
CFG = TINY_ENGINE


def test_time_context_runs_the_engine_chunk_at_the_context():
    model = init_model(CFG, seed=0)
    config = RolloutConfig(n=2, max_new_tokens=40, page_size=P, prompt_multiple=16,
                           steps_per_call=4, dense_layers=(0,), table_bucket_pages=1)
    batch, graphdef, params, state = fixed_context_batch(
        model, config, rows=4, prompt_len=5, key=jax.random.key(0),
        schedule=BudgetSchedule.fixed(5, page_size=P))
    assert np.abs(np.asarray(state.cache.k_pages[1])).max() > 0     # the pool was filled
    put = at_context(state, 13)
    np.testing.assert_array_equal(np.asarray(put.cache.lengths), [13] * 4)
    np.testing.assert_array_equal(np.asarray(put.response_lengths), [13 - 5 + 1] * 4)
    assert bool(np.all(np.asarray(put.active)))

    compiles, per_chunk = [], []
    monitoring.register_event_duration_secs_listener(
        lambda event, _, **kw: compiles.append(event == BACKEND_COMPILE_EVENT))

    def run(st, reach):   # the default chunk, counting the compilations each call makes
        before = sum(compiles)
        st = jax.block_until_ready(decode_chunk(batch, graphdef, params, st, reach=reach)[0])
        per_chunk.append(sum(compiles) - before)
        return st

    state, timing = time_context(batch, graphdef, params, put, 20, repeats=2, run=run)
    # The untimed chunk compiles; the timed ones reuse it (an uncommitted start state compiled
    # the first timed chunk a second time: 131 ms a step instead of 10 on an H100).
    assert per_chunk[0] >= 1 and per_chunk[1:] == [0, 0], per_chunk
    # Two chunks of 4 steps, mean context 20: from 16 to 24 tokens; the call reaches 25 tokens
    # = 7 pages -> a table of 8 columns (of the full ceil((16 + 40) / 4) = 14); gathers 5.
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), [24] * 4)
    assert timing.mean_context == 20 and timing.table_width == 8
    assert timing.gather_width == 5 and len(timing.step_seconds) == 2
    assert all(t > 0 for t in timing.step_seconds)
    # A chunk that did not advance the rows is reported.
    with pytest.raises(RuntimeError, match="rows stopped"):
        time_context(batch, graphdef, params, state, 20, repeats=1, run=lambda st, reach: st)


def _pool(state) -> list:
    c = state.cache
    return [x for arrays in (c.k_pages, c.v_pages, c.centroids, c.kmin, c.kmax)
            if arrays is not None for x in arrays]


def test_profile_holds_one_pool():
    """The profile's memory is one pool (+ weights + a step's temporaries), as the benchmark's
    own loop had it: the fill writes each layer in place without temporaries, at_context
    shares the pool with the state it was given, and a chunk updates it in place. A jitted
    at_context copied the pool (and a float32 normal fill needed 8 layers of temporaries):
    out of memory on GPUs where the pool alone fit."""
    model = init_model(CFG, seed=0)
    config = RolloutConfig(n=1, max_new_tokens=64, page_size=P, steps_per_call=4,
                           table_bucket_pages=None)
    batch, graphdef, params, state = fixed_context_batch(
        model, config, rows=2, prompt_len=5, key=jax.random.key(0))
    layer = state.cache.k_pages[0]
    fill = _normal_like.lower(layer, np.uint32(1)).compile().memory_analysis()
    assert fill.alias_size_in_bytes == layer.nbytes
    assert fill.temp_size_in_bytes <= layer.nbytes // 16, fill.temp_size_in_bytes
    values = np.concatenate([np.asarray(x, np.float64).ravel() for x in _pool(state)])
    assert abs(values.mean()) < 0.05 and abs(values.std() - 1) < 0.05   # ~N(0, 1), filled

    pointers = [x.unsafe_buffer_pointer() for x in _pool(state)]
    put = at_context(state, 13)
    assert [x.unsafe_buffer_pointer() for x in _pool(put)] == pointers
    for new, old in ((put.cache.lengths, state.cache.lengths), (put.finish, state.finish),
                     (put.response_lengths, state.response_lengths)):
        assert new.sharding == old.sharding   # the chunk's own layout: no second compilation
    state, _ = decode_chunk(batch, graphdef, params, put, reach=30)
    assert all(x.is_deleted() for x in _pool(put))                     # donated
    assert [x.unsafe_buffer_pointer() for x in _pool(state)] == pointers   # updated in place


def test_short_rows_in_a_wide_table():
    """``max_context``: 5 rows holding the pages of 12 tokens each (3 of 4 tokens) in a pool of
    just those (+ the null page), their tables at the config's full width (the prompt padded to
    8, + 40: 12 columns) with the rest on the null page. A ``min_width`` chunk at a short
    context reads a wide table (a short row beside a long one) and decodes what the narrow
    table decodes."""
    model = init_model(CFG, seed=0)
    config = RolloutConfig(n=1, max_new_tokens=40, page_size=P, steps_per_call=4,
                           temperature=1.0, dense_layers=(0,), table_bucket_pages=1,
                           prompt_multiple=8, pool_multiple=1, num_pages=999)
    sched = BudgetSchedule.fixed(3, page_size=P)

    def build():
        return fixed_context_batch(model, config, rows=5, prompt_len=5, key=jax.random.key(0),
                                   schedule=sched, max_context=12)

    batch, graphdef, params, state = build()
    table = np.asarray(batch.layout.page_table)
    assert table.shape == (5, 12) and batch.layout.num_pages == 5 * 3 + 1
    own = table[:, :3]
    assert (table[:, 3:] == 0).all() and sorted(own.ravel()) == list(range(1, 16))
    np.testing.assert_array_equal(batch.layout.prompt_caps, [7] * 5)
    # Asked for mean 9: one chunk from 6 to 10 tokens (mean 8), the start clamped so that the
    # rows stay short of their 12 tokens (limit 11, minus the span, minus 1).
    state, t1 = time_context(batch, graphdef, params, state, 9, repeats=1)
    assert t1.table_width == 4 and t1.mean_context == 8
    batch, graphdef, params, wide = build()             # the same start, in a wide table
    wide, t2 = time_context(batch, graphdef, params, wide, 9, repeats=1, min_width=12)
    assert t2.table_width == 12
    np.testing.assert_array_equal(np.asarray(wide.tokens), np.asarray(state.tokens))
    np.testing.assert_allclose(np.asarray(wide.logprobs), np.asarray(state.logprobs), rtol=1e-6)
    assert len({tuple(r) for r in np.asarray(state.tokens)[:, 6:11]}) > 1   # rows differ
    # One row running, the others finished where they stand: only the first advances.
    state, t4 = time_context(batch, graphdef, params, state, 9, repeats=1, live=1)
    lengths, finish = np.asarray(state.cache.lengths), np.asarray(state.finish)
    assert t4.mean_context == 8 and lengths[0] == 10 and (lengths[1:] == 6).all()
    assert finish[0] == -1 and (finish[1:] == 2).all()
    # Asked past its pages: the same clamp.
    _, t3 = time_context(batch, graphdef, params, state, 40, repeats=1)
    assert t3.mean_context == 8
    with pytest.raises(ValueError, match="max_context=5 must lie in"):
        fixed_context_batch(model, config, rows=5, prompt_len=5, key=jax.random.key(0),
                            max_context=5)
