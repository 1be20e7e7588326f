"""Fixed-context profiling of the rollout's decode loop (``scripts/bench_rollout.py``).

A batch of ``generate``'s own layout (pool, page table, loop state, on a mesh too) is started
from random prompts, its pool filled with random keys, values and summaries; then every row's
cache is set to a context of L tokens and chunks of the engine's own decode loop
(:func:`~sparrow_jax.rollout.engine.decode_chunk`, ``steps_per_call`` chained steps) are
timed there. Per step = chunk time / steps.

Typical use::

    batch, graphdef, params, state = fixed_context_batch(model, config, rows=64,
                                                         prompt_len=32, key=jax.random.key(0))
    state, timing = time_context(batch, graphdef, params, state, 16384, repeats=2)
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from sparrow_jax.rollout.decode_loop import UNFINISHED, LoopState, table_width
from sparrow_jax.rollout.engine import (DecodeBatch, RolloutConfig, decode_chunk, model_params,
                                        plan_batch, start_batch)
from sparrow_jax.rollout.types import FinishReason
from sparrow_jax.schedule import BudgetSchedule


@dataclasses.dataclass(frozen=True)
class ContextTiming:
    """One context's figures: ``step_seconds`` one per timed chunk (chunk time / steps), the
    chunks' mean context, the page-table width and gather width they ran at, and the first
    (untimed, compiling) chunk's seconds."""

    context: int
    mean_context: float
    table_width: int
    gather_width: int | None
    step_seconds: tuple[float, ...]
    first_chunk_seconds: float


def fixed_context_batch(model, config: RolloutConfig, *, rows: int, prompt_len: int,
                        key: jax.Array, schedule: BudgetSchedule | None = None,
                        schedule_bound: BudgetSchedule | None = None, mesh: Mesh | None = None,
                        max_context: int | None = None
                        ) -> tuple[DecodeBatch, object, object, LoopState]:
    """``rows // config.n`` random prompts of ``prompt_len`` tokens planned and started as
    ``generate`` would (``mesh`` as there), the pool then filled with normal random values ->
    (batch, graphdef, params, state).

    ``max_context``: each row holds pages for that many tokens only (its response capped at
    ``max_context - prompt_len``), in a pool of just those pages (``config.num_pages`` and
    ``max_total_tokens`` ignored); its page table keeps the config's full width, the columns
    past its pages on the null page, as refill's table is for a short row beside a long one.
    Many slots can so be timed at a short context in a wide table (``time_context(min_width=)``)
    whatever their full-length cache would need."""
    if rows < config.n or rows % config.n:
        raise ValueError(f"rows={rows} must be a positive multiple of n={config.n}")
    caps = None
    if max_context is not None:
        if not prompt_len < max_context <= prompt_len + config.max_new_tokens:
            raise ValueError(f"max_context={max_context} must lie in (prompt_len={prompt_len}, "
                             f"prompt_len + max_new_tokens={prompt_len + config.max_new_tokens}]")
        caps = max_context - prompt_len
        config = dataclasses.replace(config, num_pages=None, max_total_tokens=None)
    seed = int(jax.random.randint(key, (), 0, 2 ** 31 - 1))
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, model.config.vocab_size, (rows // config.n, prompt_len)).tolist()
    batch = plan_batch(model, prompts, config, schedule, mesh=mesh,
                       schedule_bound=schedule_bound, max_new_tokens=caps)
    graphdef, params = model_params(model, mesh)
    state = start_batch(batch, graphdef, params, key)
    c = state.cache
    pool = (c.k_pages, c.v_pages, c.centroids, c.kmin, c.kmax)
    filled = [None if arrays is None else tuple(
        _normal_like(x, np.uint32(seed + 1000 * i + layer))
        for layer, x in enumerate(arrays)) for i, arrays in enumerate(pool)]
    cache = c.replace(k_pages=filled[0], v_pages=filled[1], centroids=filled[2], kmin=filled[3],
                      kmax=filled[4])
    # Committed to the devices they are on, as run_chunk's outputs are: jit keys its cache on
    # that, and an uncommitted start compiled the first timed chunk a second time.
    state = jax.tree.map(lambda x: jax.device_put(x, x.sharding), state._replace(cache=cache))
    return batch, graphdef, params, jax.block_until_ready(state)


@functools.partial(jax.jit, donate_argnums=0)
def _normal_like(x: jax.Array, seed: jax.Array) -> jax.Array:
    """Approximately standard normal values (Irwin-Hall: the sum of four uniform bytes of a
    hash of each element's index and ``seed``, scaled to variance 1) in ``x``'s place.

    A hash of the index is one elementwise fusion written straight into the donated buffer: no
    temporary. ``jax.random.normal`` here needed about 8x the layer's bytes of temporaries
    (threefry bits, float32 values; XLA:CPU memory_analysis), several GiB for a pool layer of a
    batch sized to the device, allocated between the pool's layers."""
    h = jnp.full(x.shape, seed, jnp.uint32)
    for axis in range(x.ndim):
        h = _mix(h ^ jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis))
    total = sum(((h >> s) & 0xFF).astype(jnp.float32) for s in (0, 8, 16, 24))
    # Four uniform bytes: mean 4 * 127.5, variance 4 * (256**2 - 1) / 12.
    normal = (total - 510.0) * (3.0 / (256.0 ** 2 - 1)) ** 0.5
    # `x * 0 +` ties the result to x's sharding (a pool stays split over the mesh), so the
    # donated buffer is reused: no second pool, even for a batch sized to the device's memory.
    return x * 0 + normal.astype(x.dtype)


def _mix(h: jax.Array) -> jax.Array:
    """A 32-bit integer hash round (murmur3's finaliser)."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def at_context(state: LoopState, length: int, live: int | None = None) -> LoopState:
    """Every row with ``length`` tokens in its cache (prompt + response - 1, as in the loop),
    running, or only the first ``live`` rows (the others finished, as rows that ended beside
    a long one); every array's sharding kept.

    Only the three [S] arrays are new (built on the host, put in the old ones' shardings); the
    pool and the rest are the same arrays. A jitted version returned copies of every array it
    passed through (XLA copies a non-donated parameter it outputs): a second pool, out of
    memory on a device sized for one; and on a mesh it chose other shardings for the new rows
    than ``run_chunk`` returns, which compiled the next chunk a second time."""
    length = int(length)

    def full(like: jax.Array, value) -> jax.Array:
        return jax.device_put(np.broadcast_to(np.asarray(value, like.dtype), like.shape),
                              like.sharding)

    prompt = np.asarray(state.prompt_lengths)
    finish = np.full(state.finish.shape, UNFINISHED, np.int32)
    if live is not None:
        finish[live:] = FinishReason.LENGTH
    return state._replace(
        cache=state.cache.replace(lengths=full(state.cache.lengths, length)),
        response_lengths=full(state.response_lengths, length - prompt + 1),
        finish=full(state.finish, finish))


def time_context(batch: DecodeBatch, graphdef, params, state: LoopState, context: int, *,
                 repeats: int = 2,
                 run: Callable[[LoopState, int], LoopState] | None = None,
                 min_width: int | None = None,
                 live: int | None = None) -> tuple[LoopState, ContextTiming]:
    """``repeats`` timed chunks of ``steps_per_call`` chained steps, after one untimed chunk,
    from a start placed so that their mean context is ``context`` (clamped so that no row
    reaches the response capacity), each chunk at the page-table width ``generate`` would give
    it, or at least ``min_width`` pages wide (a short context in a wide table, as refill's
    short rows run beside a long one). ``run(state, reach) -> state``: the chunk to time
    (default the engine's :func:`~sparrow_jax.rollout.engine.decode_chunk`). ``live``: only
    the first rows run, the others finished at the start (``at_context``). Raises
    RuntimeError if a running row stopped."""
    config = batch.config
    if run is None:
        def run(st, reach):
            return decode_chunk(batch, graphdef, params, st, reach=reach)[0]
    steps = config.steps_per_call
    span = steps * repeats
    lay = batch.layout
    real = lay.prompt_caps > 0                  # placeholders (mesh padding) have no cap
    limit = int((lay.prompt_lengths + lay.prompt_caps)[real].min()) - 1
    start = max(1, min(context - span // 2, limit - span - 1))
    reach = max(start + span + 1, (min_width or 0) * config.page_size)
    t0 = time.perf_counter()
    state = jax.block_until_ready(run(at_context(state, start, live), reach))
    first = time.perf_counter() - t0
    state = at_context(state, start, live)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = jax.block_until_ready(run(state, reach))
        times.append((time.perf_counter() - t0) / steps)
    lengths = np.asarray(state.cache.lengths)[:live]
    if not bool(jnp.all(state.active[:live])) or (lengths != start + span).any():
        raise RuntimeError(f"at context {context}: rows stopped (lengths {lengths.min()}.."
                           f"{lengths.max()}, expected {start + span})")
    w = table_width(reach, config.page_size, batch.width, config.table_bucket_pages)
    return state, ContextTiming(
        context=context, mean_context=start + span / 2, table_width=w,
        gather_width=batch.settings.for_width(batch.bound, w).max_budget_pages,
        step_seconds=tuple(times), first_chunk_seconds=first)


PROMPT_LEN = 32   # sparse_vs_dense's random prompts


def sparse_vs_dense_config(contexts, *, steps_per_call: int, repeats: int, page_size: int,
                           prompt_len: int = PROMPT_LEN) -> RolloutConfig:
    """The rollout config :func:`sparse_vs_dense` runs: each row long enough for the longest
    context, a warm-up and ``repeats`` timed chunks past it, and the token each step writes;
    training-style sampling (temperature 1, no EOS)."""
    tokens = max(int(c) for c in contexts) + steps_per_call * (repeats + 1) + 1
    return RolloutConfig(n=1, max_new_tokens=tokens - prompt_len, temperature=1.0, eos_ids=(),
                         steps_per_call=steps_per_call, page_size=page_size)


def sparse_vs_dense(model, schedule: BudgetSchedule, contexts, *, rows: int,
                    prompt_len: int = PROMPT_LEN, repeats: int = 2, steps_per_call: int = 16,
                    seed: int = 0, mesh: Mesh | None = None) -> list[dict]:
    """Decode tokens/s of ``rows`` rows at each of ``contexts`` (ascending), with ``schedule``
    and densely, each mode on a batch of its own (one pool at a time; ``mesh`` as in
    ``generate``) -> per context:
    ``sparse_step_s``, ``dense_step_s`` (medians of the timed chunks), tokens/s of each
    (rows / step), ``x_dense`` (dense step over sparse step), the timed steps' mean context
    and the sparse step's ``budget_pages`` there (reserved pages included). Training-style
    sampling (temperature 1, no EOS), the engine's defaults otherwise."""
    contexts = sorted(int(c) for c in contexts)
    config = sparse_vs_dense_config(contexts, steps_per_call=steps_per_call, repeats=repeats,
                                    page_size=schedule.page_size, prompt_len=prompt_len)
    steps, mean = {}, {}
    for mode, sched in (("sparse", schedule), ("dense", None)):
        batch, graphdef, params, state = fixed_context_batch(
            model, config, rows=rows, prompt_len=prompt_len, key=jax.random.key(seed),
            schedule=sched, mesh=mesh)
        for ctx in contexts:
            state, timing = time_context(batch, graphdef, params, state, ctx, repeats=repeats)
            steps[mode, ctx] = float(np.median(timing.step_seconds))
            mean[ctx] = timing.mean_context
        del batch, params, state
    return [dict(context=c, mean_context=mean[c], rows=rows, sparse_step_s=steps["sparse", c],
                 dense_step_s=steps["dense", c], sparse_tokens_per_s=rows / steps["sparse", c],
                 dense_tokens_per_s=rows / steps["dense", c],
                 x_dense=steps["dense", c] / steps["sparse", c],
                 budget_pages=int(schedule.budget_pages(int(mean[c]))))
            for c in contexts]


__all__ = ["ContextTiming", "fixed_context_batch", "at_context", "time_context",
           "sparse_vs_dense_config", "sparse_vs_dense"]
