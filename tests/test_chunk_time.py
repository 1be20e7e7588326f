"""Chunk-time predictions (sparrow_jax/rollout/chunk_time.py) against hand-worked examples."""

from __future__ import annotations

import numpy as np
import pytest

from sparrow_jax.rollout.chunk_time import SlotStepTimes, predict_seconds, static_chunks


def test_step_model_by_hand():
    # 2 slots. A(4) = 1 ms, A(8) = 2 ms; all rows at 10 tokens (width 4): 3 ms -> one row adds
    # (3 - 1) / 2 = 1 ms; at 20 tokens (width 8): 6 ms -> (6 - 2) / 2 = 2 ms.
    times = SlotStepTimes.from_points(2, [(8, 2.0), (4, 1.0)], [(20, 8, 6.0), (10, 4, 3.0)])
    np.testing.assert_allclose(times.row_ms, [1.0, 2.0])
    # Width 6: A = 1.5; one row at 15: 1.5; another at 10: 1.0.
    assert times.step_ms(6, [15]) == pytest.approx(3.0)
    assert times.step_ms(6, [15, 10]) == pytest.approx(4.0)
    # Two steps from 14 tokens: priced at 15; a chunk of no steps costs nothing.
    chunks = [dict(width=6, steps=2, contexts=[14]), dict(width=8, steps=0, contexts=[20])]
    assert predict_seconds(chunks, times) == pytest.approx(2 * 3.0e-3)
    with pytest.raises(ValueError, match="two contexts"):
        SlotStepTimes.from_points(2, [(4, 1.0)], [(10, 4, 3.0)])
    # 5 slots whose short-context step is 4 ms at width 4 and 6 ms at 8: the rows' costs stay.
    five = times.with_slots(5, [(8, 6.0), (4, 4.0)])
    assert five.slots == 5 and five.step_ms(6, [15, 10]) == pytest.approx(5.0 + 1.5 + 1.0)
    with pytest.raises(ValueError, match="short-context point"):
        times.with_slots(5, [])
    # A narrowed tail: each chunk at its own slot count's times, 2 steps at 5 slots (7.5 ms)
    # then 3 at 2 (3 ms).
    tail = [dict(width=6, steps=2, slots=5, contexts=[14, 9]), dict(width=6, steps=3, slots=2,
                                                                    contexts=[13.5])]
    assert predict_seconds(tail, {5: five, 2: times}) == pytest.approx(
        (2 * 7.5 + 3 * 3.0) * 1e-3)


def test_lone_row_by_hand():
    # The example above with one row running alone: 2.5 ms at 10 tokens (it adds 1.5, the
    # second row (3 - 2.5) = 0.5), 4 ms at 20 (adds 2, the second 6 - 4 = 2).
    times = SlotStepTimes.from_points(2, [(8, 2.0), (4, 1.0)], [(20, 8, 6.0), (10, 4, 3.0)],
                                      lone=[(10, 4, 2.5), (20, 8, 4.0)])
    np.testing.assert_allclose(times.lone_ms, [1.5, 2.0])
    np.testing.assert_allclose(times.row_ms, [0.5, 2.0])
    # Width 6 (A = 1.5): the longer row (15) alone adds g(15) = 1.75, the other h(10) = 0.5.
    assert times.step_ms(6, [10, 15]) == pytest.approx(1.5 + 1.75 + 0.5)
    assert times.step_ms(6, []) == pytest.approx(1.5)
    # Without the per-step term only the rows' own cost is left: 1.75 + 0.5.
    assert times.rows_only().step_ms(6, [10, 15]) == pytest.approx(2.25)
    assert times.rows_only().step_ms(6, []) == 0.0
    with pytest.raises(ValueError, match="contexts and widths of full"):
        SlotStepTimes.from_points(2, [(4, 1.0)], [(20, 8, 6.0), (10, 4, 3.0)],
                                  lone=[(10, 4, 2.5)])


def test_static_chunks_by_hand():
    # Prompts of 5 and 3 tokens, caps 4 and 9, one batch, 3 steps a call, pages of 4. After
    # the prefill each row has sampled 1 token: row 0 needs 3 more, row 1 8 more.
    # chunk 0: both rows, 3 steps (row 0 ends); chunk 1: row 1 at 6, 3 steps;
    # chunk 2: row 1 at 9, its last 2 steps. The table covers the longest prompt (5) + the
    # steps so far + 3 + 1: 9, 12, 15 tokens -> 3, 3, 4 pages -> the next powers of two: 4
    # columns each (of the full width 5; without buckets, 5).
    chunks = static_chunks([5, 3], [4, 9], batch=2, page_size=4, steps_per_call=3, width=5,
                           table_bucket_pages=1)
    assert [(c["width"], c["steps"], list(c["contexts"])) for c in chunks] == [
        (4, 3, [5, 3]), (4, 3, [6]), (4, 2, [9])]
    # Two batches of one prompt each: the second starts afresh.
    chunks = static_chunks([5, 3], [4, 9], batch=1, page_size=4, steps_per_call=3, width=5,
                           table_bucket_pages=None)
    assert [(c["width"], c["steps"], list(c["contexts"])) for c in chunks] == [
        (5, 3, [5]), (5, 3, [3]), (5, 3, [6]), (5, 2, [9])]
