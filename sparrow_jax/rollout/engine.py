"""The rollout engine: dense prefill, then a jitted decode loop on the paged cache that gives each
sequence the budget the schedule assigns to its current length (docs/design.md, sections 2, 4).

Host side, once per batch: size the page pool, allocate every page up front (so the loop never
allocates), pad the prompts to a bucketed length. Device side: one jitted call prefills the
prompts, forks the n samples of each prompt onto its shared pages and samples the first token;
then jitted chunks of ``steps_per_call`` decode steps run in a ``lax.while_loop`` that stops as
soon as every row has finished. The host only looks at one flag per chunk (progress, stopping).
Each row samples from its own random stream (see :mod:`sparrow_jax.rollout.sampling`). Under a
device mesh the same functions run per shard inside ``shard_map`` (see :func:`generate`).

Typical use::

    rollout = generate(model, [[1, 5, 7], [1, 9]], RolloutConfig(n=8, max_new_tokens=512),
                       jax.random.key(0), schedule=BudgetSchedule.paper("qwen3-1.7b"))
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
import warnings
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sparrow_jax.attention.allocator import NULL_PAGE, PageAllocator, pages_needed
from sparrow_jax.attention.decode import decode_step, prefill
from sparrow_jax.attention.paged_cache import SCORERS, PagedKVCache, fork, init_cache
from sparrow_jax.attention.sparse import IMPLS
from sparrow_jax.models.qwen3 import check_tokens, logits_from_hidden
from sparrow_jax.rollout.budget import (BudgetShape, budget_pages, check_bound, gather_width,
                                        split_schedule)
from sparrow_jax.rollout.sampling import (SamplingParams, sample_from_logprobs,
                                          scaled_log_softmax, step_keys, stream_keys)
from sparrow_jax.rollout.types import FinishReason, Rollout
from sparrow_jax.schedule import BudgetSchedule

_UNFINISHED = -1


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """The knobs of :func:`generate`.

    n: samples per prompt (adjacent rows of the result; they share the prompt's pages).
    max_new_tokens: response capacity R (EOS and stop tokens included).
    temperature, top_p, top_k: sampling (temperature 0: greedy). Recorded log-probs are always
      those of the untruncated ``softmax(logits / T)`` (T = 1 when greedy).
    eos_ids: tokens that end a response (Qwen3 has two; see ``load_generation_config``).
    stop_sequences: token sequences that end a response once it ends with one of them.
    logprob_top_k: how many of the actor's top log-probs each step keeps (the ``paper`` and
      ``topk_bound`` mismatch estimators read them).
    page_size: tokens per KV page.
    num_pages: the page pool (the null page included): an int; ``"memory"`` for what
      ``memory_fraction`` of the device's free memory holds; None to size it from
      ``max_total_tokens``, else from the request itself (rounded up to ``pool_multiple`` pages
      so repeated batches of similar size reuse one compilation).
    dense_layers: layers that always attend densely (docs/design.md, section 3).
    scorer, impl: of :func:`sparrow_jax.attention.sparse.sparse_decode`.
    cache_dtype: KV cache dtype; None: the model's compute dtype.
    prefill_chunk: prompt tokens per prefill chunk (bounds prefill memory); None: all at once.
    steps_per_call: decode steps per jitted call (the host checks for completion in between).
    table_bucket_pages: each call of the decode loop sees only the first w columns of the page
      table, w the smallest power of two >= this (pages) that holds every row through the call
      (capped at the full width): the kernels' work that scales with the table width (the
      sparse kernels score and select over it; the dense kernel splits it) then follows the
      context, at one compilation per width. None: always the full width (one compilation).
    prompt_multiple: prompts are right-padded to a multiple of this (bounds recompilation).
    progress: a progress bar on stderr.
    page_seed: hand out pages in a shuffled order (tests: nothing may rely on contiguity).
    """

    n: int = 1
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    logprob_top_k: int = 20
    page_size: int = 16
    num_pages: int | str | None = None
    max_total_tokens: int | None = None
    memory_fraction: float = 0.8
    pool_multiple: int = 64
    dense_layers: tuple[int, ...] = (0, 1)
    scorer: str = "centroid"
    impl: str = "auto"
    cache_dtype: str | None = None
    prefill_chunk: int | None = None
    steps_per_call: int = 64
    table_bucket_pages: int | None = 256
    prompt_multiple: int = 64
    progress: bool = False
    page_seed: int | None = None

    def __post_init__(self):
        def fix(name, value):
            object.__setattr__(self, name, value)

        fix("eos_ids", tuple(int(t) for t in self.eos_ids))
        fix("stop_sequences", tuple(tuple(int(t) for t in s) for s in self.stop_sequences))
        fix("dense_layers", tuple(int(x) for x in self.dense_layers))
        SamplingParams(self.temperature, self.top_p, self.top_k)  # validates
        if self.page_size < 1:  # before the checks below divide by it
            raise ValueError(f"RolloutConfig: page_size must be positive, got {self.page_size}")
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.logprob_top_k >= 1, f"logprob_top_k must be >= 1, got {self.logprob_top_k}"),
            (self.page_size >= 1, f"page_size must be positive, got {self.page_size}"),
            (all(len(s) for s in self.stop_sequences), "stop_sequences must not be empty"),
            (self.num_pages is None or self.num_pages == "memory"
             or (isinstance(self.num_pages, int) and self.num_pages >= 2),
             f"num_pages must be an int >= 2, 'memory' or None, got {self.num_pages!r}"),
            (self.max_total_tokens is None or self.max_total_tokens >= 1,
             f"max_total_tokens must be positive, got {self.max_total_tokens}"),
            (0.0 < self.memory_fraction <= 1.0,
             f"memory_fraction must be in (0, 1], got {self.memory_fraction}"),
            (self.pool_multiple >= 1, f"pool_multiple must be >= 1, got {self.pool_multiple}"),
            (self.scorer in SCORERS, f"unknown scorer {self.scorer!r}; known: {SCORERS}"),
            (self.impl in IMPLS, f"unknown impl {self.impl!r}; known: {IMPLS}"),
            (self.cache_dtype in (None, "float32", "bfloat16", "float16"),
             f"cache_dtype must be float32, bfloat16, float16 or None, got {self.cache_dtype!r}"),
            (self.prefill_chunk is None
             or (self.prefill_chunk > 0 and self.prefill_chunk % self.page_size == 0),
             f"prefill_chunk must be a positive multiple of page_size {self.page_size}, got "
             f"{self.prefill_chunk}"),
            (self.steps_per_call >= 1, f"steps_per_call must be >= 1, got {self.steps_per_call}"),
            (self.table_bucket_pages is None or self.table_bucket_pages >= 1,
             f"table_bucket_pages must be >= 1 or None, got {self.table_bucket_pages}"),
            (self.prompt_multiple >= 1 and self.prompt_multiple % self.page_size == 0,
             f"prompt_multiple must be a positive multiple of page_size {self.page_size}, got "
             f"{self.prompt_multiple}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"RolloutConfig: {message}")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)


class _Static(NamedTuple):
    """Everything the jitted functions specialise on (hashable)."""

    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    stop_sequences: tuple[tuple[int, ...], ...]
    top_k: int
    budget: BudgetShape | None    # the schedule's static part (its values: a loop argument)
    dense_layers: tuple[int, ...]
    scorer: str
    impl: str
    max_budget_pages: int | None
    prefill_chunk: int | None
    lora: bool
    mesh: Mesh | None = None


class _Loop(NamedTuple):
    """The decode loop's carry. S rows, T = padded prompt + R, R = max_new_tokens."""

    cache: PagedKVCache
    tokens: jax.Array          # [S, T] int32
    prompt_lengths: jax.Array  # [S] int32
    last: jax.Array            # [S] int32: the token the next step feeds
    response_lengths: jax.Array  # [S] int32
    finish: jax.Array          # [S] int32: FinishReason, or -1 while running
    logprobs: jax.Array        # [S, R] float32
    topk_ids: jax.Array        # [S, R, k] int32
    topk_logprobs: jax.Array   # [S, R, k] float32
    budgets: jax.Array         # [S, R] int32
    streams: jax.Array         # [S] keys: each row's random stream (sampling.stream_keys)

    @property
    def active(self) -> jax.Array:
        return self.finish == _UNFINISHED


def generate(model, prompts: Sequence[Sequence[int]], config: RolloutConfig, key: jax.Array,
             schedule: BudgetSchedule | None = None, *, lora: bool = False,
             prompt_ids: Sequence[int] | None = None, mesh: Mesh | None = None,
             schedule_bound: BudgetSchedule | None = None) -> Rollout:
    """Samples ``config.n`` responses to each of ``prompts`` (token id lists of any lengths, no
    padding) -> :class:`~sparrow_jax.rollout.types.Rollout` (rows ``i*n .. i*n+n-1`` answer
    prompt i).

    ``schedule`` gives each decode step's page budget from the sequence's length (the current
    token included); None decodes densely. ``lora``: run the actor with its LoRA adapters
    (DistillSparse's sparse actor). Raises before any device work when the pool cannot hold the
    request.

    The schedule's values are an argument of the jitted decode loop, its shape (bin count and
    width, kind) and ``schedule_bound`` static (:mod:`sparrow_jax.rollout.budget`): a caller that
    changes the table between calls (the closed-loop controller, docs/design.md, section 9)
    passes one ``schedule_bound`` (a schedule that gives every length at least the budget of
    any table it will pass, e.g. ``BudgetSchedule.fixed(max_pages)`` or a ceiling table), and
    every table of the same shape reuses one compilation. A schedule above its bound raises.
    None: the schedule bounds itself (a new table compiles anew); ignored for dense rollouts.

    Sample j of prompt i draws response position t from ``fold_in(fold_in(fold_in(key,
    prompt_ids[i]), j), t)`` alone (``prompt_ids`` default ``0 .. len(prompts)-1``): its tokens
    do not depend on the other prompts of the call, their order, or n (samples ``0 .. n-1`` of
    a larger n are the same). A caller that splits one prompt list over several calls passes
    each prompt's index in the whole list and gets the samples of one call.

    ``mesh`` (axes ``data``, ``fsdp``, ``tensor``): the prompts are split into equal contiguous
    groups over ``data x fsdp``, all n samples of a prompt in one group; each group has its own
    page pool (``num_pages`` and ``max_total_tokens`` count one group's pool) and page table,
    and the KV heads of every pool are split over ``tensor`` (which must divide the model's KV
    heads). Page selection, per (sequence, KV head), thus needs no communication: prefill and
    decode run inside ``shard_map``, the only collective a gather of each layer's attention
    output over ``tensor``. The weights are replicated on the mesh once per call (gathered if
    the caller's are sharded). The result's rows are sharded over ``data x fsdp``. The tokens are
    those of the call without a mesh (same streams), up to float rounding in the logits.
    """
    cfg = model.config
    prompts = [list(p) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate needs at least one prompt, and every prompt at least one token")
    for p in prompts:
        check_tokens(p, cfg.vocab_size)
    bad = [t for t in config.eos_ids + sum(config.stop_sequences, ())
           if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"eos_ids / stop_sequences hold ids outside [0, {cfg.vocab_size}): {bad}")
    bad = [x for x in config.dense_layers if not 0 <= x < cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"dense_layers {bad} outside the model's {cfg.num_hidden_layers} layers")
    if prompt_ids is None:
        prompt_ids = np.arange(len(prompts), dtype=np.int32)
    else:
        prompt_ids = np.asarray(prompt_ids)
        if (prompt_ids.shape != (len(prompts),) or not np.issubdtype(prompt_ids.dtype, np.integer)
                or prompt_ids.min() < 0 or prompt_ids.max() >= 2 ** 31):
            raise ValueError(f"prompt_ids must be {len(prompts)} ints in [0, 2**31), one per "
                             f"prompt, got {prompt_ids.tolist()}")
        prompt_ids = prompt_ids.astype(np.int32)
    if schedule is not None and schedule.page_size != config.page_size:
        raise ValueError(f"the schedule counts pages of {schedule.page_size} tokens, the cache "
                         f"{config.page_size}")
    if mesh is not None:
        _check_mesh(mesh, cfg)

    p = config.page_size
    r = config.max_new_tokens
    cache_dtype = jnp.dtype(config.cache_dtype or model.dtype)
    lay = _layout(prompts, config, cfg, cache_dtype, mesh)
    width = lay.page_table.shape[1]
    shape, values, bound = _runtime_schedule(schedule, schedule_bound, width)
    static = _Static(
        sampling=config.sampling, eos_ids=config.eos_ids, stop_sequences=config.stop_sequences,
        top_k=min(config.logprob_top_k, cfg.vocab_size), budget=shape,
        dense_layers=config.dense_layers, scorer=config.scorer, impl=config.impl,
        max_budget_pages=_max_budget_pages(bound, width), prefill_chunk=config.prefill_chunk,
        lora=lora, mesh=mesh)

    def put(x):
        """A host array of rows onto the device(s): split over the row shards of the mesh."""
        if mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec(_ROWS)))

    graphdef, params = nnx.split(model)
    if mesh is None:
        cache = init_cache(cfg, lay.num_pages, lay.prefill_table, page_size=p,
                           dtype=cache_dtype, scorer=config.scorer)
    else:
        params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
        cache = _sharded_cache(cfg, lay.num_pages, put(lay.prefill_table), page_size=p,
                               dtype=cache_dtype, scorer=config.scorer, mesh=mesh)
    slot_ids = np.zeros(len(lay.prompt_lengths), np.int32)   # placeholders: any stream
    slot_ids[:len(prompts)] = prompt_ids
    streams = stream_keys(key, slot_ids[lay.slots], lay.sample_ids)
    if mesh is not None:
        streams = jax.device_put(streams, NamedSharding(mesh, PartitionSpec(_ROWS)))
    num_rows = len(prompts) * config.n
    bar = _progress(config, num_rows * r)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # The prefill's page table and per-prompt accumulators are replaced at fork, so their
        # donated buffers go unused; the pages themselves are reused in place.
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        state = _start(graphdef, params, cache, put(lay.prompt_tokens), put(lay.prompt_lengths),
                       put(lay.page_table), put(lay.prompt_index), put(lay.copy_src),
                       put(lay.copy_dst), streams, put(lay.live), static=static,
                       response_capacity=r)
    running = bool(jnp.any(state.active))
    steps_done = 0
    longest = int(lay.prompt_lengths.max())
    while running:
        # Always the same number of steps per call (one compilation per table width); the loop
        # inside stops early once every row has finished, and no row outlives the response
        # capacity. The call sees the table's first `w` columns: every row's cache through
        # the call (lengths <= prompt + steps so far + steps_per_call) fits in them.
        w = _table_width(longest + steps_done + config.steps_per_call + 1, p, width,
                         config.table_bucket_pages)
        if state.cache.page_table.shape[1] != w:
            state = state._replace(cache=state.cache.replace(
                page_table=put(lay.page_table[:, :w])))
        state, running = _run_chunk(
            graphdef, params, state, values, config.steps_per_call,
            static=static._replace(max_budget_pages=_max_budget_pages(bound, w)))
        steps_done += config.steps_per_call
        running = bool(running)
        if bar is not None:
            emitted = int(jnp.sum(state.response_lengths))
            bar.update(emitted - bar.n)
            bar.set_postfix(running=int(jnp.sum(state.active)),
                            tok_s=f"{emitted / (time.perf_counter() - t0):.0f}")
    if bar is not None:
        bar.close()
    finish = jnp.where(state.active, int(FinishReason.LENGTH), state.finish)
    out = Rollout(tokens=state.tokens, prompt_lengths=state.prompt_lengths,
                  response_lengths=state.response_lengths, logprobs=state.logprobs,
                  topk_ids=state.topk_ids, topk_logprobs=state.topk_logprobs,
                  budget_pages=state.budgets, finish_reason=finish,
                  prompt_index=put(lay.slots))
    if len(lay.slots) > num_rows:    # placeholder prompts fill the last groups: drop their rows
        if mesh is not None:         # rows no longer split evenly: replicate, then cut
            out = jax.device_put(out, NamedSharding(mesh, PartitionSpec()))
        out = jax.tree.map(lambda x: x[:num_rows], out)
    return out


# The mesh axes a rollout splits sequences over, and the one it splits KV heads over.
_ROWS = ("data", "fsdp")
_HEADS = "tensor"


def _check_mesh(mesh: Mesh, model_config) -> None:
    if set(mesh.axis_names) != {*_ROWS, _HEADS}:
        raise ValueError(f"generate: the mesh's axes must be ('data', 'fsdp', 'tensor'), got "
                         f"{mesh.axis_names}")
    t, h = mesh.shape[_HEADS], model_config.num_key_value_heads
    if h % t:
        raise ValueError(f"generate: mesh axis tensor={t} must divide the model's {h} KV heads")


class _Layout(NamedTuple):
    """The host side of one call: the prompts in G equal groups of k prompt slots (one group per
    row shard; slots past the prompts hold a one-token placeholder, finished at once), each group
    with its own pool of ``num_pages`` and page ids local to it. Rows are group-major, so the
    real rows come first, in prompt order. Np = G*k slots, S = Np*n rows."""

    num_pages: int               # pages per group's pool (its null page included)
    prompt_tokens: np.ndarray    # [Np, Tp] int32, right padded
    prompt_lengths: np.ndarray   # [Np] int32
    prefill_table: np.ndarray    # [Np, M] int32
    page_table: np.ndarray       # [S, M] int32
    prompt_index: np.ndarray     # [S] int32: the row's prompt within its group
    copy_src: np.ndarray         # [G*k*(n-1)] int32 (each group's list padded with null pages)
    copy_dst: np.ndarray
    slots: np.ndarray            # [S] int32: the row's prompt slot (its prompt's index)
    sample_ids: np.ndarray       # [S] int32
    live: np.ndarray             # [S] bool: False on placeholder rows


def _layout(prompts, config: RolloutConfig, model_config, cache_dtype, mesh) -> _Layout:
    groups = 1 if mesh is None else mesh.shape[_ROWS[0]] * mesh.shape[_ROWS[1]]
    n, p, r = config.n, config.page_size, config.max_new_tokens
    k = -(-len(prompts) // groups)
    lengths = np.ones(groups * k, np.int32)
    lengths[:len(prompts)] = [len(x) for x in prompts]
    max_new = np.zeros(groups * k, np.int32)
    max_new[:len(prompts)] = r
    tokens = np.zeros((groups * k, _round_up(int(lengths.max()), config.prompt_multiple)),
                      np.int32)
    for i, x in enumerate(prompts):
        tokens[i, :len(x)] = x
    width = -(-(tokens.shape[1] + r) // p)
    parts = [slice(g * k, (g + 1) * k) for g in range(groups)]
    tensor = 1 if mesh is None else mesh.shape[_HEADS]
    device = None if mesh is None else mesh.devices.flat[0]
    num_pages = max(pool_size(config, model_config, lengths[g], cache_dtype,
                              max_new_tokens=max_new[g], kv_head_shards=tensor, device=device)
                    for g in parts)
    allocs = [PageAllocator(num_pages, p, seed=config.page_seed).allocate(
        lengths[g], n, max_new[g], max_pages_per_seq=width) for g in parts]

    def copies(name):
        # Fixed-size copy lists (null page onto itself as padding): stable shapes across batches.
        out = np.full((groups, k * (n - 1)), NULL_PAGE, np.int32)
        for g, a in enumerate(allocs):
            out[g, :len(getattr(a, name))] = getattr(a, name)
        return out.reshape(-1)

    prompt_index = np.concatenate([a.prompt_index for a in allocs])
    slots = np.repeat(np.arange(groups * k, dtype=np.int32), n)
    return _Layout(
        num_pages=num_pages, prompt_tokens=tokens, prompt_lengths=lengths,
        prefill_table=np.concatenate([a.prefill_page_table for a in allocs]),
        page_table=np.concatenate([a.page_table for a in allocs]), prompt_index=prompt_index,
        copy_src=copies("copy_src"), copy_dst=copies("copy_dst"), slots=slots,
        sample_ids=np.tile(np.arange(n, dtype=np.int32), groups * k),
        live=slots < len(prompts))


def _cache_specs(cache: PagedKVCache) -> PagedKVCache:
    """The cache's PartitionSpecs under a mesh: each row shard's pool is its block of the page
    axis, the KV heads split over ``tensor``; tables, lengths and accumulators by row."""
    pool, rows, partial = PartitionSpec(_HEADS, _ROWS), PartitionSpec(_ROWS), PartitionSpec(
        None, _ROWS, _HEADS)

    def each(arrays, spec):
        return None if arrays is None else tuple(spec for _ in arrays)

    return cache.replace(
        k_pages=each(cache.k_pages, pool), v_pages=each(cache.v_pages, pool),
        centroids=each(cache.centroids, pool), kmin=each(cache.kmin, pool),
        kmax=each(cache.kmax, pool), page_table=rows, lengths=rows, partial_sum=partial,
        partial_min=None if cache.partial_min is None else partial,
        partial_max=None if cache.partial_max is None else partial)


def _loop_specs(cache: PagedKVCache) -> _Loop:
    """The loop state's PartitionSpecs under a mesh: every field by row."""
    rows = PartitionSpec(_ROWS)
    return _Loop(*(rows for _ in _Loop._fields))._replace(cache=_cache_specs(cache))


def _sharded_cache(model_config, num_pages: int, prefill_table: jax.Array, *, page_size, dtype,
                   scorer, mesh: Mesh) -> PagedKVCache:
    """An empty cache with one pool of ``num_pages`` per row shard, created in place on the
    mesh (never whole on one device)."""
    groups = mesh.shape[_ROWS[0]] * mesh.shape[_ROWS[1]]

    def build(table):
        return init_cache(model_config, groups * num_pages, table, page_size=page_size,
                          dtype=dtype, scorer=scorer)

    shape = jax.eval_shape(build, prefill_table)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), _cache_specs(shape),
                             is_leaf=lambda x: isinstance(x, PartitionSpec))
    return jax.jit(build, out_shardings=shardings)(prefill_table)


def pool_size(config: RolloutConfig, model_config, prompt_lengths, cache_dtype, *,
              max_new_tokens=None, kv_head_shards: int = 1, device=None) -> int:
    """The page pool for a request (the null page included); see :class:`RolloutConfig`.
    ``max_new_tokens`` (int or per prompt): default the config's. ``kv_head_shards``: devices a
    page's KV heads are split over (``"memory"`` then fits that many times more pages)."""
    p = config.page_size
    if isinstance(config.num_pages, int):
        return config.num_pages
    if config.num_pages == "memory":
        return pages_in_free_memory(model_config, p, cache_dtype, config.memory_fraction,
                                    scorer=config.scorer, device=device,
                                    kv_head_shards=kv_head_shards)
    if config.max_total_tokens is not None:
        return -(-config.max_total_tokens // p) + 1
    max_new = config.max_new_tokens if max_new_tokens is None else max_new_tokens
    need = int(pages_needed(prompt_lengths, config.n, max_new, p).sum()) + 1
    return _round_up(need, config.pool_multiple)


def pages_in_free_memory(model_config, page_size: int, cache_dtype, fraction: float = 0.8, *,
                         scorer: str = "centroid", device=None, kv_head_shards: int = 1) -> int:
    """How many pages (K, V and the page summaries, every layer) ``fraction`` of the device's
    free memory holds, each device holding ``1 / kv_head_shards`` of a page's KV heads. Needs a
    backend that reports memory (GPU, TPU)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        raise ValueError(f"{device.platform} does not report its free memory: give num_pages or "
                         f"max_total_tokens")
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    c = model_config
    per_page_vectors = 2 * page_size + (3 if scorer == "quest" else 1)
    heads = c.num_key_value_heads // kv_head_shards
    per_page = (c.num_hidden_layers * heads * c.head_dim * per_page_vectors
                * jnp.dtype(cache_dtype).itemsize)
    return int(free * fraction // per_page)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _table_width(tokens: int, page_size: int, width: int, bucket: int | None) -> int:
    """Page-table columns a decode call needs for rows of up to ``tokens`` tokens: the smallest
    power of two >= ``bucket`` holding them, capped at ``width`` (``bucket`` None: width)."""
    if bucket is None:
        return width
    need = max(-(-tokens // page_size), bucket)
    return min(1 << (need - 1).bit_length(), width)


def _runtime_schedule(schedule: BudgetSchedule | None, bound: BudgetSchedule | None,
                      width: int) -> tuple[BudgetShape | None, np.ndarray, BudgetSchedule | None]:
    """-> (the schedule's static shape, its values, the bound of its gather width): (None, an
    empty table, None) when dense."""
    if schedule is None:
        return None, np.zeros(0, np.int32), None
    if bound is None:
        return *split_schedule(schedule), schedule
    check_bound(schedule, bound, width)
    return *split_schedule(schedule), bound


def _max_budget_pages(bound: BudgetSchedule | None, width: int) -> int | None:
    """The static gather width of the sparse layers (:func:`~sparrow_jax.rollout.budget.
    gather_width`); None for dense rollouts."""
    return None if bound is None else gather_width(bound, width)


def _progress(config: RolloutConfig, total: int):
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="rollout", unit="tok", file=sys.stderr, dynamic_ncols=True)


def top_k(x: jax.Array, k: int, group: int = 128) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k`` over the last axis of ``x [B, V]``, computed exactly in two stages: the top
    k of each group of ``group`` entries, then the top k of those candidates. Same values and
    ids, ties included (lower index first: candidates keep index order within and across
    groups); on the H100 at 19 x 151936 float32, 0.20 ms instead of 0.71 ms (BENCHMARKS.md
    "Rollout"). Small vocabularies (or k > group) go straight to ``lax.top_k``."""
    b, v = x.shape
    if k > group or v <= 8 * group:
        return jax.lax.top_k(x, k)
    pad = -v % group
    xg = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(b, -1, group)
    vals, idx = jax.lax.top_k(xg, k)                                   # [B, G, k]
    idx = idx + (jnp.arange(xg.shape[1], dtype=idx.dtype) * group)[None, :, None]
    top, pos = jax.lax.top_k(vals.reshape(b, -1), k)
    return top, jnp.take_along_axis(idx.reshape(b, -1), pos, axis=1)


def _emit(state: _Loop, hidden: jax.Array, head: jax.Array, budget: jax.Array,
          static: _Static) -> _Loop:
    """Samples each active row's next token from ``hidden [S, D]``, records it, and marks rows
    that finish (EOS, a stop sequence, or the response capacity)."""
    s, t = state.tokens.shape
    r = state.logprobs.shape[1]
    rows = jnp.arange(s)
    active = state.active
    j = state.response_lengths
    logp = scaled_log_softmax(logits_from_hidden(hidden, head), static.sampling.temperature)
    token, token_lp = sample_from_logprobs(step_keys(state.streams, j), logp, static.sampling)
    top_lp, top_ids = top_k(logp, static.top_k)

    slot = jnp.where(active, j, r)           # out of range: dropped for finished rows
    where = jnp.where(active, state.prompt_lengths + j, t)
    tokens = state.tokens.at[rows, where].set(token, mode="drop")
    length = j + active.astype(jnp.int32)

    finish = state.finish
    if static.stop_sequences:
        stopped = jnp.zeros_like(active)
        for seq in static.stop_sequences:
            m = len(seq)
            idx = state.prompt_lengths[:, None] + length[:, None] - m + jnp.arange(m)
            tail = jnp.take_along_axis(tokens, jnp.clip(idx, 0, t - 1), axis=1)
            stopped |= (length >= m) & jnp.all(tail == jnp.asarray(seq, jnp.int32), axis=1)
        finish = jnp.where(active & stopped, int(FinishReason.STOP_SEQUENCE), finish)
    if static.eos_ids:
        eos = jnp.isin(token, jnp.asarray(static.eos_ids, jnp.int32))
        finish = jnp.where(active & eos, int(FinishReason.EOS), finish)
    finish = jnp.where((finish == _UNFINISHED) & (length >= r), int(FinishReason.LENGTH), finish)
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


def _head_axis(static: _Static) -> str | None:
    return None if static.mesh is None or static.mesh.shape[_HEADS] == 1 else _HEADS


@functools.partial(jax.jit, static_argnames=("graphdef", "static", "response_capacity"),
                   donate_argnames=("cache",))
def _start(graphdef, params, cache, prompt_tokens, prompt_lengths, page_table, prompt_index,
           copy_src, copy_dst, streams, live, *, static: _Static,
           response_capacity: int) -> _Loop:
    """Prefill the prompts, fork the samples onto the prompts' pages, sample the first token
    (budget 0: prefill attends densely). Per row: ``streams [S]`` the random streams, ``live
    [S]`` False for placeholder rows (finished at once). Under a mesh, per row shard."""

    def body(params, cache, prompt_tokens, prompt_lengths, page_table, prompt_index, copy_src,
             copy_dst, streams, live):
        model = nnx.merge(graphdef, params)
        hidden, cache = prefill(model, cache, prompt_tokens, prompt_lengths,
                                chunk_size=static.prefill_chunk, lora=static.lora,
                                head_axis=_head_axis(static))
        cache = fork(cache, page_table, prompt_index, copy_src, copy_dst)
        s, r, k = page_table.shape[0], response_capacity, static.top_k
        tokens = jnp.zeros((s, prompt_tokens.shape[1] + r), jnp.int32)
        tokens = tokens.at[:, :prompt_tokens.shape[1]].set(prompt_tokens[prompt_index])
        state = _Loop(
            cache=cache, tokens=tokens, prompt_lengths=prompt_lengths[prompt_index],
            last=jnp.zeros((s,), jnp.int32), response_lengths=jnp.zeros((s,), jnp.int32),
            finish=jnp.full((s,), _UNFINISHED, jnp.int32),
            logprobs=jnp.zeros((s, r), jnp.float32), topk_ids=jnp.zeros((s, r, k), jnp.int32),
            topk_logprobs=jnp.full((s, r, k), -jnp.inf, jnp.float32),
            budgets=jnp.zeros((s, r), jnp.int32), streams=streams)
        state = _emit(state, hidden[prompt_index], model.head_weight(),
                      jnp.zeros((s,), jnp.int32), static)
        return state._replace(finish=jnp.where(live, state.finish, int(FinishReason.LENGTH)))

    rows = PartitionSpec(_ROWS)
    mesh = static.mesh
    in_specs = None if mesh is None else (PartitionSpec(), _cache_specs(cache)) + (rows,) * 8
    out_specs = None if mesh is None else _loop_specs(cache)   # fork keeps the cache's fields
    return _on_mesh(body, mesh, in_specs, out_specs)(
        params, cache, prompt_tokens, prompt_lengths, page_table, prompt_index, copy_src,
        copy_dst, streams, live)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_steps", "static"),
                   donate_argnames=("state",))
def _run_chunk(graphdef, params, state: _Loop, budget_values: jax.Array, num_steps: int,
               *, static: _Static) -> tuple[_Loop, jax.Array]:
    """Up to ``num_steps`` decode steps, fewer if every row finishes -> (state, any running).
    ``budget_values [bins]``: the schedule's values (:func:`~sparrow_jax.rollout.budget.
    split_schedule`; empty when dense). Under a mesh each row shard runs its own loop (no
    communication between them)."""

    def body(params, budget_values, state):
        model = nnx.merge(graphdef, params)
        head = model.head_weight()

        def step(carry):
            i, st = carry
            # The step feeds the last token at position `lengths`; its budget is that of the
            # sequence with the token included (docs/design.md, section 2).
            budget = (None if static.budget is None
                      else budget_pages(static.budget, budget_values, st.cache.lengths + 1))
            hidden, cache = decode_step(
                model, st.cache, st.last, budget_pages=budget, dense_layers=static.dense_layers,
                scorer=static.scorer, impl=static.impl, active=st.active, lora=static.lora,
                max_budget_pages=static.max_budget_pages, head_axis=_head_axis(static))
            recorded = jnp.zeros_like(st.last) if budget is None else budget
            return i + 1, _emit(st._replace(cache=cache), hidden, head, recorded, static)

        def cond(carry):
            i, st = carry
            return (i < num_steps) & jnp.any(st.active)

        return jax.lax.while_loop(cond, step, (jnp.int32(0), state))[1]

    specs = None if static.mesh is None else _loop_specs(state.cache)
    state = _on_mesh(body, static.mesh, (PartitionSpec(), PartitionSpec(), specs), specs)(
        params, budget_values, state)
    return state, jnp.any(state.active)


__all__ = ["RolloutConfig", "generate", "pool_size", "pages_in_free_memory"]
