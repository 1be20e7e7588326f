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

A sample draws position t from the stream of (key, prompt id, sample index, t) alone
(:mod:`sparrow_jax.rollout.sampling`), so its tokens do not depend on the slot, the admission
order or preemption: they are the static engine's.

Typical use::

    rollout = generate_refill(model, prompts, RolloutConfig(n=8, num_pages=4096), key,
                              schedule, slots=64)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention.allocator import NULL_PAGE, PageAllocator, pages_needed
from sparrow_jax.attention.paged_cache import init_cache
from sparrow_jax.models.qwen3 import check_tokens
from sparrow_jax.rollout.budget import runtime_schedule
from sparrow_jax.rollout.decode_loop import (UNFINISHED, DecodeSettings, LoopState, run_chunk,
                                             start, table_width)
from sparrow_jax.rollout.engine import (RolloutConfig, model_params, pool_size, prompt_caps,
                                        prompt_width)
from sparrow_jax.rollout.sampling import stream_keys
from sparrow_jax.rollout.types import FinishReason, Rollout
from sparrow_jax.schedule import BudgetSchedule

class GrowingPageAllocator(PageAllocator):
    """A :class:`PageAllocator` whose sequences can grow after allocation."""

    def extend(self, seq_id: int, count: int) -> np.ndarray:
        """``count`` more pages for sequence ``seq_id`` -> their ids ``[count]``; the caller
        checks :attr:`num_free` first (raises before touching the pool otherwise)."""
        if count > self.num_free:
            raise ValueError(f"extend: {count} pages asked, {self.num_free} free")
        pages = self._take(count, refs=1)
        self._seq_pages[int(seq_id)] = np.concatenate([self._seq_pages[int(seq_id)], pages])
        return pages

    @property
    def num_allocated_sequences(self) -> int:
        return len(self._seq_pages)


@dataclasses.dataclass(frozen=True)
class RefillStats:
    """What one refill run did. ``pages_in_use_after`` is 0 when every page came back."""

    chunks: int
    admissions: int           # samples admitted, readmissions included
    preemptions: int          # samples preempted
    returned: int             # rows harvested into the result (each sample once: S = N*n)
    peak_pages: int           # most pages in use at once (the null page excluded)
    num_pages: int            # the pool, the null page included
    pages_in_use_after: int
    sequences_after: int      # sequences still holding pages after the run (0)


@dataclasses.dataclass
class _Slot:
    prompt: int
    sample: int
    seq_id: int
    order: int               # admission counter: the highest is preempted first
    pages: int               # pages held (the table's first columns)
    cache_length: int        # tokens in the cache (host's copy, refreshed after each chunk)


def generate_refill(model, prompts: Sequence[Sequence[int]], config: RolloutConfig,
                    key: jax.Array, schedule: BudgetSchedule | None = None, *, slots: int,
                    prefill_rows: int | None = None, lora: bool = False,
                    prompt_ids: Sequence[int] | None = None,
                    schedule_bound: BudgetSchedule | None = None,
                    max_new_tokens: int | Sequence[int] | None = None) -> Rollout:
    """:func:`~sparrow_jax.rollout.engine.generate` with ``slots`` decode slots refilled as rows
    finish, pages allocated as rows grow from a pool of ``config.num_pages`` (sized as
    :func:`~sparrow_jax.rollout.engine.pool_size` says). Same arguments and result layout (rows
    ``i*n .. i*n+n-1`` answer prompt i), same tokens per sample.

    ``prefill_rows``: the rows one admission prefills, the newcomers padded to it (one
    compilation); None: the next power of two of the newcomers, at most ``slots`` (less padded
    work, a compilation per power). ``schedule_bound``, ``max_new_tokens`` (per-prompt caps):
    as in ``generate``; a row's pages grow up to its own cap."""
    return run_refill(model, prompts, config, key, schedule, slots=slots,
                      prefill_rows=prefill_rows, lora=lora, prompt_ids=prompt_ids,
                      schedule_bound=schedule_bound, max_new_tokens=max_new_tokens)[0]


def run_refill(model, prompts: Sequence[Sequence[int]], config: RolloutConfig, key: jax.Array,
               schedule: BudgetSchedule | None = None, *, slots: int,
               prefill_rows: int | None = None, lora: bool = False,
               prompt_ids: Sequence[int] | None = None,
               schedule_bound: BudgetSchedule | None = None,
               max_new_tokens: int | Sequence[int] | None = None
               ) -> tuple[Rollout, RefillStats]:
    """:func:`generate_refill` -> (rollout, :class:`RefillStats`)."""
    cfg = model.config
    prompts = [list(p) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_refill needs at least one prompt, and every prompt at least "
                         "one token")
    for p in prompts:
        check_tokens(p, cfg.vocab_size)
    if slots < 1:
        raise ValueError(f"generate_refill: slots must be >= 1, got {slots}")
    if prefill_rows is not None and not 1 <= prefill_rows <= slots:
        raise ValueError(f"generate_refill: prefill_rows must be in [1, slots={slots}], got "
                         f"{prefill_rows}")
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
    num_pages = pool_size(config, cfg, lengths, cache_dtype, max_new_tokens=caps)
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
    settings = DecodeSettings.from_config(config, cfg.vocab_size, shape,
                                          lora=lora).for_width(bound, width)
    graphdef, params = model_params(model)
    alloc = GrowingPageAllocator(num_pages, p, seed=config.page_seed)
    table = np.full((slots, width), NULL_PAGE, np.int32)   # the host's page table, per slot
    state = _empty_state(cfg, num_pages, slots, tp + r, r, settings.top_k, config, cache_dtype,
                         key)
    num_rows = len(prompts) * n
    out = _empty_output(num_rows, tp + r, r, settings.top_k, n)
    queue = collections.deque((i, j) for i in range(len(prompts)) for j in range(n))
    held: list[_Slot | None] = [None] * slots
    counters = collections.Counter()
    peak = 0

    def cap_pages(slot: _Slot) -> int:
        return -(-(int(lengths[slot.prompt]) + int(caps[slot.prompt])) // p)

    def growth(slot: _Slot) -> int:
        # The next chunk writes positions cache_length .. cache_length + c - 1.
        return max(min(-(-(slot.cache_length + c) // p), cap_pages(slot)) - slot.pages, 0)

    def release(s: int) -> None:
        alloc.release(held[s].seq_id)
        held[s] = None
        table[s] = NULL_PAGE

    while queue or any(h is not None for h in held):
        # Grow the running rows, preempting the newest while the pool falls short.
        evicted = []
        while True:
            running = [s for s, h in enumerate(held) if h is not None]
            need = sum(growth(held[s]) for s in running)
            if need <= alloc.num_free:
                break
            newest = max(running, key=lambda s: held[s].order)
            evicted.append((held[newest].prompt, held[newest].sample))
            release(newest)
            state = state._replace(finish=state.finish.at[newest].set(int(FinishReason.LENGTH)))
        counters["preemptions"] += len(evicted)
        queue.extendleft(sorted(evicted, reverse=True))
        for s, h in enumerate(held):
            if h is not None and growth(h):
                more = growth(h)
                table[s, h.pages:h.pages + more] = alloc.extend(h.seq_id, more)
                h.pages += more

        state = _admit_pending(state, queue, held, table, alloc, counters, graphdef, params,
                               tokens, lengths, caps, ids, key, settings, config, width,
                               prefill_rows)
        peak = max(peak, alloc.num_usable - alloc.num_free)
        if all(h is None for h in held):
            raise RuntimeError("generate_refill: no sample could be admitted into an empty pool")

        longest = max(h.cache_length for h in held if h is not None)
        w = table_width(longest + c + 1, p, width, config.table_bucket_pages)
        state = state._replace(cache=state.cache.replace(page_table=jnp.asarray(table[:, :w])))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            state, _ = run_chunk(graphdef, params, state, values, c,
                                 settings=settings.for_width(bound, w))
        counters["chunks"] += 1

        finish, cache_lengths = np.asarray(state.finish), np.asarray(state.cache.lengths)
        dst = np.full(slots, num_rows, np.int32)     # out of range: not collected
        for s, h in enumerate(held):
            if h is None:
                continue
            h.cache_length = int(cache_lengths[s])
            if finish[s] != UNFINISHED:
                dst[s] = h.prompt * n + h.sample
                counters["returned"] += 1
                release(s)
        if (dst < num_rows).any():
            out = _collect(out, state, jnp.asarray(dst))

    stats = RefillStats(
        chunks=counters["chunks"], admissions=counters["admissions"],
        preemptions=counters["preemptions"], returned=counters["returned"], peak_pages=peak,
        num_pages=num_pages,
        pages_in_use_after=alloc.num_usable - alloc.num_free,
        sequences_after=alloc.num_allocated_sequences)
    return out, stats


def _admit_pending(state: LoopState, queue, held, table, alloc: GrowingPageAllocator, counters,
                   graphdef, params, tokens, lengths, caps, ids, key,
                   settings: DecodeSettings, config: RolloutConfig, width: int,
                   prefill_rows: int | None) -> LoopState:
    """Admits queued samples in order while a slot is free and the pool holds their prompt pages
    and first chunk; prefills them (one call) and scatters them into their slots."""
    p, r, c = config.page_size, config.max_new_tokens, config.steps_per_call
    first = np.minimum(c, caps)      # [N] tokens each prompt's first chunk may write
    free_slots = [s for s, h in enumerate(held) if h is None]
    groups: list[list] = []          # [prompt, samples]
    # Keep back the pages the running rows take in the next chunk, so that newcomers are not
    # preempted by the growth of the rows already there (thrashing); an empty batch admits.
    reserve = sum(-(-c // p) + 1 for h in held if h is not None)
    budget = alloc.num_free - reserve if len(free_slots) < len(held) else alloc.num_free
    taken = 0
    while queue and taken < min(len(free_slots), prefill_rows or len(free_slots)):
        i, j = queue[0]
        new_group = not groups or groups[-1][0] != i
        cost = int(pages_needed(lengths[i], 1 if new_group else 2, first[i], p)[0])
        if not new_group:   # one more sample of the last group: its own pages only
            cost -= int(pages_needed(lengths[i], 1, first[i], p)[0])
        if cost > budget:
            break
        budget -= cost
        queue.popleft()
        if new_group:
            groups.append([i, []])
        groups[-1][1].append(j)
        taken += 1
    if not taken:
        return state

    # Rows and prompt entries, bucketed to powers of two (a compilation each), at most S.
    k = min(1 << (taken - 1).bit_length(), len(held)) if prefill_rows is None else prefill_rows
    prompts = [g[0] for g in groups]
    counts = [len(g[1]) for g in groups]
    a = alloc.allocate(lengths[prompts], counts, first[prompts], max_pages_per_seq=width)
    prefill_table = np.full((k, width), NULL_PAGE, np.int32)
    prefill_table[:len(prompts)] = a.prefill_page_table
    row_table = np.full((k, width), NULL_PAGE, np.int32)
    row_table[:taken] = a.page_table
    prompt_index = np.zeros(k, np.int32)
    prompt_index[:taken] = a.prompt_index
    prompt_tokens = np.zeros((k, tokens.shape[1]), np.int32)
    prompt_tokens[:len(prompts)] = tokens[prompts]
    prompt_lengths = np.ones(k, np.int32)
    prompt_lengths[:len(prompts)] = lengths[prompts]
    new_caps = np.ones(k, np.int32)
    new_caps[:len(prompts)] = caps[prompts]
    copy_src = np.full(k, NULL_PAGE, np.int32)
    copy_dst = np.full(k, NULL_PAGE, np.int32)
    copy_src[:len(a.copy_src)] = a.copy_src
    copy_dst[:len(a.copy_dst)] = a.copy_dst
    samples = [(g[0], j) for g in groups for j in g[1]]
    stream_prompts = np.zeros(k, np.int32)
    stream_samples = np.zeros(k, np.int32)
    stream_prompts[:taken] = [ids[i] for i, _ in samples]
    stream_samples[:taken] = [j for _, j in samples]
    live = np.arange(k) < taken
    dst = np.full(k, len(held), np.int32)          # out of range: placeholder rows dropped
    dst[:taken] = free_slots[:taken]

    # The pool is donated to the prefill and comes back as the newcomers' cache.
    cache = _prefill_cache(state.cache, jnp.asarray(prefill_table))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        new = start(graphdef, params, cache, jnp.asarray(prompt_tokens),
                    jnp.asarray(prompt_lengths), jnp.asarray(new_caps), jnp.asarray(row_table),
                    jnp.asarray(prompt_index), jnp.asarray(copy_src), jnp.asarray(copy_dst),
                    stream_keys(key, stream_prompts, stream_samples), jnp.asarray(live),
                    settings=settings, response_capacity=r)
    state = _admit(state._replace(cache=state.cache.replace(
        k_pages=new.cache.k_pages, v_pages=new.cache.v_pages, centroids=new.cache.centroids,
        kmin=new.cache.kmin, kmax=new.cache.kmax)), new._replace(cache=_rows_of(new.cache)),
        jnp.asarray(dst))

    pages = -(-(lengths[prompts] + first[prompts]) // p)
    for row, ((i, j), s) in enumerate(zip(samples, free_slots)):
        counters["order"] += 1
        held[s] = _Slot(prompt=i, sample=j, seq_id=int(a.seq_ids[row]), order=counters["order"],
                        pages=int(pages[a.prompt_index[row]]), cache_length=int(lengths[i]))
        table[s] = a.page_table[row]
    counters["admissions"] += taken
    return state


def _prefill_cache(cache, prefill_table: jax.Array):
    """The pool of ``cache`` with empty per-row fields for the ``k`` newcomer prompts."""
    k = prefill_table.shape[0]

    def rows(x):
        return None if x is None else jnp.zeros(x.shape[:1] + (k,) + x.shape[2:], x.dtype)

    return cache.replace(page_table=prefill_table, lengths=jnp.zeros((k,), jnp.int32),
                         partial_sum=rows(cache.partial_sum),
                         partial_min=rows(cache.partial_min),
                         partial_max=rows(cache.partial_max))


def _rows_of(cache):
    """The per-row fields of a cache (its pool dropped: it lives on in the loop state)."""
    return (cache.lengths, cache.partial_sum, cache.partial_min, cache.partial_max)


@functools.partial(jax.jit, donate_argnames=("state",))
def _admit(state: LoopState, new: LoopState, dst: jax.Array) -> LoopState:
    """Scatters the newcomer rows ``new [k]`` (cache: its per-row fields) into slots ``dst [k]``
    of ``state [S]`` (``dst`` = S: dropped)."""
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
    fields = {f: put(getattr(state, f), getattr(new, f)) for f in LoopState._fields if f != "cache"}
    return LoopState(cache=cache, **fields)


@functools.partial(jax.jit, donate_argnames=("out",))
def _collect(out: Rollout, state: LoopState, dst: jax.Array) -> Rollout:
    """Copies slot s of ``state`` into row ``dst[s]`` of ``out`` (out of range: skipped)."""
    def put(old, value):
        return old.at[dst].set(value, mode="drop")

    return out.replace(
        tokens=put(out.tokens, state.tokens), prompt_lengths=put(out.prompt_lengths,
                                                                  state.prompt_lengths),
        response_lengths=put(out.response_lengths, state.response_lengths),
        logprobs=put(out.logprobs, state.logprobs), topk_ids=put(out.topk_ids, state.topk_ids),
        topk_logprobs=put(out.topk_logprobs, state.topk_logprobs),
        budget_pages=put(out.budget_pages, state.budgets),
        finish_reason=put(out.finish_reason, state.finish))


def _empty_state(model_config, num_pages, slots, t, r, k, config, cache_dtype, key) -> LoopState:
    """S idle slots (finished; cache length 1 on the null page, so idle rows attend to
    something) over an empty pool."""
    cache = init_cache(model_config, num_pages, np.zeros((slots, 1), np.int32),
                       page_size=config.page_size, dtype=cache_dtype, scorer=config.scorer)
    cache = cache.replace(lengths=jnp.ones((slots,), jnp.int32))
    return LoopState(
        cache=cache, tokens=jnp.zeros((slots, t), jnp.int32),
        prompt_lengths=jnp.ones((slots,), jnp.int32), last=jnp.zeros((slots,), jnp.int32),
        response_lengths=jnp.zeros((slots,), jnp.int32),
        finish=jnp.full((slots,), int(FinishReason.LENGTH), jnp.int32),
        caps=jnp.zeros((slots,), jnp.int32),
        logprobs=jnp.zeros((slots, r), jnp.float32),
        topk_ids=jnp.zeros((slots, r, k), jnp.int32),
        topk_logprobs=jnp.full((slots, r, k), -jnp.inf, jnp.float32),
        budgets=jnp.zeros((slots, r), jnp.int32),
        streams=stream_keys(key, np.zeros(slots), np.zeros(slots)))


def _empty_output(rows, t, r, k, n) -> Rollout:
    return Rollout(
        tokens=jnp.zeros((rows, t), jnp.int32), prompt_lengths=jnp.zeros((rows,), jnp.int32),
        response_lengths=jnp.zeros((rows,), jnp.int32),
        logprobs=jnp.zeros((rows, r), jnp.float32),
        topk_ids=jnp.zeros((rows, r, k), jnp.int32),
        topk_logprobs=jnp.full((rows, r, k), -jnp.inf, jnp.float32),
        budget_pages=jnp.zeros((rows, r), jnp.int32),
        finish_reason=jnp.full((rows,), UNFINISHED, jnp.int32),
        prompt_index=jnp.asarray(np.repeat(np.arange(rows // n, dtype=np.int32), n)))


__all__ = ["generate_refill", "run_refill", "RefillStats", "GrowingPageAllocator"]
