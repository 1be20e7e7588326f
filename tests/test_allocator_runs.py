"""PageAllocator(contiguous=True): each request's pages as runs of adjacent pool pages."""

from __future__ import annotations

import numpy as np

from sparrow_jax.attention.allocator import NULL_PAGE, PageAllocator, _runs_of


def test_runs_by_hand():
    free = np.array([9, 3, 4, 5, 12, 13, 14, 15, 20], np.int32)
    assert _runs_of(free, 3).tolist() == [3, 4, 5]               # lowest run that fits
    assert _runs_of(free, 4).tolist() == [12, 13, 14, 15]
    assert _runs_of(free, 6).tolist() == [12, 13, 14, 15, 3, 4]  # longest runs first


def test_contiguous_sequences_are_runs_and_release_recycles():
    alloc = PageAllocator(64, 16, contiguous=True, seed=0)        # seed: a shuffled free list
    a = alloc.allocate([100, 40], num_samples=[1, 2], max_new_tokens=30)
    rows = [a.page_table[i][a.page_table[i] != NULL_PAGE] for i in range(3)]
    assert np.all(np.diff(rows[0]) == 1)                          # 9 pages in one run
    for row in rows[1:]:                                          # shared 2 + own 3, each a run
        assert np.all(np.diff(row[:2]) == 1) and np.all(np.diff(row[2:]) == 1)
    used = np.concatenate(rows)
    assert len(set(rows[0]) | set(rows[1]) | set(rows[2])) == 9 + 2 + 3 + 3
    assert NULL_PAGE not in used and alloc.num_free == 63 - 17
    for sid in a.seq_ids:
        alloc.release(sid)
    assert alloc.num_free == 63
