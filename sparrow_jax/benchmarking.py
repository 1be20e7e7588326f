"""Timing helpers shared by the benchmark scripts (``scripts/bench_*.py``).

XLA merges repeated identical calls inside one jit, so a timed loop chains them: each call takes
the previous call's output as its input (:func:`chained`). Times are medians of wall-clock runs
after a compile and a warm-up run (:func:`median_seconds`).
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp


def chained(fn, chain: int):
    """A jitted ``run(x, *args)`` applying ``x = fn(x, *args)`` ``chain`` times in a loop."""
    @jax.jit
    def run(x, *args):
        return jax.lax.fori_loop(0, chain, lambda _, y: fn(y, *args), x)
    return run


def write_record(path: str | None, **fields) -> dict:
    """The raw JSON of a benchmark run: the device, jax's version, the date and the command
    line, then ``fields``; written to ``path`` when given. Returns the record."""
    record = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "argv": sys.argv[1:], **fields}
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
    return record


def median_seconds(run, args, repeats: int) -> float:
    """Median wall time of ``run(*args)`` over ``repeats`` runs, after compile and warm-up."""
    jax.block_until_ready(run(*args))
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_ceiling(repeats: int = 10, small: bool = False) -> float:
    """GB/s of the faster of a sum and a max over a 4 GiB float32 array (4 MiB if ``small``,
    for CPU smoke runs): the device's read bandwidth as XLA reaches it."""
    x = jax.random.normal(jax.random.key(0), (1 << (20 if small else 30),), jnp.float32)
    best = 0.0
    for reduce in (jnp.sum, jnp.max):
        f = jax.jit(reduce)
        best = max(best, x.nbytes / median_seconds(f, (x,), repeats) / 1e9)
    del x
    return best


def peak_bytes() -> int | None:
    """The first device's peak memory in use (None where the backend does not say)."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    return None if not stats else stats.get("peak_bytes_in_use")


def contiguous_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                         lengths: jax.Array) -> jax.Array:
    """The dense baseline on a contiguous cache: q ``[B, Hq, D]``, k/v ``[B, H, S, D]``,
    lengths ``[B]`` -> ``[B, Hq, D]`` (XLA einsums, float32 softmax)."""
    b, hq, d = q.shape
    h = k.shape[1]
    qg = q.reshape(b, h, hq // h, d)
    s = jnp.einsum("bhrd,bhsd->bhrs", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
    valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
    s = jnp.where(valid[:, None, None, :], s, -1e30)
    w = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhrs,bhsd->bhrd", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, hq, d).astype(q.dtype)
