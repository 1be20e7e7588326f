"""The host side of continuous refill (docs/design.md, section 11): which rows grow, which are
preempted, which queued samples are admitted into which slots, which rows are harvested. Pure
NumPy, no device.

:func:`sparrow_jax.rollout.refill.run_refill` drives a :class:`RefillScheduler` with what the
device reports after each chunk; :func:`simulate_refill` drives the same scheduler with rows
that run to their caps (no EOS), so a run's chunks (table width, steps, the rows' contexts)
are known without a device: ``scripts/bench_rollout.py`` integrates measured step times over
them where a real run would not fit the machine.

Shapes: S slots in G row shards of S/G; a shard's prompts are a contiguous part of the prompts
(``generate(mesh=)``'s split), each with its own queue of (prompt, sample) and its own pool.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from sparrow_jax.attention.allocator import NULL_PAGE, PageAllocator, pages_needed
from sparrow_jax.rollout.decode_loop import table_width


class GrowingPageAllocator(PageAllocator):
    """A :class:`PageAllocator` whose sequences can grow after allocation."""

    def extend(self, seq_id: int, count: int) -> np.ndarray:
        """``count`` more pages for sequence ``seq_id`` -> their ids ``[count]``; the caller
        checks :attr:`num_free` first (raises before touching the pool otherwise). With
        ``contiguous``, the pages right after the sequence's last one when all are free (its
        run goes on), else as :meth:`allocate` places them."""
        if count > self.num_free:
            raise ValueError(f"extend: {count} pages asked, {self.num_free} free")
        last = int(self._seq_pages[int(seq_id)][-1])
        after = np.arange(last + 1, last + 1 + count, dtype=np.int32)
        if (self.contiguous and after[-1] < self.num_pages
                and (self.refcount[after] == 0).all()):
            taken = set(after.tolist())
            self._free = [q for q in self._free if q not in taken]
            self.refcount[after] = 1
            pages = after
        else:
            pages = self._take(count, refs=1)
        self._seq_pages[int(seq_id)] = np.concatenate([self._seq_pages[int(seq_id)], pages])
        return pages

    @property
    def num_allocated_sequences(self) -> int:
        return len(self._seq_pages)


@dataclasses.dataclass(frozen=True)
class RefillStats:
    """What one refill run did. ``pages_in_use_after`` is 0 when every page came back. Under a
    mesh, ``num_pages`` and ``peak_pages`` are per row shard's pool, the rest summed."""

    chunks: int
    admissions: int           # samples admitted, readmissions included
    prefills: int             # admission calls (each prefills at most prefill_rows a shard)
    preemptions: int          # samples preempted
    returned: int             # rows harvested into the result (each sample once: S = N*n)
    peak_pages: int           # most pages in use at once in a pool (the null page excluded)
    num_pages: int            # the pool, the null page included
    pages_in_use_after: int
    sequences_after: int      # sequences still holding pages after the run (0)


@dataclasses.dataclass(frozen=True)
class Admission:
    """One admission call: k newcomer rows and k prompt entries per shard, ``[G, k]`` each
    (``[G, k, M]`` for the tables), padding past each shard's newcomers. ``prompts``: the prompt
    of each entry (-1: padding); ``samples``: each row's sample index; ``dst``: each row's slot
    within its shard (S/G: padding, dropped). The rest as ``decode_loop.start`` takes them."""

    prompts: np.ndarray
    prompt_lengths: np.ndarray
    caps: np.ndarray
    prefill_table: np.ndarray
    row_table: np.ndarray
    prompt_index: np.ndarray
    row_prompts: np.ndarray    # [G, k]: each row's prompt (0 on padding)
    samples: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray
    live: np.ndarray
    dst: np.ndarray


@dataclasses.dataclass
class _Slot:
    prompt: int
    sample: int
    seq_id: int
    order: int               # admission counter: the highest is preempted first
    pages: int               # pages held (the table's first columns)
    cache_length: int        # tokens in the cache (refreshed after each chunk)


@dataclasses.dataclass
class _Shard:
    alloc: GrowingPageAllocator
    queue: collections.deque
    slots: range
    first: int               # its first prompt


def shard_prompts(num_prompts: int, shards: int) -> list[range]:
    """The prompts of each row shard: equal contiguous parts (``generate(mesh=)``'s split), the
    last ones shorter or empty."""
    k = -(-num_prompts // shards)
    return [range(g * k, min((g + 1) * k, num_prompts)) for g in range(shards)]


class RefillScheduler:
    """The host state of a refill run and its decisions, in the order the engine calls them
    between chunks: :meth:`grow` (preemptions), :meth:`admit` until it returns None,
    :meth:`next_width`, then after the chunk :meth:`harvest`.

    ``prompt_lengths``, ``caps`` ``[N]``: each prompt's length and response cap; ``n`` samples
    a prompt; ``slots`` over ``shards`` row shards; a pool of ``num_pages`` per shard;
    ``width`` the page table's full width; ``prefill_rows`` rows per admission call and shard
    (None: the newcomers' next power of two)."""

    def __init__(self, prompt_lengths, caps, *, n: int, slots: int, shards: int,
                 num_pages: int, page_size: int, steps_per_call: int, width: int,
                 prefill_rows: int | None = None, table_bucket_pages: int | None = None,
                 page_seed: int | None = None, contiguous_pages: bool = False):
        self.lengths = np.asarray(prompt_lengths, np.int32)
        self.caps = np.asarray(caps, np.int32)
        self.n, self.p, self.c = n, page_size, steps_per_call
        self.width, self.prefill_rows, self.bucket = width, prefill_rows, table_bucket_pages
        self.num_pages = num_pages
        per = slots // shards
        parts = shard_prompts(len(self.lengths), shards)
        self.k = len(parts[0])                       # prompts per shard (the last may hold fewer)
        self.shards = [_Shard(alloc=GrowingPageAllocator(num_pages, page_size, seed=page_seed,
                                                         contiguous=contiguous_pages),
                              queue=collections.deque((i, j) for i in part for j in range(n)),
                              slots=range(g * per, (g + 1) * per), first=g * self.k)
                       for g, part in enumerate(parts)]
        self.table = np.full((slots, width), NULL_PAGE, np.int32)  # the page table, per slot
        self.held: list[_Slot | None] = [None] * slots
        self.counters = collections.Counter()
        self.peak = 0
        # Tokens each prompt's first chunk may write.
        self.first_chunk = np.minimum(steps_per_call, self.caps)

    @property
    def busy(self) -> bool:
        """Whether samples are queued or rows running."""
        return any(sh.queue for sh in self.shards) or any(h is not None for h in self.held)

    @property
    def result_rows(self) -> int:
        """Rows of the result per shard: k prompts x n (placeholders past the prompts)."""
        return self.k * self.n

    def _cap_pages(self, slot: _Slot) -> int:
        return -(-(int(self.lengths[slot.prompt]) + int(self.caps[slot.prompt])) // self.p)

    def _growth(self, slot: _Slot) -> int:
        # The next chunk writes positions cache_length .. cache_length + c - 1.
        return max(min(-(-(slot.cache_length + self.c) // self.p), self._cap_pages(slot))
                   - slot.pages, 0)

    def _release(self, shard: _Shard, s: int) -> None:
        shard.alloc.release(self.held[s].seq_id)
        self.held[s] = None
        self.table[s] = NULL_PAGE

    def grow(self) -> list[int]:
        """Per shard: gives each running row the pages its next chunk writes into, preempting
        the newest rows (samples back to the front of the queue) while the pool falls short
        -> the preempted slots."""
        preempted = []
        for sh in self.shards:
            evicted = []
            while True:
                running = [s for s in sh.slots if self.held[s] is not None]
                if sum(self._growth(self.held[s]) for s in running) <= sh.alloc.num_free:
                    break
                newest = max(running, key=lambda s: self.held[s].order)
                evicted.append((self.held[newest].prompt, self.held[newest].sample))
                preempted.append(newest)
                self._release(sh, newest)
            sh.queue.extendleft(sorted(evicted, reverse=True))
            for s in sh.slots:
                h = self.held[s]
                if h is not None and self._growth(h):
                    more = self._growth(h)
                    self.table[s, h.pages:h.pages + more] = sh.alloc.extend(h.seq_id, more)
                    h.pages += more
        self.counters["preemptions"] += len(preempted)
        return preempted

    def _pick(self, shard: _Shard) -> list[list]:
        """Pops the queued samples one shard admits, in order, while a slot is free and its
        pool holds their prompt pages and first chunk -> ``[[prompt, [samples]], ...]``."""
        held, p = self.held, self.p
        free = sum(held[s] is None for s in shard.slots)
        # Keep back the pages the running rows take in the next chunk, so that newcomers are
        # not preempted by the growth of the rows already there (thrashing); an empty shard
        # admits.
        reserve = sum(-(-self.c // p) + 1 for s in shard.slots if held[s] is not None)
        budget = (shard.alloc.num_free - reserve if free < len(shard.slots)
                  else shard.alloc.num_free)
        limit = min(free, self.prefill_rows or free)
        groups: list[list] = []
        taken = 0
        while shard.queue and taken < limit:
            i, j = shard.queue[0]
            new_group = not groups or groups[-1][0] != i
            first = self.first_chunk[i]
            cost = int(pages_needed(self.lengths[i], 1 if new_group else 2, first, p)[0])
            if not new_group:   # one more sample of the last group: its own pages only
                cost -= int(pages_needed(self.lengths[i], 1, first, p)[0])
            if cost > budget:
                break
            budget -= cost
            shard.queue.popleft()
            if new_group:
                groups.append([i, []])
            groups[-1][1].append(j)
            taken += 1
        return groups

    def admit(self) -> Admission | None:
        """One admission call's newcomers, every shard's, placed in their slots (their pages
        allocated) -> its arrays, or None when no shard admits anything."""
        picked = [self._pick(sh) for sh in self.shards]
        taken = [sum(len(g[1]) for g in groups) for groups in picked]
        if not any(taken):
            return None
        per = len(self.shards[0].slots)
        # Rows and prompt entries per shard, bucketed to powers of two (a compilation each).
        k = (min(1 << (max(taken) - 1).bit_length(), per) if self.prefill_rows is None
             else self.prefill_rows)
        g_count, w, p = len(self.shards), self.width, self.p
        adm = Admission(
            prompts=np.full((g_count, k), -1, np.int32),
            prompt_lengths=np.ones((g_count, k), np.int32),
            caps=np.ones((g_count, k), np.int32),
            prefill_table=np.full((g_count, k, w), NULL_PAGE, np.int32),
            row_table=np.full((g_count, k, w), NULL_PAGE, np.int32),
            prompt_index=np.zeros((g_count, k), np.int32),
            row_prompts=np.zeros((g_count, k), np.int32),
            samples=np.zeros((g_count, k), np.int32),
            copy_src=np.full((g_count, k), NULL_PAGE, np.int32),
            copy_dst=np.full((g_count, k), NULL_PAGE, np.int32),
            live=np.zeros((g_count, k), bool),
            dst=np.full((g_count, k), per, np.int32))
        for g, (sh, groups) in enumerate(zip(self.shards, picked)):
            if not groups:
                continue
            prompts = [grp[0] for grp in groups]
            counts = [len(grp[1]) for grp in groups]
            a = sh.alloc.allocate(self.lengths[prompts], counts, self.first_chunk[prompts],
                                  max_pages_per_seq=w)
            m, t = len(prompts), taken[g]
            adm.prompts[g, :m] = prompts
            adm.prompt_lengths[g, :m] = self.lengths[prompts]
            adm.caps[g, :m] = self.caps[prompts]
            adm.prefill_table[g, :m] = a.prefill_page_table
            adm.row_table[g, :t] = a.page_table
            adm.prompt_index[g, :t] = a.prompt_index
            adm.copy_src[g, :len(a.copy_src)] = a.copy_src
            adm.copy_dst[g, :len(a.copy_dst)] = a.copy_dst
            samples = [(grp[0], j) for grp in groups for j in grp[1]]
            adm.row_prompts[g, :t] = [i for i, _ in samples]
            adm.samples[g, :t] = [j for _, j in samples]
            adm.live[g, :t] = True
            free = [s for s in sh.slots if self.held[s] is None][:t]
            adm.dst[g, :t] = [s - sh.slots.start for s in free]
            pages = -(-(self.lengths[prompts] + self.first_chunk[prompts]) // p)
            for row, ((i, j), s) in enumerate(zip(samples, free)):
                self.counters["order"] += 1
                self.held[s] = _Slot(prompt=i, sample=j, seq_id=int(a.seq_ids[row]),
                                     order=self.counters["order"],
                                     pages=int(pages[a.prompt_index[row]]),
                                     cache_length=int(self.lengths[i]))
                self.table[s] = a.page_table[row]
        self.counters["admissions"] += sum(taken)
        self.counters["prefills"] += 1
        return adm

    def next_width(self) -> tuple[int, dict[int, int]]:
        """After admission: the next chunk's page-table width and the running rows' contexts
        ``{slot: cached tokens}``. RuntimeError if a shard with queued samples holds no row
        (its empty pool admitted none)."""
        for g, sh in enumerate(self.shards):
            if sh.queue and all(self.held[s] is None for s in sh.slots):
                raise RuntimeError(f"generate_refill: no sample could be admitted into the "
                                   f"empty pool of row shard {g}")
        self.peak = max([self.peak] + [sh.alloc.num_usable - sh.alloc.num_free
                                       for sh in self.shards])
        contexts = {s: h.cache_length for s, h in enumerate(self.held) if h is not None}
        longest = max(contexts.values())
        return table_width(longest + self.c + 1, self.p, self.width, self.bucket), contexts

    def harvest(self, finished: np.ndarray, cache_lengths: np.ndarray) -> np.ndarray:
        """After a chunk (``finished``, ``cache_lengths`` ``[S]`` from the device): frees the
        finished rows -> ``[S]`` each slot's row of its shard's result
        (:attr:`result_rows`: not collected)."""
        self.counters["chunks"] += 1
        dst = np.full(len(self.held), self.result_rows, np.int32)
        for sh in self.shards:
            for s in sh.slots:
                h = self.held[s]
                if h is None:
                    continue
                h.cache_length = int(cache_lengths[s])
                if finished[s]:
                    dst[s] = (h.prompt - sh.first) * self.n + h.sample
                    self.counters["returned"] += 1
                    self._release(sh, s)
        return dst

    def narrow(self, floor: int) -> np.ndarray | None:
        """Once no shard has samples queued (the run's tail): when every shard's running rows
        fit in a power of two of slots, ``floor`` at least, below the shard's slots, moves each
        shard's running rows to its first slots and drops the rest -> ``[G * per]`` the old
        slot of each new slot (the shard's free slots fill it up), or None (no change). Rows
        keep their pages and order; a preempted sample readmitted later gets a free slot of
        the narrower shard (its own slot came free)."""
        if any(sh.queue for sh in self.shards):
            return None
        old = len(self.shards[0].slots)
        running = [[s for s in sh.slots if self.held[s] is not None] for sh in self.shards]
        most = max(len(r) for r in running)
        per = max(floor, 1 << max(most - 1, 0).bit_length())
        if per >= old:
            return None
        src = []
        for g, (sh, run) in enumerate(zip(self.shards, running)):
            src += (run + [s for s in sh.slots if self.held[s] is None])[:per]
            sh.slots = range(g * per, (g + 1) * per)
        src = np.asarray(src, np.int32)
        self.held = [self.held[s] for s in src]
        self.table = self.table[src]
        return src

    def stats(self) -> RefillStats:
        return RefillStats(
            chunks=self.counters["chunks"], admissions=self.counters["admissions"],
            prefills=self.counters["prefills"], preemptions=self.counters["preemptions"],
            returned=self.counters["returned"], peak_pages=self.peak,
            num_pages=self.num_pages,
            pages_in_use_after=sum(sh.alloc.num_usable - sh.alloc.num_free
                                   for sh in self.shards),
            sequences_after=sum(sh.alloc.num_allocated_sequences for sh in self.shards))


def simulate_refill(prompt_lengths, caps, *, n: int, slots: int, num_pages: int,
                    page_size: int, steps_per_call: int, width: int,
                    prefill_rows: int | None = None, table_bucket_pages: int | None = None,
                    page_seed: int | None = None, contiguous_pages: bool = False,
                    shards: int = 1, tail_slots: int | None = None
                    ) -> tuple[list[dict], RefillStats]:
    """The chunks of a refill run whose rows all run to their caps (no EOS, no stop
    sequences), without a device -> (one dict per chunk, as ``run_refill``'s ``on_chunk``
    gets: ``width``, ``steps``, ``contexts``, ``slots``; the run's stats). Arguments as
    :class:`RefillScheduler` and ``run_refill`` (``tail_slots``) take them; with the same ones
    the real run's chunks are these.

    A row admitted with prompt length L has L tokens cached and its first token sampled (a cap
    of 1 finishes it there); each decode step caches one more and samples one more, until the
    cap. A chunk runs ``steps_per_call`` steps, fewer if every row finishes first."""
    sched = RefillScheduler(prompt_lengths, caps, n=n, slots=slots, shards=shards,
                            num_pages=num_pages, page_size=page_size,
                            steps_per_call=steps_per_call, width=width,
                            prefill_rows=prefill_rows, table_bucket_pages=table_bucket_pages,
                            page_seed=page_seed, contiguous_pages=contiguous_pages)
    cached = np.zeros(slots, np.int64)       # the device's view, per slot
    sampled = np.zeros(slots, np.int64)
    cap = np.zeros(slots, np.int64)
    chunks = []
    while sched.busy:
        for s in sched.grow():
            cap[s] = sampled[s]          # preempted: finished, as the engine marks it
        while (adm := sched.admit()) is not None:
            per = len(sched.shards[0].slots)
            for g in range(adm.dst.shape[0]):
                for row in np.flatnonzero(adm.live[g]):
                    s = g * per + int(adm.dst[g, row])
                    i = int(adm.row_prompts[g, row])
                    cached[s], sampled[s], cap[s] = sched.lengths[i], 1, sched.caps[i]
        w, contexts = sched.next_width()
        running = np.array(sorted(contexts))
        left = cap[running] - sampled[running]
        steps = int(min(steps_per_call, left.max()))
        take = np.minimum(left, steps)
        cached[running] += take
        sampled[running] += take
        finished = np.zeros(len(sched.held), bool)
        finished[running] = sampled[running] >= cap[running]
        sched.harvest(finished, cached)
        chunks.append(dict(width=w, steps=steps, slots=len(sched.held),
                           contexts=np.fromiter(contexts.values(), np.int64)))
        if tail_slots and sched.busy and (src := sched.narrow(tail_slots // shards)) is not None:
            cached, sampled, cap = cached[src], sampled[src], cap[src]
    return chunks, sched.stats()


__all__ = ["RefillScheduler", "Admission", "RefillStats", "GrowingPageAllocator",
           "simulate_refill", "shard_prompts"]
