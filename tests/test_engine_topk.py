"""The engine's top-k by group maxima (``rollout.decode_loop.top_k``) against ``lax.top_k``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.rollout.decode_loop import top_k


@pytest.mark.parametrize("v", [2000, 1187 * 128, 4096 + 5])
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_matches_lax(v, ties):
    rng = np.random.default_rng(v + ties)
    x = rng.normal(size=(3, v)).astype(np.float32)
    if ties:   # few distinct values: many ties, across groups and inside them
        x = np.round(x * 2) / 2
        x[1, :] = 0.0
    # A truncated distribution: 7 finite entries, so the top 20 hold -inf ties too.
    x[2, :] = -np.inf
    x[2, rng.choice(v, 7, replace=False)] = rng.normal(size=7)
    x = jnp.asarray(x)
    for k in (1, 20, 128):
        want = jax.lax.top_k(x, k)
        got = jax.jit(top_k, static_argnums=1)(x, k)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_top_k_small_vocabularies_and_large_k():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 300)).astype(np.float32))
    for k in (5, 300):
        np.testing.assert_array_equal(np.asarray(top_k(x, k)[1]),
                                      np.asarray(jax.lax.top_k(x, k)[1]))
    y = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5000)).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(top_k(y, 200)[1]),
                                  np.asarray(jax.lax.top_k(y, 200)[1]))
