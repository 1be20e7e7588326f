"""Continuous refill: the rollout engine with a fixed number of decode slots kept full
(docs/design.md, section 11).

The static engine (:mod:`sparrow_jax.rollout.engine`) reserves every row's pages for
``max_new_tokens`` and decodes a batch until its longest row ends. Here S slots decode in the
same jitted chunks of ``steps_per_call`` steps, and between chunks the host:

1. harvests the rows that finished (their outputs copied out, their pages freed at once);
2. grows the running rows: each gets the pages its next chunk writes into; when the pool cannot
   supply them, the most recently admitted rows are preempted (pages freed, samples back to the
   front of the queue, to be recomputed from the prompt);
3. admits pending samples (prompt i, sample j) in (i, j) order while a slot is free and the pool
   holds their prompt pages plus one chunk: one jitted call prefills the newcomers (the samples
   of a prompt admitted together share its full prompt pages), samples their first token, and
   they are scattered into the free slots.

Those decisions are :class:`~sparrow_jax.rollout.refill_schedule.RefillScheduler`'s (host only;
:func:`~sparrow_jax.rollout.refill_schedule.simulate_refill` replays them without a device);
this module runs the device side. A sample draws position t from the stream of (key, prompt
id, sample index, t) alone
(:mod:`sparrow_jax.rollout.sampling`), so its tokens do not depend on the slot, the admission
order or preemption: they are the static engine's.

Typical use::

    rollout = generate_refill(model, prompts, RolloutConfig(n=8, num_pages=4096), key,
                              schedule, slots=64)
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sparrow_jax.attention.allocator import pages_needed
from sparrow_jax.attention.paged_cache import init_cache
from sparrow_jax.models.qwen3 import check_tokens
from sparrow_jax.rollout.budget import runtime_schedule
from sparrow_jax.rollout.decode_loop import (HEADS, ROWS, UNFINISHED, DecodeSettings, LoopState,
                                             cache_specs, loop_specs, partly_donated, run_chunk,
                                             sharded_cache, start)
from sparrow_jax.rollout.engine import (RolloutConfig, check_mesh, model_params, pool_size,
                                        prompt_caps, prompt_width)
from sparrow_jax.rollout.refill_schedule import (Admission, RefillScheduler, RefillStats,
                                                 shard_prompts)
from sparrow_jax.rollout.sampling import stream_keys
from sparrow_jax.rollout.types import FinishReason, Rollout
from sparrow_jax.schedule import BudgetSchedule


def generate_refill(model, prompts: Sequence[Sequence[int]], config: RolloutConfig,
                    key: jax.Array, schedule: BudgetSchedule | None = None, *, slots: int,
                    prefill_rows: int | None = None, lora: bool = False,
                    prompt_ids: Sequence[int] | None = None,
                    schedule_bound: BudgetSchedule | None = None,
                    max_new_tokens: int | Sequence[int] | None = None,
                    mesh: Mesh | None = None, tail_slots: int | None = None) -> Rollout:
    """:func:`~sparrow_jax.rollout.engine.generate` with ``slots`` decode slots refilled as rows
    finish, pages allocated as rows grow from a pool of ``config.num_pages`` (sized as
    :func:`~sparrow_jax.rollout.engine.pool_size` says). Same arguments and result layout (rows
    ``i*n .. i*n+n-1`` answer prompt i), same tokens per sample.

    ``prefill_rows``: the rows one admission call prefills per row shard, the newcomers padded
    to it (one compilation; more newcomers take several calls); None: one call, padded to the
    next power of two of the newcomers, at most the shard's slots (less padded work, a
    compilation per power). ``schedule_bound``, ``max_new_tokens``
    (per-prompt caps): as in ``generate``; a row's pages grow up to its own cap.

    ``mesh`` (axes ``data``, ``fsdp``, ``tensor``, as in ``generate``): the prompts split into
    equal contiguous parts, one per row shard (``data`` x ``fsdp``), each shard with its own
    queue, pool of ``num_pages`` and ``slots / shards`` slots (``slots`` a multiple of the
    shards); the chunks run every shard at once, the KV heads split over ``tensor``. Same
    tokens per sample as without it, up to float rounding in the logits.

    ``tail_slots``: once no sample is queued, the last rows run on fewer slots: the smallest
    power of two per row shard, ``tail_slots / shards`` at least, that holds each shard's
    running rows (every slot costs each step its LM head and sampling, running or idle; a
    compilation per slot count). None: the run keeps its ``slots``. Same tokens per sample."""
    return run_refill(model, prompts, config, key, schedule, slots=slots,
                      prefill_rows=prefill_rows, lora=lora, prompt_ids=prompt_ids,
                      schedule_bound=schedule_bound, max_new_tokens=max_new_tokens,
                      mesh=mesh, tail_slots=tail_slots)[0]


def run_refill(model, prompts: Sequence[Sequence[int]], config: RolloutConfig, key: jax.Array,
               schedule: BudgetSchedule | None = None, *, slots: int,
               prefill_rows: int | None = None, lora: bool = False,
               prompt_ids: Sequence[int] | None = None,
               schedule_bound: BudgetSchedule | None = None,
               max_new_tokens: int | Sequence[int] | None = None, mesh: Mesh | None = None,
               tail_slots: int | None = None,
               on_chunk: Callable[[dict], None] | None = None
               ) -> tuple[Rollout, RefillStats]:
    """:func:`generate_refill` -> (rollout, :class:`RefillStats`). ``on_chunk(info)``, if
    given, is called after each chunk (its results on the host) with ``width`` (page-table
    columns), ``steps`` (decode steps it ran), ``slots`` (the rows it ran, idle ones
    included) and ``contexts`` (``[rows]``: the cached tokens of the rows it decoded, at its
    start): what a step-time model needs
    (``scripts/bench_rollout.py --phase refill``); and with ``prefills`` (admission calls
    before it) and ``chunk_seconds`` (from its dispatch to its results on the host: the rest
    of a chunk's time is the host's and the admissions')."""
    cfg = model.config
    prompts = [list(p) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_refill needs at least one prompt, and every prompt at least "
                         "one token")
    for p in prompts:
        check_tokens(p, cfg.vocab_size)
    if mesh is not None:
        check_mesh(mesh, cfg, "generate_refill")
    groups = 1 if mesh is None else mesh.shape[ROWS[0]] * mesh.shape[ROWS[1]]
    if slots < 1 or slots % groups:
        raise ValueError(f"generate_refill: slots must be a positive multiple of the mesh's "
                         f"{groups} row shard(s), got {slots}")
    per = slots // groups
    if prefill_rows is not None and not 1 <= prefill_rows <= per:
        raise ValueError(f"generate_refill: prefill_rows must be in [1, slots per row shard="
                         f"{per}], got {prefill_rows}")
    if tail_slots is not None and not (1 <= tail_slots <= slots and tail_slots % groups == 0):
        raise ValueError(f"generate_refill: tail_slots must be a multiple of the mesh's "
                         f"{groups} row shard(s) in [1, slots={slots}], got {tail_slots}")
    if schedule is not None and schedule.page_size != config.page_size:
        raise ValueError(f"the schedule counts pages of {schedule.page_size} tokens, the cache "
                         f"{config.page_size}")
    ids = np.arange(len(prompts)) if prompt_ids is None else np.asarray(prompt_ids)
    if ids.shape != (len(prompts),) or ids.min() < 0 or ids.max() >= 2 ** 31:
        raise ValueError(f"prompt_ids must be {len(prompts)} ints in [0, 2**31), got "
                         f"{ids.tolist()}")
    ids = ids.astype(np.int32)
    caps = prompt_caps(max_new_tokens, len(prompts), config)

    p, r, n, c = config.page_size, config.max_new_tokens, config.n, config.steps_per_call
    lengths = np.array([len(x) for x in prompts], np.int32)
    cache_dtype = jnp.dtype(config.cache_dtype or model.dtype)
    parts = shard_prompts(len(prompts), groups)
    tensor = 1 if mesh is None else mesh.shape[HEADS]
    device = None if mesh is None else mesh.devices.flat[0]
    num_pages = max(pool_size(config, cfg, lengths[list(part)], cache_dtype,
                              max_new_tokens=caps[list(part)], kv_head_shards=tensor,
                              device=device) for part in parts if len(part))
    one = pages_needed(lengths, 1, caps, p)
    if one.max() > num_pages - 1:
        raise ValueError(f"generate_refill: num_pages={num_pages} cannot hold one sample of "
                         f"prompt {int(one.argmax())} ({int(one.max())} pages + the null page)")
    tp = prompt_width(lengths, config)
    tokens = np.zeros((len(prompts), tp), np.int32)
    for i, x in enumerate(prompts):
        tokens[i, :len(x)] = x
    width = -(-(tp + r) // p)
    shape, values, bound = runtime_schedule(schedule, schedule_bound, width)
    settings = DecodeSettings.from_config(config, cfg.vocab_size, shape, lora=lora,
                                          mesh=mesh).for_width(bound, width)
    graphdef, params = model_params(model, mesh)
    sched = RefillScheduler(lengths, caps, n=n, slots=slots, shards=groups, num_pages=num_pages,
                            page_size=p, steps_per_call=c, width=width,
                            prefill_rows=prefill_rows,
                            table_bucket_pages=config.table_bucket_pages,
                            page_seed=config.page_seed,
                            contiguous_pages=config.contiguous_pages)
    state = _empty_state(cfg, num_pages, slots, tp + r, r, settings.top_k, config, cache_dtype,
                         key, mesh)
    num_rows = len(prompts) * n
    # Result rows per shard (k prompts x n, placeholders past the prompts: cut at the end).
    out = _empty_output(groups * sched.result_rows, tp + r, r, settings.top_k, n, mesh)
    while sched.busy:
        preempted = sched.grow()
        if preempted:
            finish = np.array(state.finish)
            finish[preempted] = int(FinishReason.LENGTH)
            state = state._replace(finish=_put_rows(finish, mesh))
        prefills = 0
        while (adm := sched.admit()) is not None:
            state = _admit_pending(state, adm, graphdef, params, tokens, ids, key, settings, r)
            prefills += 1
        w, contexts = sched.next_width()
        t0 = time.perf_counter()
        state = state._replace(cache=state.cache.replace(
            page_table=_put_rows(sched.table[:, :w], mesh)))
        with partly_donated():
            state, _ = run_chunk(graphdef, params, state, values, c,
                                 settings=settings.for_width(bound, w))
        finish, cache_lengths = np.asarray(state.finish), np.asarray(state.cache.lengths)
        chunk_seconds = time.perf_counter() - t0
        dst = sched.harvest(finish != UNFINISHED, cache_lengths)
        if on_chunk is not None:
            on_chunk(dict(width=w, contexts=np.fromiter(contexts.values(), np.int64),
                          steps=int(max(cache_lengths[s] - b for s, b in contexts.items())),
                          slots=len(finish), prefills=prefills, chunk_seconds=chunk_seconds))
        if (dst < sched.result_rows).any():
            out = _collect(out, state, _put_rows(dst, mesh), mesh=mesh)
        if tail_slots and sched.busy:
            per_old = len(sched.shards[0].slots)
            if (src := sched.narrow(tail_slots // groups)) is not None:
                # Under a mesh each shard gathers its own rows: indices local to the shard.
                per_new = len(sched.shards[0].slots)
                local = src - np.repeat(np.arange(groups, dtype=np.int32) * per_old, per_new)
                # The per-row arrays shrink; the pool passes through in place.
                with partly_donated():
                    state = _take_rows(state, _put_rows(local, mesh), mesh=mesh)

    if groups * sched.result_rows > num_rows:   # placeholder rows: replicate, cut
        if mesh is not None:
            out = jax.device_put(out, NamedSharding(mesh, PartitionSpec()))
        out = jax.tree.map(lambda x: x[:num_rows], out)
    return out, sched.stats()


def _put_rows(x, mesh: Mesh | None) -> jax.Array:
    """An array of slots (host, or keys) onto the device(s), split over the mesh's row
    shards."""
    if mesh is None:
        return jnp.asarray(x)
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec(ROWS)))


def _admit_pending(state: LoopState, adm: Admission, graphdef, params, tokens, ids, key,
                   settings: DecodeSettings, response_capacity: int) -> LoopState:
    """Prefills one admission's newcomers (one call for every shard: k rows each) and
    scatters them into their slots."""
    g_count, k = adm.dst.shape
    mesh = settings.mesh

    def put(x):
        return _put_rows(x.reshape((g_count * k,) + x.shape[2:]), mesh)

    prompt_tokens = np.where((adm.prompts >= 0)[..., None], tokens[np.maximum(adm.prompts, 0)],
                             0).astype(np.int32)
    streams = _put_rows(stream_keys(key, ids[adm.row_prompts].reshape(-1),
                                    adm.samples.reshape(-1)), mesh)
    # The pool is donated to the prefill and comes back as the newcomers' cache.
    cache = _prefill_cache(state.cache, put(adm.prefill_table), mesh)
    with partly_donated():
        new = start(graphdef, params, cache, put(prompt_tokens), put(adm.prompt_lengths),
                    put(adm.caps), put(adm.row_table), put(adm.prompt_index),
                    put(adm.copy_src), put(adm.copy_dst), streams, put(adm.live),
                    settings=settings, response_capacity=response_capacity)
    state = state._replace(cache=state.cache.replace(
        k_pages=new.cache.k_pages, v_pages=new.cache.v_pages, centroids=new.cache.centroids,
        kmin=new.cache.kmin, kmax=new.cache.kmax))
    return _admit(state, new._replace(cache=_rows_of(new.cache)), put(adm.dst), mesh=mesh)


def _prefill_cache(cache, prefill_table: jax.Array, mesh: Mesh | None):
    """The pool of ``cache`` with empty per-row fields for the ``k`` newcomer prompts (under
    ``mesh``, split over its row shards as the cache's own fields are)."""
    k = prefill_table.shape[0]
    specs = None if mesh is None else cache_specs(cache)

    def zeros(x, name):
        if x is None:
            return None
        x = np.zeros(x.shape[:1] + (k,) + x.shape[2:], x.dtype)
        return x if mesh is None else jax.device_put(
            x, NamedSharding(mesh, getattr(specs, name)))

    return cache.replace(page_table=prefill_table,
                         lengths=_put_rows(np.zeros((k,), np.int32), mesh),
                         partial_sum=zeros(cache.partial_sum, "partial_sum"),
                         partial_min=zeros(cache.partial_min, "partial_min"),
                         partial_max=zeros(cache.partial_max, "partial_max"))


def _rows_of(cache):
    """The per-row fields of a cache (its pool dropped: it lives on in the loop state)."""
    return (cache.lengths, cache.partial_sum, cache.partial_min, cache.partial_max)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def _admit(state: LoopState, new: LoopState, dst: jax.Array, mesh: Mesh | None) -> LoopState:
    """Scatters the newcomer rows ``new [k]`` (cache: its per-row fields) into slots ``dst [k]``
    of ``state [S]`` (``dst`` = S: dropped). Under ``mesh``, per row shard (``dst`` local to
    the shard's slots)."""

    def body(state, new, dst):
        lengths, psum, pmin, pmax = new.cache

        def put(old, value, axis=0):
            if old is None:
                return None
            index = (slice(None),) * axis + (dst,)
            return old.at[index].set(value, mode="drop")

        cache = state.cache.replace(
            lengths=put(state.cache.lengths, lengths),
            partial_sum=put(state.cache.partial_sum, psum, 1),
            partial_min=put(state.cache.partial_min, pmin, 1),
            partial_max=put(state.cache.partial_max, pmax, 1))
        fields = {f: put(getattr(state, f), getattr(new, f))
                  for f in LoopState._fields if f != "cache"}
        return LoopState(cache=cache, **fields)

    if mesh is None:
        return body(state, new, dst)
    specs = loop_specs(state.cache)
    c = specs.cache
    new_specs = specs._replace(cache=(c.lengths, c.partial_sum, c.partial_min, c.partial_max))
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, new_specs, PartitionSpec(ROWS)),
                         out_specs=specs, check_vma=False)(state, new, dst)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("out",))
def _collect(out: Rollout, state: LoopState, dst: jax.Array, mesh: Mesh | None) -> Rollout:
    """Copies slot s of ``state`` into row ``dst[s]`` of ``out`` (out of range: skipped); under
    ``mesh``, per row shard (``dst`` local to the shard's rows of ``out``)."""

    def body(out, state, dst):
        def put(old, value):
            return old.at[dst].set(value, mode="drop")

        return out.replace(
            tokens=put(out.tokens, state.tokens),
            prompt_lengths=put(out.prompt_lengths, state.prompt_lengths),
            response_lengths=put(out.response_lengths, state.response_lengths),
            logprobs=put(out.logprobs, state.logprobs), topk_ids=put(out.topk_ids, state.topk_ids),
            topk_logprobs=put(out.topk_logprobs, state.topk_logprobs),
            budget_pages=put(out.budget_pages, state.budgets),
            finish_reason=put(out.finish_reason, state.finish))

    if mesh is None:
        return body(out, state, dst)
    rows = PartitionSpec(ROWS)
    out_specs = jax.tree.map(lambda _: rows, out)
    return jax.shard_map(body, mesh=mesh, in_specs=(out_specs, loop_specs(state.cache), rows),
                         out_specs=out_specs, check_vma=False)(out, state, dst)


@functools.partial(jax.jit, static_argnames=("mesh",), donate_argnames=("state",))
def _take_rows(state: LoopState, src: jax.Array, mesh: Mesh | None) -> LoopState:
    """``state``'s rows ``src [S']`` (the pool kept): the loop state of fewer slots. Under
    ``mesh``, per row shard (``src`` local to the shard's slots)."""

    def body(state, src):
        def take(x, axis=0):
            return None if x is None else jnp.take(x, src, axis=axis)

        cache = state.cache.replace(
            page_table=take(state.cache.page_table), lengths=take(state.cache.lengths),
            partial_sum=take(state.cache.partial_sum, 1),
            partial_min=take(state.cache.partial_min, 1),
            partial_max=take(state.cache.partial_max, 1))
        return LoopState(cache=cache, **{f: take(getattr(state, f))
                                         for f in LoopState._fields if f != "cache"})

    if mesh is None:
        return body(state, src)
    specs = loop_specs(state.cache)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, PartitionSpec(ROWS)),
                         out_specs=specs, check_vma=False)(state, src)


def _empty_state(model_config, num_pages, slots, t, r, k, config, cache_dtype, key,
                 mesh: Mesh | None) -> LoopState:
    """S idle slots (finished; cache length 1 on the null page, so idle rows attend to
    something) over an empty pool (under ``mesh``, one pool of ``num_pages`` per row shard)."""
    table = np.zeros((slots, 1), np.int32)
    kwargs = dict(page_size=config.page_size, dtype=cache_dtype, scorer=config.scorer)
    if mesh is None:
        cache = init_cache(model_config, num_pages, table, **kwargs)
    else:
        cache = sharded_cache(model_config, num_pages, _put_rows(table, mesh), mesh=mesh,
                              **kwargs)

    def rows(x):
        return _put_rows(x, mesh)

    return LoopState(
        cache=cache.replace(lengths=rows(np.ones((slots,), np.int32))),
        tokens=rows(np.zeros((slots, t), np.int32)),
        prompt_lengths=rows(np.ones((slots,), np.int32)),
        last=rows(np.zeros((slots,), np.int32)),
        response_lengths=rows(np.zeros((slots,), np.int32)),
        finish=rows(np.full((slots,), int(FinishReason.LENGTH), np.int32)),
        caps=rows(np.zeros((slots,), np.int32)),
        logprobs=rows(np.zeros((slots, r), np.float32)),
        topk_ids=rows(np.zeros((slots, r, k), np.int32)),
        topk_logprobs=rows(np.full((slots, r, k), -np.inf, np.float32)),
        budgets=rows(np.zeros((slots, r), np.int32)),
        streams=rows(stream_keys(key, np.zeros(slots), np.zeros(slots))))


def _empty_output(rows, t, r, k, n, mesh: Mesh | None) -> Rollout:
    def put(x):
        return _put_rows(x, mesh)

    return Rollout(
        tokens=put(np.zeros((rows, t), np.int32)), prompt_lengths=put(np.zeros((rows,), np.int32)),
        response_lengths=put(np.zeros((rows,), np.int32)),
        logprobs=put(np.zeros((rows, r), np.float32)),
        topk_ids=put(np.zeros((rows, r, k), np.int32)),
        topk_logprobs=put(np.full((rows, r, k), -np.inf, np.float32)),
        budget_pages=put(np.zeros((rows, r), np.int32)),
        finish_reason=put(np.full((rows,), UNFINISHED, np.int32)),
        prompt_index=put(np.repeat(np.arange(rows // n, dtype=np.int32), n)))


__all__ = ["generate_refill", "run_refill", "RefillStats"]
