"""The rollout's decode loop on the paged cache, public pieces (docs/design.md, sections 2, 4,
10): settings, loop state, start (prefill, fork, first token), a chunk of decode steps.

:func:`sparrow_jax.rollout.engine.generate` and
:func:`sparrow_jax.rollout.refill.generate_refill` are built from these; the engine's
batch-level functions (``plan_batch``, ``start_batch``, ``decode_chunk``, ``read_out``) wrap
them for one batch of prompts, and :mod:`sparrow_jax.rollout.profile` times them at fixed
contexts.

Shapes: S rows (sequences), T = padded prompt + R tokens per row, R the response capacity, k
the recorded top log-probs. Each row samples from its own random stream
(:mod:`sparrow_jax.rollout.sampling`). Under a mesh the same functions run per row shard inside
``shard_map``; the row axis is split over ``ROWS``, the KV heads over ``HEADS``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sparrow_jax.attention.decode import decode_step, prefill
from sparrow_jax.attention.paged_cache import PagedKVCache, fork, init_cache
from sparrow_jax.rollout.budget import BudgetShape, budget_pages, gather_width
from sparrow_jax.rollout.sampling import (SamplingParams, sample_from_logprobs,
                                          scaled_log_softmax, step_keys)
from sparrow_jax.rollout.types import FinishReason
from sparrow_jax.schedule import BudgetSchedule
from sparrow_jax.sharding import rollout_specs

UNFINISHED = -1   # LoopState.finish of a running row

# The mesh axes a rollout splits sequences over, and the one it splits KV heads over.
ROWS = ("data", "fsdp")
HEADS = "tensor"


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """Everything the jitted functions specialise on (hashable: a static argument).

    sampling, eos_ids, stop_sequences, dense_layers, scorer, impl, prefill_chunk: as in
    :class:`~sparrow_jax.rollout.engine.RolloutConfig`. top_k: the log-probs recorded per step
    (at most the vocabulary). budget: the schedule's static part (its values are an argument of
    :func:`run_chunk`); None: dense. max_budget_pages: the sparse layers' static gather width
    (:func:`~sparrow_jax.rollout.budget.gather_width`; it follows the page table's width, see
    :meth:`for_width`). lora: run the actor with its adapters. mesh: run per row shard
    (axes ``data``, ``fsdp``, ``tensor``; docs/design.md, section 10).
    """

    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    stop_sequences: tuple[tuple[int, ...], ...]
    top_k: int
    budget: BudgetShape | None
    dense_layers: tuple[int, ...]
    scorer: str
    impl: str
    max_budget_pages: int | None
    prefill_chunk: int | None
    lora: bool
    mesh: Mesh | None = None

    @classmethod
    def from_config(cls, config, vocab_size: int, budget: BudgetShape | None, *,
                    lora: bool = False, mesh: Mesh | None = None) -> "DecodeSettings":
        """The settings of a :class:`~sparrow_jax.rollout.engine.RolloutConfig` (gather width
        unset: :meth:`for_width`)."""
        return cls(sampling=config.sampling, eos_ids=config.eos_ids,
                   stop_sequences=config.stop_sequences,
                   top_k=min(config.logprob_top_k, vocab_size), budget=budget,
                   dense_layers=config.dense_layers, scorer=config.scorer, impl=config.impl,
                   max_budget_pages=None, prefill_chunk=config.prefill_chunk, lora=lora,
                   mesh=mesh)

    def for_width(self, bound: BudgetSchedule | None, width: int) -> "DecodeSettings":
        """These settings for a page table ``width`` pages wide, the gather width from the
        schedule's ``bound`` (None when dense)."""
        return dataclasses.replace(
            self, max_budget_pages=None if bound is None else gather_width(bound, width))


class LoopState(NamedTuple):
    """The decode loop's carry. S rows, T = padded prompt + R, R = max_new_tokens."""

    cache: PagedKVCache
    tokens: jax.Array          # [S, T] int32
    prompt_lengths: jax.Array  # [S] int32
    last: jax.Array            # [S] int32: the token the next step feeds
    response_lengths: jax.Array  # [S] int32
    finish: jax.Array          # [S] int32: FinishReason, or -1 while running
    caps: jax.Array            # [S] int32: the row's response cap (<= R): LENGTH there
    logprobs: jax.Array        # [S, R] float32
    topk_ids: jax.Array        # [S, R, k] int32
    topk_logprobs: jax.Array   # [S, R, k] float32
    budgets: jax.Array         # [S, R] int32
    streams: jax.Array         # [S] keys: each row's random stream (sampling.stream_keys)

    @property
    def active(self) -> jax.Array:
        return self.finish == UNFINISHED


def cache_specs(cache: PagedKVCache) -> PagedKVCache:
    """The cache's PartitionSpecs under a mesh: each row shard's pool is its block of the page
    axis, the KV heads split over ``tensor``; tables, lengths and accumulators by row."""
    pool, rows, partial = PartitionSpec(HEADS, ROWS), PartitionSpec(ROWS), PartitionSpec(
        None, ROWS, HEADS)

    def each(arrays, spec):
        return None if arrays is None else tuple(spec for _ in arrays)

    return cache.replace(
        k_pages=each(cache.k_pages, pool), v_pages=each(cache.v_pages, pool),
        centroids=each(cache.centroids, pool), kmin=each(cache.kmin, pool),
        kmax=each(cache.kmax, pool), page_table=rows, lengths=rows, partial_sum=partial,
        partial_min=None if cache.partial_min is None else partial,
        partial_max=None if cache.partial_max is None else partial)


def loop_specs(cache: PagedKVCache) -> LoopState:
    """The loop state's PartitionSpecs under a mesh: every field by row."""
    rows = PartitionSpec(ROWS)
    return LoopState(*(rows for _ in LoopState._fields))._replace(cache=cache_specs(cache))


def sharded_cache(model_config, num_pages: int, prefill_table: jax.Array, *, page_size, dtype,
                  scorer, mesh: Mesh) -> PagedKVCache:
    """An empty cache with one pool of ``num_pages`` per row shard, created in place on the
    mesh (never whole on one device). One compilation per set of arguments: a jit of a closure
    made per call compiled at every rollout."""
    build = _cache_builder(model_config, num_pages, page_size, jnp.dtype(dtype), scorer, mesh)
    return build(prefill_table)


@functools.lru_cache(maxsize=None)
def _cache_builder(model_config, num_pages, page_size, dtype, scorer, mesh):
    """The jitted builder of :func:`sharded_cache` (output shardings fixed at jit, as a
    sharding constraint cannot name a mesh's Explicit axes)."""
    groups = mesh.shape[ROWS[0]] * mesh.shape[ROWS[1]]

    def build(table):
        return init_cache(model_config, groups * num_pages, table, page_size=page_size,
                          dtype=dtype, scorer=scorer)

    shape = jax.eval_shape(build, jax.ShapeDtypeStruct((groups, 1), jnp.int32))
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), cache_specs(shape),
                             is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.jit(build, out_shardings=shardings)


def table_width(tokens: int, page_size: int, width: int, bucket: int | None) -> int:
    """Page-table columns a decode call needs for rows of up to ``tokens`` tokens: the smallest
    power of two >= ``bucket`` holding them, capped at ``width`` (``bucket`` None: width)."""
    if bucket is None:
        return width
    need = max(-(-tokens // page_size), bucket)
    return min(1 << (need - 1).bit_length(), width)


def top_k(x: jax.Array, k: int, group: int = 128) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k`` over the last axis of ``x [B, V]``, computed exactly from the ``k`` groups
    of ``group`` entries with the largest maxima: the same values and ids, ties included (lower
    index first). Only a max over ``x`` and top-ks of ``V / group`` and ``k * group`` entries
    run, no sort of the vocabulary. Small vocabularies (fewer than ``max(8, k)`` groups) and
    ``k > group`` go straight to ``lax.top_k``.

    Why exact: rank groups by (max, lower group first), as ``lax.top_k`` of the maxima does. An
    entry of a group outside the first ``k`` is beaten by each of those ``k`` groups' maxima
    (larger, or equal and at a lower index, groups being contiguous), so it is not among the top
    ``k``. The chosen groups are gathered in index order, so ties in the last top-k still go to
    the lower index."""
    b, v = x.shape
    if k > group or v <= max(8, k) * group:
        return jax.lax.top_k(x, k)
    pad = -v % group
    xg = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(b, -1, group)
    _, groups = jax.lax.top_k(jnp.max(xg, axis=2), k)                    # [B, k]
    groups = jnp.sort(groups, axis=1)
    cand = jnp.take_along_axis(xg, groups[:, :, None], axis=1)          # [B, k, group]
    top, pos = jax.lax.top_k(cand.reshape(b, -1), k)
    ids = jnp.take_along_axis(groups, pos // group, axis=1) * group + pos % group
    return top, ids.astype(jnp.int32)


def emit(state: LoopState, logits: jax.Array, budget: jax.Array,
         settings: DecodeSettings) -> LoopState:
    """Samples each active row's next token from ``logits [S, V]`` (float32), records it, and
    marks rows that finish (EOS, a stop sequence, or the row's cap)."""
    s, t = state.tokens.shape
    r = state.logprobs.shape[1]
    rows = jnp.arange(s)
    active = state.active
    j = state.response_lengths
    logp = scaled_log_softmax(logits, settings.sampling.temperature)
    token, token_lp = sample_from_logprobs(step_keys(state.streams, j), logp, settings.sampling)
    top_lp, top_ids = top_k(logp, settings.top_k)

    slot = jnp.where(active, j, r)           # out of range: dropped for finished rows
    where = jnp.where(active, state.prompt_lengths + j, t)
    tokens = state.tokens.at[rows, where].set(token, mode="drop")
    length = j + active.astype(jnp.int32)

    finish = state.finish
    if settings.stop_sequences:
        stopped = jnp.zeros_like(active)
        for seq in settings.stop_sequences:
            m = len(seq)
            idx = state.prompt_lengths[:, None] + length[:, None] - m + jnp.arange(m)
            tail = jnp.take_along_axis(tokens, jnp.clip(idx, 0, t - 1), axis=1)
            stopped |= (length >= m) & jnp.all(tail == jnp.asarray(seq, jnp.int32), axis=1)
        finish = jnp.where(active & stopped, int(FinishReason.STOP_SEQUENCE), finish)
    if settings.eos_ids:
        eos = jnp.isin(token, jnp.asarray(settings.eos_ids, jnp.int32))
        finish = jnp.where(active & eos, int(FinishReason.EOS), finish)
    finish = jnp.where((finish == UNFINISHED) & (length >= state.caps), int(FinishReason.LENGTH),
                       finish)
    return state._replace(
        tokens=tokens, last=jnp.where(active, token, state.last), response_lengths=length,
        finish=finish,
        logprobs=state.logprobs.at[rows, slot].set(token_lp, mode="drop"),
        topk_ids=state.topk_ids.at[rows, slot].set(top_ids.astype(jnp.int32), mode="drop"),
        topk_logprobs=state.topk_logprobs.at[rows, slot].set(top_lp, mode="drop"),
        budgets=state.budgets.at[rows, slot].set(budget, mode="drop"))


def _on_mesh(body, mesh: Mesh | None, in_specs, out_specs):
    """``body`` itself, or under ``mesh`` run per shard (``shard_map``)."""
    if mesh is None:
        return body
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def _tensor_axis(settings: DecodeSettings) -> str | None:
    return None if settings.mesh is None or settings.mesh.shape[HEADS] == 1 else HEADS


def _param_specs(params, settings: DecodeSettings):
    """The weights' blocks inside ``shard_map``: the rollout's layout
    (:func:`~sparrow_jax.sharding.rollout_specs`, which ``model_params`` put them in)."""
    return rollout_specs(params, settings.mesh.shape[HEADS])


@contextlib.contextmanager
def partly_donated():
    """Calls that donate a whole loop state or cache for its pool's sake (updated in place),
    where some other buffers change shape or are replaced and so cannot be reused: XLA's
    warning about those says nothing wrong."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        yield


@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "response_capacity"),
                   donate_argnames=("cache",))
def start(graphdef, params, cache, prompt_tokens, prompt_lengths, prompt_caps, page_table,
          prompt_index, copy_src, copy_dst, streams, live, *, settings: DecodeSettings,
          response_capacity: int) -> LoopState:
    """Prefill the prompts, fork the samples onto the prompts' pages, sample the first token
    (budget 0: prefill attends densely). Per prompt: ``prompt_tokens [Np, Tp]``,
    ``prompt_lengths [Np]``, ``prompt_caps [Np]`` (its rows' response caps, at most
    ``response_capacity``). Per row: ``page_table [S, M]``, ``prompt_index [S]`` (the row's
    prompt), ``streams [S]`` the random streams, ``live [S]`` False for placeholder rows
    (finished at once). Under a mesh, per row shard."""

    def body(params, cache, prompt_tokens, prompt_lengths, prompt_caps, page_table, prompt_index,
             copy_src, copy_dst, streams, live):
        model = nnx.merge(graphdef, params)
        hidden, cache = prefill(model, cache, prompt_tokens, prompt_lengths,
                                chunk_size=settings.prefill_chunk, lora=settings.lora,
                                tensor_axis=_tensor_axis(settings))
        cache = fork(cache, page_table, prompt_index, copy_src, copy_dst)
        s, r, k = page_table.shape[0], response_capacity, settings.top_k
        tokens = jnp.zeros((s, prompt_tokens.shape[1] + r), jnp.int32)
        tokens = tokens.at[:, :prompt_tokens.shape[1]].set(prompt_tokens[prompt_index])
        state = LoopState(
            cache=cache, tokens=tokens, prompt_lengths=prompt_lengths[prompt_index],
            last=jnp.zeros((s,), jnp.int32), response_lengths=jnp.zeros((s,), jnp.int32),
            finish=jnp.full((s,), UNFINISHED, jnp.int32), caps=prompt_caps[prompt_index],
            logprobs=jnp.zeros((s, r), jnp.float32), topk_ids=jnp.zeros((s, r, k), jnp.int32),
            topk_logprobs=jnp.full((s, r, k), -jnp.inf, jnp.float32),
            budgets=jnp.zeros((s, r), jnp.int32), streams=streams)
        state = emit(state, model.logits(hidden[prompt_index], _tensor_axis(settings)),
                     jnp.zeros((s,), jnp.int32), settings)
        return state._replace(finish=jnp.where(live, state.finish, int(FinishReason.LENGTH)))

    rows = PartitionSpec(ROWS)
    mesh = settings.mesh
    in_specs = None if mesh is None else (_param_specs(params, settings),
                                          cache_specs(cache)) + (rows,) * 9
    out_specs = None if mesh is None else loop_specs(cache)   # fork keeps the cache's fields
    return _on_mesh(body, mesh, in_specs, out_specs)(
        params, cache, prompt_tokens, prompt_lengths, prompt_caps, page_table, prompt_index,
        copy_src, copy_dst, streams, live)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_steps", "settings"),
                   donate_argnames=("state",))
def run_chunk(graphdef, params, state: LoopState, budget_values: jax.Array, num_steps: int,
              *, settings: DecodeSettings) -> tuple[LoopState, jax.Array]:
    """Up to ``num_steps`` decode steps, fewer if every row finishes -> (state, any running).
    ``budget_values [bins]``: the schedule's values (:func:`~sparrow_jax.rollout.budget.
    split_schedule`; empty when dense). Under a mesh each row shard runs its own loop (no
    communication between them)."""

    def body(params, budget_values, state):
        model = nnx.merge(graphdef, params)
        axis = _tensor_axis(settings)

        def step(carry):
            i, st = carry
            # The step feeds the last token at position `lengths`; its budget is that of the
            # sequence with the token included (docs/design.md, section 2).
            budget = (None if settings.budget is None
                      else budget_pages(settings.budget, budget_values, st.cache.lengths + 1))
            hidden, cache = decode_step(
                model, st.cache, st.last, budget_pages=budget, dense_layers=settings.dense_layers,
                scorer=settings.scorer, impl=settings.impl, active=st.active, lora=settings.lora,
                max_budget_pages=settings.max_budget_pages, tensor_axis=axis)
            recorded = jnp.zeros_like(st.last) if budget is None else budget
            return i + 1, emit(st._replace(cache=cache), model.logits(hidden, axis), recorded,
                               settings)

        def cond(carry):
            i, st = carry
            return (i < num_steps) & jnp.any(st.active)

        return jax.lax.while_loop(cond, step, (jnp.int32(0), state))[1]

    specs = None if settings.mesh is None else loop_specs(state.cache)
    in_specs = None if specs is None else (_param_specs(params, settings), PartitionSpec(), specs)
    state = _on_mesh(body, settings.mesh, in_specs, specs)(
        params, budget_values, state)
    return state, jnp.any(state.active)


__all__ = ["DecodeSettings", "LoopState", "UNFINISHED", "ROWS", "HEADS", "start", "run_chunk",
           "emit", "top_k", "table_width", "cache_specs", "loop_specs", "sharded_cache"]
