"""``sparrow_jax.benchmarking.chained``, the timed loop of the kernel benchmarks: both forms
apply the call the asked number of times (worked by hand), and the unrolled one has no XLA
while loop left, whose per-iteration cost on a GPU it exists to leave out; ``slope_seconds``,
the per-call time from two chain lengths, against a hand-worked program time (and a longer
chain where noise hides the calls), each chain compiled once; and the marginal read ceiling's
chain, whose calls XLA must neither merge nor skip."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from sparrow_jax import benchmarking
from sparrow_jax.benchmarking import chained, chained_read, marginal_seconds, slope_seconds


@pytest.mark.parametrize("unroll", [False, True])
def test_applies_the_call_chain_times(unroll):
    # y -> 3y + 1 from 2: 7, 22, 67.
    run = chained(lambda y, a: y * a + 1, 3, unroll=unroll)
    assert float(run(jnp.float32(2), jnp.float32(3))) == 67.0
    hlo = run.lower(jnp.float32(2), jnp.float32(3)).as_text()
    assert ("while" in hlo) is not unroll


def test_slope_leaves_out_the_once_a_program_cost():
    # A program of n calls taking 0.3 ms once plus 50 us a call: 20 calls 1.3 ms, 80 calls
    # 4.3 ms; the slope between them is the 50 us, where 1.3 ms / 20 would say 65.
    got = slope_seconds(lambda n: 3e-4 + 5e-5 * n, 20, factor=4)
    assert got == pytest.approx(5e-5, rel=1e-12)
    with pytest.raises(ValueError, match="factor=1"):
        slope_seconds(lambda n: n, 20, factor=1)


def test_the_ceilings_chain_reads_once_a_call():
    # Four chained reductions stay four (none merged, none skipped): sum(x + s) * 1e-9 from
    # s = 0 over x = 1, 2, 3: 6e-9, then 6e-9 + 3 * 6e-9 * 1e-9 ~ 6e-9 again.
    run = chained(functools.partial(chained_read, jnp.sum), 4, unroll=True)
    x = jnp.arange(1, 4, dtype=jnp.float32)
    assert float(run(jnp.float32(0), x)) == pytest.approx(6e-9, rel=1e-6)
    hlo = run.lower(jnp.float32(0), x).compile().as_text()
    assert hlo.count(" reduce(") == 4


def test_slope_lengthens_the_chain_when_noise_hides_the_calls():
    # 10 us a call under a program cost whose noise made 4 calls time faster than 1: timed
    # again, the chain of 16 shows them, (0.67e-3 - 0.52e-3) / 15 = 10 us (by hand).
    times = {1: [0.52e-3, 0.53e-3], 4: [0.51e-3], 16: [0.67e-3]}
    asked = []
    got = slope_seconds(lambda n: asked.append(n) or times[n].pop(), 1, factor=4)
    assert got == pytest.approx(1e-5, rel=1e-9) and asked == [4, 1, 16, 1]
    with pytest.raises(ValueError, match="chains of 1 to 64 calls"):
        slope_seconds(lambda n: 1e-3, 1, factor=4)


def test_the_marginal_time_compiles_each_chain_once(monkeypatch):
    # A chain already built (and run) is reused, the caller's dict left as it was: timing the
    # slope traces the call once more, for the longer chain only (an unrolled chain traces its
    # call once, as one loop body).
    # Each chain "takes" its output as seconds: y -> y + 1 from 0 over n calls is n, so the
    # slope between 2 and 8 calls is 1 s a call (by hand).
    traced = []

    def call(y, a):
        traced.append(1)
        return y * a + 1
    monkeypatch.setattr(benchmarking, "median_seconds", lambda run, args, _: float(run(*args)))
    runs = {2: chained(call, 2, unroll=True)}
    runs[2](jnp.float32(0), jnp.float32(1))
    assert len(traced) == 1
    got = marginal_seconds(call, (jnp.float32(0), jnp.float32(1)), 2, repeats=1, runs=runs)
    assert got == 1.0 and sorted(runs) == [2] and len(traced) == 2
