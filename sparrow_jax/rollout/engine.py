"""The rollout engine: dense prefill, then a jitted decode loop on the paged cache that gives each
sequence the budget the schedule assigns to its current length (docs/design.md, sections 2, 4).

Host side, once per batch (:func:`plan_batch`): size the page pool, allocate every page up front
(so the loop never allocates), pad the prompts to a bucketed length. Device side: one jitted call
prefills the prompts, forks the n samples of each prompt onto its shared pages and samples the
first token (:func:`start_batch`); then jitted chunks of ``steps_per_call`` decode steps run in a
``lax.while_loop`` that stops as soon as every row has finished (:func:`decode_chunk`). The host
only looks at one flag per chunk (progress, stopping); :func:`read_out` makes the result. The
loop's pieces are in :mod:`sparrow_jax.rollout.decode_loop`. Under a device mesh the same
functions run per shard inside ``shard_map`` (see :func:`generate`).

Typical use::

    rollout = generate(model, [[1, 5, 7], [1, 9]], RolloutConfig(n=8, max_new_tokens=512),
                       jax.random.key(0), schedule=BudgetSchedule.paper("qwen3-1.7b"))
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sparrow_jax.attention.allocator import NULL_PAGE, PageAllocator, pages_needed
from sparrow_jax.attention.paged_cache import SCORERS, init_cache
from sparrow_jax.attention.sparse import IMPLS
from sparrow_jax.benchmarking import free_bytes
from sparrow_jax.models.qwen3 import check_tokens
from sparrow_jax.rollout.budget import runtime_schedule
from sparrow_jax.rollout.decode_loop import (HEADS, ROWS, DecodeSettings, LoopState,
                                             partly_donated, run_chunk, sharded_cache, start,
                                             table_width)
from sparrow_jax.rollout.sampling import SamplingParams, stream_keys
from sparrow_jax.rollout.types import FinishReason, Rollout
from sparrow_jax.schedule import BudgetSchedule
from sparrow_jax.sharding import rollout_specs


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """The knobs of :func:`generate`.

    n: samples per prompt (adjacent rows of the result; they share the prompt's pages).
    max_new_tokens: response capacity R (EOS and stop tokens included); ``generate`` may cap
      prompts lower (its ``max_new_tokens``).
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
    contiguous_pages: hand each row its pages as runs of adjacent pages where the pool allows
      (``PageAllocator(contiguous=True)``; refill also continues a row's run as it grows), so
      that the TPU kernels fetch neighbouring chosen pages in one copy. Same samples.
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
    contiguous_pages: bool = False

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


def generate(model, prompts: Sequence[Sequence[int]], config: RolloutConfig, key: jax.Array,
             schedule: BudgetSchedule | None = None, *, lora: bool = False,
             prompt_ids: Sequence[int] | None = None, mesh: Mesh | None = None,
             schedule_bound: BudgetSchedule | None = None,
             max_new_tokens: int | Sequence[int] | None = None) -> Rollout:
    """Samples ``config.n`` responses to each of ``prompts`` (token id lists of any lengths, no
    padding) -> :class:`~sparrow_jax.rollout.types.Rollout` (rows ``i*n .. i*n+n-1`` answer
    prompt i).

    ``schedule`` gives each decode step's page budget from the sequence's length (the current
    token included); None decodes densely. ``lora``: run the actor with its LoRA adapters
    (DistillSparse's sparse actor). Raises before any device work when the pool cannot hold the
    request.

    ``max_new_tokens``: each prompt's response cap (a sequence, one per prompt, or one int),
    each in ``[1, config.max_new_tokens]``; a row stops at its prompt's cap (finish reason
    LENGTH) and gets pages for it alone. The result keeps the width ``config.max_new_tokens``
    (one compilation for any caps). None: every prompt ``config.max_new_tokens``.

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
    heads and the MLP width). Page selection, per (sequence, KV head), thus needs no
    communication: prefill and decode run inside ``shard_map``. The weights are laid out once
    per call as the rollout's decode copy (:func:`model_params`): heads, MLP width and
    vocabulary split over ``tensor``, whole over ``data x fsdp``; each layer's O and down
    projections then sum over ``tensor`` and the logits are gathered over it. The result's
    rows are sharded over ``data x fsdp``. The tokens are those of the call without a mesh
    (same streams), up to float rounding in the logits.
    """
    batch = plan_batch(model, prompts, config, schedule, lora=lora, prompt_ids=prompt_ids,
                       mesh=mesh, schedule_bound=schedule_bound, max_new_tokens=max_new_tokens)
    graphdef, params = model_params(model, mesh)
    bar = _progress(config, int(batch.layout.prompt_caps.sum()) * config.n)
    t0 = time.perf_counter()
    state = start_batch(batch, graphdef, params, key)
    running = bool(jnp.any(state.active))
    steps_done = 0
    longest = int(batch.layout.prompt_lengths.max())
    while running:
        # Always the same number of steps per call (one compilation per table width); the loop
        # inside stops early once every row has finished, and no row outlives the response
        # capacity. Every row's cache through the call holds at most prompt + steps so far +
        # steps_per_call tokens.
        state, running = decode_chunk(batch, graphdef, params, state,
                                      reach=longest + steps_done + config.steps_per_call + 1)
        steps_done += config.steps_per_call
        running = bool(running)
        if bar is not None:
            emitted = int(jnp.sum(state.response_lengths))
            bar.update(emitted - bar.n)
            bar.set_postfix(running=int(jnp.sum(state.active)),
                            tok_s=f"{emitted / (time.perf_counter() - t0):.0f}")
    if bar is not None:
        bar.close()
    return read_out(batch, state)


@dataclasses.dataclass(frozen=True, eq=False)
class DecodeBatch:
    """One batch of prompts planned for the decode loop (host side; :func:`plan_batch`).

    config: the call's :class:`RolloutConfig`. layout: pages, tables and prompts
    (:class:`BatchLayout`). settings: the loop's static settings for the full page table.
    budget_values ``[bins]`` int32: the schedule's values (empty: dense). bound: the schedule
    bounding the gather width (None: dense). stream_ids ``[Np]`` int32: each prompt slot's
    stream id (placeholder slots 0). num_rows: the result's rows (prompts x n). mesh: as in
    :func:`generate`. model_config, cache_dtype: of the cache to build.
    """

    config: RolloutConfig
    layout: "BatchLayout"
    settings: DecodeSettings
    budget_values: np.ndarray
    bound: BudgetSchedule | None
    stream_ids: np.ndarray
    num_rows: int
    mesh: Mesh | None
    model_config: object
    cache_dtype: jnp.dtype

    @property
    def width(self) -> int:
        """The full page table's width (pages per row)."""
        return self.layout.page_table.shape[1]

    def put(self, x) -> jax.Array:
        """A host array of rows onto the device(s): split over the row shards of the mesh."""
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, NamedSharding(self.mesh, PartitionSpec(ROWS)))


def plan_batch(model, prompts: Sequence[Sequence[int]], config: RolloutConfig,
               schedule: BudgetSchedule | None = None, *, lora: bool = False,
               prompt_ids: Sequence[int] | None = None, mesh: Mesh | None = None,
               schedule_bound: BudgetSchedule | None = None,
               max_new_tokens: int | Sequence[int] | None = None) -> DecodeBatch:
    """Checks a :func:`generate` call's arguments (ValueError naming the bad one) and plans its
    batch: page pool, tables, padded prompts, settings. No device work."""
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
        check_mesh(mesh, cfg)
    caps = prompt_caps(max_new_tokens, len(prompts), config)

    cache_dtype = jnp.dtype(config.cache_dtype or model.dtype)
    lay = _layout(prompts, caps, config, cfg, cache_dtype, mesh)
    width = lay.page_table.shape[1]
    shape, values, bound = runtime_schedule(schedule, schedule_bound, width)
    settings = DecodeSettings.from_config(config, cfg.vocab_size, shape, lora=lora, mesh=mesh)
    stream_ids = np.zeros(len(lay.prompt_lengths), np.int32)   # placeholders: any stream
    stream_ids[:len(prompts)] = prompt_ids
    return DecodeBatch(config=config, layout=lay, settings=settings.for_width(bound, width),
                       budget_values=values, bound=bound, stream_ids=stream_ids,
                       num_rows=len(prompts) * config.n, mesh=mesh, model_config=cfg,
                       cache_dtype=cache_dtype)


def model_params(model, mesh: Mesh | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """The model as (graphdef, params) for the decode loop, its floating weights in the compute
    dtype; under ``mesh``, laid out on it by :func:`~sparrow_jax.sharding.rollout_specs` (split
    over ``tensor``, whole over the row axes: cast, then gathered where the caller's are split
    further).

    Every layer casts its weights to the compute dtype at use (docs/design.md, section 1), so
    the copy holds the very values the layers would compute with, while each decode step reads
    half the bytes of float32 masters and a gathered copy holds half the memory. (XLA compiles
    the two programs differently: on a GPU the masters' casts fuse into the matmuls, and the
    log-probs agree to bfloat16 rounding, not bit for bit.)

    On the mesh the cast and the gather are one jitted program (collectives over the devices'
    links): ``jax.device_put`` of the sharded weights took 2.3 s a call for Qwen3-1.7B over two
    H100s, the program 0.02 s. Weights not on the mesh's devices (a model on one device) are
    cast where they lie, then put there."""
    graphdef, params = nnx.split(model)
    dtype = jnp.dtype(model.dtype)
    if mesh is None:
        return graphdef, jax.tree.map(to_compute_dtype(dtype), params)
    leaves, treedef = jax.tree.flatten(params)
    targets = tuple(NamedSharding(mesh, spec) for spec in jax.tree.leaves(
        rollout_specs(params, mesh.shape[HEADS]), is_leaf=lambda x: isinstance(x, PartitionSpec)))
    devices = set(mesh.devices.flat)
    if all(isinstance(x, jax.Array) and x.sharding.is_equivalent_to(t, x.ndim)
           and (x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating))
           for x, t in zip(leaves, targets)):
        return graphdef, params             # already the copy: a jitted identity would copy
    if any(not isinstance(x, jax.Array) or x.sharding.device_set != devices for x in leaves):
        # Cast where they lie, then put there: never a whole float32 copy on every device.
        cast = to_compute_dtype(dtype)
        return graphdef, treedef.unflatten(
            [jax.device_put(cast(x), t) for x, t in zip(leaves, targets)])
    return graphdef, treedef.unflatten(_cast_onto(dtype, targets)(leaves))


def to_compute_dtype(dtype):
    """``x -> x`` in ``dtype`` if floating, else ``x``: the decode copy's cast of each weight."""
    return lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x


@functools.lru_cache(maxsize=None)
def _cast_onto(dtype, shardings: tuple[NamedSharding, ...]):
    """The jitted cast of :func:`model_params`' weights (a list, one per sharding) onto
    ``shardings`` (fixed at jit, as a sharding constraint cannot name a mesh's Explicit
    axes)."""
    cast = to_compute_dtype(dtype)
    return jax.jit(lambda leaves: [cast(x) for x in leaves], out_shardings=list(shardings))


def start_batch(batch: DecodeBatch, graphdef, params, key: jax.Array) -> LoopState:
    """Builds the batch's cache, prefills its prompts, forks the samples and samples each row's
    first token (:func:`~sparrow_jax.rollout.decode_loop.start`) -> the loop state ``[S]``."""
    lay, config, mesh = batch.layout, batch.config, batch.mesh
    if mesh is None:
        cache = init_cache(batch.model_config, lay.num_pages, lay.prefill_table,
                           page_size=config.page_size, dtype=batch.cache_dtype,
                           scorer=config.scorer)
    else:
        cache = sharded_cache(batch.model_config, lay.num_pages, batch.put(lay.prefill_table),
                              page_size=config.page_size, dtype=batch.cache_dtype,
                              scorer=config.scorer, mesh=mesh)
    streams = stream_keys(key, batch.stream_ids[lay.slots], lay.sample_ids)
    if mesh is not None:
        streams = jax.device_put(streams, NamedSharding(mesh, PartitionSpec(ROWS)))
    put = batch.put
    # The prefill's page table and per-prompt accumulators are replaced at fork; the pages
    # themselves are reused in place.
    with partly_donated():
        return start(graphdef, params, cache, put(lay.prompt_tokens), put(lay.prompt_lengths),
                     put(lay.prompt_caps), put(lay.page_table), put(lay.prompt_index),
                     put(lay.copy_src), put(lay.copy_dst), streams, put(lay.live),
                     settings=batch.settings, response_capacity=config.max_new_tokens)


def decode_chunk(batch: DecodeBatch, graphdef, params, state: LoopState, *,
                 reach: int) -> tuple[LoopState, jax.Array]:
    """``config.steps_per_call`` decode steps (fewer if every row finishes) -> (state, any row
    running). ``reach``: the most tokens any row's cache can hold by the chunk's end; the chunk
    sees the page table's first columns that hold them (``table_bucket_pages``), and the sparse
    layers gather the bound's budget for that width."""
    config = batch.config
    w = table_width(reach, config.page_size, batch.width, config.table_bucket_pages)
    if state.cache.page_table.shape[1] != w:
        # In the old table's sharding, committed as run_chunk's outputs are: jit keys its cache
        # on that, and an uncommitted table compiled the next chunk at this width again.
        state = state._replace(cache=state.cache.replace(page_table=jax.device_put(
            batch.layout.page_table[:, :w], state.cache.page_table.sharding)))
    return run_chunk(graphdef, params, state, batch.budget_values, config.steps_per_call,
                     settings=batch.settings.for_width(batch.bound, w))


def read_out(batch: DecodeBatch, state: LoopState) -> Rollout:
    """The loop state as the call's :class:`~sparrow_jax.rollout.types.Rollout` (rows still
    running are cut at the capacity: finish reason LENGTH; placeholder rows dropped)."""
    finish = jnp.where(state.active, int(FinishReason.LENGTH), state.finish)
    out = Rollout(tokens=state.tokens, prompt_lengths=state.prompt_lengths,
                  response_lengths=state.response_lengths, logprobs=state.logprobs,
                  topk_ids=state.topk_ids, topk_logprobs=state.topk_logprobs,
                  budget_pages=state.budgets, finish_reason=finish,
                  prompt_index=batch.put(batch.layout.slots))
    if len(batch.layout.slots) > batch.num_rows:   # placeholder prompts fill the last groups
        if batch.mesh is not None:                 # rows no longer split evenly: replicate, cut
            out = jax.device_put(out, NamedSharding(batch.mesh, PartitionSpec()))
        out = jax.tree.map(lambda x: x[:batch.num_rows], out)
    return out


def check_mesh(mesh: Mesh, model_config, caller: str = "generate") -> None:
    """ValueError unless ``mesh`` has the rollout's axes and its ``tensor`` axis divides the
    model's KV heads and MLP width (the vocabulary is split only where it divides)."""
    if set(mesh.axis_names) != {*ROWS, HEADS}:
        raise ValueError(f"{caller}: the mesh's axes must be ('data', 'fsdp', 'tensor'), got "
                         f"{mesh.axis_names}")
    t = mesh.shape[HEADS]
    for what, size in (("KV heads", model_config.num_key_value_heads),
                       ("MLP width", model_config.intermediate_size)):
        if size % t:
            raise ValueError(f"{caller}: mesh axis tensor={t} must divide the model's {size} "
                             f"{what}")


class BatchLayout(NamedTuple):
    """The host side of one call: the prompts in G equal groups of k prompt slots (one group per
    row shard; slots past the prompts hold a one-token placeholder, finished at once), each group
    with its own pool of ``num_pages`` and page ids local to it. Rows are group-major, so the
    real rows come first, in prompt order. Np = G*k slots, S = Np*n rows."""

    num_pages: int               # pages per group's pool (its null page included)
    prompt_tokens: np.ndarray    # [Np, Tp] int32, right padded
    prompt_lengths: np.ndarray   # [Np] int32
    prompt_caps: np.ndarray      # [Np] int32: response caps (placeholders 0)
    prefill_table: np.ndarray    # [Np, M] int32
    page_table: np.ndarray       # [S, M] int32
    prompt_index: np.ndarray     # [S] int32: the row's prompt within its group
    copy_src: np.ndarray         # [G*k*(n-1)] int32 (each group's list padded with null pages)
    copy_dst: np.ndarray
    slots: np.ndarray            # [S] int32: the row's prompt slot (its prompt's index)
    sample_ids: np.ndarray       # [S] int32
    live: np.ndarray             # [S] bool: False on placeholder rows


def _layout(prompts, caps, config: RolloutConfig, model_config, cache_dtype,
            mesh) -> BatchLayout:
    groups = 1 if mesh is None else mesh.shape[ROWS[0]] * mesh.shape[ROWS[1]]
    n, p, r = config.n, config.page_size, config.max_new_tokens
    k = -(-len(prompts) // groups)
    lengths = np.ones(groups * k, np.int32)
    lengths[:len(prompts)] = [len(x) for x in prompts]
    max_new = np.zeros(groups * k, np.int32)
    max_new[:len(prompts)] = caps
    tokens = np.zeros((groups * k, prompt_width(lengths, config)), np.int32)
    for i, x in enumerate(prompts):
        tokens[i, :len(x)] = x
    width = -(-(tokens.shape[1] + r) // p)
    parts = [slice(g * k, (g + 1) * k) for g in range(groups)]
    tensor = 1 if mesh is None else mesh.shape[HEADS]
    device = None if mesh is None else mesh.devices.flat[0]
    num_pages = max(pool_size(config, model_config, lengths[g], cache_dtype,
                              max_new_tokens=max_new[g], kv_head_shards=tensor, device=device)
                    for g in parts)
    allocs = [PageAllocator(num_pages, p, seed=config.page_seed,
                            contiguous=config.contiguous_pages).allocate(
        lengths[g], n, max_new[g], max_pages_per_seq=width) for g in parts]

    def copies(name):
        # Fixed-size copy lists (null page onto itself as padding): stable shapes across batches.
        out = np.full((groups, k * (n - 1)), NULL_PAGE, np.int32)
        for g, a in enumerate(allocs):
            out[g, :len(getattr(a, name))] = getattr(a, name)
        return out.reshape(-1)

    prompt_index = np.concatenate([a.prompt_index for a in allocs])
    slots = np.repeat(np.arange(groups * k, dtype=np.int32), n)
    return BatchLayout(
        num_pages=num_pages, prompt_tokens=tokens, prompt_lengths=lengths, prompt_caps=max_new,
        prefill_table=np.concatenate([a.prefill_page_table for a in allocs]),
        page_table=np.concatenate([a.page_table for a in allocs]), prompt_index=prompt_index,
        copy_src=copies("copy_src"), copy_dst=copies("copy_dst"), slots=slots,
        sample_ids=np.tile(np.arange(n, dtype=np.int32), groups * k),
        live=slots < len(prompts))


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
    free = free_bytes(device)
    if free is None:
        raise ValueError(f"{device.platform} does not report its free memory: give num_pages or "
                         f"max_total_tokens")
    per_page = page_bytes(model_config, page_size, cache_dtype, scorer=scorer,
                          kv_head_shards=kv_head_shards)
    return int(free * fraction // per_page)


def page_bytes(model_config, page_size: int, cache_dtype, *, scorer: str = "centroid",
               kv_head_shards: int = 1) -> int:
    """One device's bytes of a pool page: K, V and the page summaries (a centroid, or Quest's
    three vectors), every layer, ``1 / kv_head_shards`` of the KV heads."""
    c = model_config
    vectors = 2 * page_size + (3 if scorer == "quest" else 1)
    heads = c.num_key_value_heads // kv_head_shards
    return c.num_hidden_layers * heads * c.head_dim * vectors * jnp.dtype(cache_dtype).itemsize


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def prompt_caps(max_new_tokens: int | Sequence[int] | None, num_prompts: int,
                config: RolloutConfig) -> np.ndarray:
    """Each prompt's response cap ``[num_prompts]`` int32 from ``max_new_tokens`` (None, one
    int, or one per prompt), each checked to lie in ``[1, config.max_new_tokens]``."""
    r = config.max_new_tokens
    if max_new_tokens is None:
        return np.full(num_prompts, r, np.int32)
    caps = np.asarray(max_new_tokens)
    if caps.ndim == 0:
        caps = np.full(num_prompts, caps)
    if caps.shape != (num_prompts,) or not np.issubdtype(caps.dtype, np.integer):
        raise ValueError(f"max_new_tokens must be one int or {num_prompts} ints (one per "
                         f"prompt), got {np.asarray(max_new_tokens).tolist()!r}")
    bad = np.flatnonzero((caps < 1) | (caps > r))
    if bad.size:
        raise ValueError(f"max_new_tokens[{bad[0]}]={caps[bad[0]]} outside [1, "
                         f"config.max_new_tokens={r}]")
    return caps.astype(np.int32)


def prompt_width(prompt_lengths, config: RolloutConfig) -> int:
    """The padded prompt length of a batch: the longest prompt rounded up to
    ``config.prompt_multiple`` (bounds recompilation)."""
    return _round_up(int(np.max(prompt_lengths)), config.prompt_multiple)


def _progress(config: RolloutConfig, total: int):
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="rollout", unit="tok", file=sys.stderr, dynamic_ncols=True)


__all__ = ["RolloutConfig", "generate", "plan_batch", "DecodeBatch", "BatchLayout", "model_params",
           "start_batch", "decode_chunk", "read_out", "prompt_caps", "prompt_width", "pool_size",
           "pages_in_free_memory", "page_bytes", "check_mesh"]
