"""``sparrow_jax.benchmarking.chained``, the timed loop of the kernel benchmarks: both forms
apply the call the asked number of times (worked by hand), and the unrolled one has no XLA
while loop left, whose per-iteration cost on a GPU it exists to leave out."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from sparrow_jax.benchmarking import chained


@pytest.mark.parametrize("unroll", [False, True])
def test_applies_the_call_chain_times(unroll):
    # y -> 3y + 1 from 2: 7, 22, 67.
    run = chained(lambda y, a: y * a + 1, 3, unroll=unroll)
    assert float(run(jnp.float32(2), jnp.float32(3))) == 67.0
    hlo = run.lower(jnp.float32(2), jnp.float32(3)).as_text()
    assert ("while" in hlo) is not unroll
