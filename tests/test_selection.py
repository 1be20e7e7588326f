"""Page scores and block top-k selection against the float64 NumPy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reference_np import centroid_score_np, quest_score_np, select_pages_np
from sparrow_jax.attention.selection import (centroid_scores, num_pages, page_centroids,
                                             page_minmax, quest_scores, select_pages)


def test_select_pages_with_many_ties():
    """Integer scores from a small range tie constantly; every (n, budget) pair of a grid,
    including n <= budget (dense) and the minimum budget 3."""
    rng = np.random.default_rng(0)
    m = 24
    ns, budgets = np.meshgrid(np.arange(1, m + 1), np.arange(3, m + 3), indexing="ij")
    ns, budgets = ns.ravel(), budgets.ravel()
    scores = rng.integers(-3, 4, size=(ns.size, m)).astype(np.float32)
    got = np.asarray(jax.jit(select_pages)(jnp.asarray(scores), jnp.asarray(ns),
                                           jnp.asarray(budgets)))
    for row, n, bud, s in zip(got, ns, budgets, scores):
        want = np.zeros(m, bool)
        want[select_pages_np(s, n, bud)] = True
        np.testing.assert_array_equal(row, want, err_msg=f"n={n} budget={bud} scores={s}")


def test_hand_worked_selection():
    # n = 8 pages, budget 5: keep 0, 6, 7; among 1..5 the two best of [., 4, 9, 9, 1, 9]:
    # the 9s at 2, 3, 5 tie and the lower indices 2, 3 win.
    scores = jnp.asarray([100.0, 4, 9, 9, 1, 9, -50, -50, 99, 99])
    got = np.flatnonzero(np.asarray(select_pages(scores, 8, 5)))
    assert got.tolist() == [0, 2, 3, 6, 7]
    # Signed zeros tie too: -0.0 and 0.0 are equal scores.
    scores = jnp.asarray([0.0, -1.0, -0.0, 0.0, -0.0, 0.0])
    assert np.flatnonzero(np.asarray(select_pages(scores, 6, 4))).tolist() == [0, 2, 4, 5]


def test_scores_against_numpy():
    rng = np.random.default_rng(1)
    hkv, r, n, p, d = 2, 3, 5, 4, 8
    q = rng.standard_normal((hkv, r, d)).astype(np.float32)
    k = rng.standard_normal((hkv, n, p, d)).astype(np.float32)
    c = page_centroids(jnp.asarray(k))
    got_c = np.asarray(centroid_scores(jnp.asarray(q), c))
    got_q = np.asarray(quest_scores(jnp.asarray(q), *page_minmax(jnp.asarray(k))))
    for h in range(hkv):
        for j in range(n):
            assert got_c[h, j] == pytest.approx(centroid_score_np(q[h], k[h, j]), abs=1e-5)
            assert got_q[h, j] == pytest.approx(quest_score_np(q[h], k[h, j]), abs=1e-5)


def test_num_pages():
    np.testing.assert_array_equal(np.asarray(num_pages(jnp.asarray([1, 15, 16, 17, 32]), 16)),
                                  [1, 1, 1, 2, 2])


def test_signed_zero_ties_go_to_the_lower_page_under_jit():
    """-0.0 and 0.0 tie (to the lower page), jitted as in the engine, in the reference and in the
    kernels' order keys: XLA folds "x + 0.0" to x, which had left -0.0 below 0.0 in the keys of
    the decode and selection kernels (seen in interpret mode)."""
    from sparrow_jax.attention.selection import order_key, select_pages

    scores = jnp.array([9.0, 5.0, -0.0, -1.0, 0.0, -2.0, 9.0, 9.0], jnp.float32)
    chosen = jax.jit(select_pages)(scores, jnp.int32(8), jnp.int32(5))     # k = 2
    assert np.flatnonzero(np.asarray(chosen)).tolist() == [0, 1, 2, 6, 7]
    keys = np.asarray(jax.jit(order_key)(scores))
    assert keys[2] == keys[4] == 0 and keys[3] < keys[2] < keys[1]
