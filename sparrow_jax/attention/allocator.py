"""Host-side page allocator for the paged KV cache (docs/design.md, section 2).

A free list over the physical page pool with a reference count per page. Every page a sequence
may need (prompt + ``max_new_tokens``) is allocated up front, so the jitted decode loop never
allocates. The n samples of one prompt share the prompt's *full* pages (counted n times, stored
once); the partial last prompt page is prefilled into sample 0's own page and copied at fork into
a fresh page of each other sample.

Physical page :data:`NULL_PAGE` is reserved and never handed out: page-table entries past a
sequence's allocation point at it, so a stray write (a sequence run past its allocation) lands in
scratch space instead of another sequence's page, and every page index stays in bounds for
kernels that read the table without masking it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

NULL_PAGE = 0


class PoolExhaustedError(RuntimeError):
    """A request needs more pages than the pool has free."""


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The pages of one batch of requests; the n samples of a prompt are adjacent rows.

    Shapes: S = sum of samples, Np = number of prompts, M = max_pages_per_seq, C = pages to copy.
    """

    seq_ids: np.ndarray          # [S] int64: handles for :meth:`PageAllocator.release`
    page_table: np.ndarray       # [S, M] int32, padded with NULL_PAGE
    prompt_index: np.ndarray     # [S] int32: the prompt row each sample comes from
    prompt_rows: np.ndarray      # [Np] int32: the sample row whose table the prefill writes into
    prompt_lengths: np.ndarray   # [Np] int32
    copy_src: np.ndarray         # [C] int32: partial prompt pages (sample 0's) ...
    copy_dst: np.ndarray         # [C] int32: ... copied into each other sample's page at fork

    @property
    def prefill_page_table(self) -> np.ndarray:
        """``[Np, M]``: the page table the prompts are prefilled through (sample 0 of each)."""
        return self.page_table[self.prompt_rows]


def pages_needed(prompt_lengths, num_samples, max_new_tokens, page_size: int) -> np.ndarray:
    """Pages per prompt ``[Np]``: full prompt pages once, plus for each sample the pages of
    ``ceil((prompt + max_new) / P)`` that are not shared full prompt pages."""
    prompt_lengths, num_samples, max_new = _as_request(prompt_lengths, num_samples,
                                                       max_new_tokens)
    full = prompt_lengths // page_size
    per_sample = -(-(prompt_lengths + max_new) // page_size) - full
    return full + num_samples * per_sample


def _as_request(prompt_lengths, num_samples, max_new_tokens):
    prompt_lengths = np.atleast_1d(np.asarray(prompt_lengths, np.int64))
    if prompt_lengths.ndim != 1:
        raise ValueError(f"prompt_lengths must be 1-D, got shape {prompt_lengths.shape}")
    num_samples = np.broadcast_to(np.asarray(num_samples, np.int64), prompt_lengths.shape)
    max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int64), prompt_lengths.shape)
    if (prompt_lengths < 1).any():
        raise ValueError(f"every prompt needs at least one token, got lengths "
                         f"{prompt_lengths.tolist()}")
    if (num_samples < 1).any():
        raise ValueError(f"num_samples must be >= 1, got {num_samples.tolist()}")
    if (max_new < 0).any():
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new.tolist()}")
    return prompt_lengths, num_samples, max_new


class PageAllocator:
    """Free list + reference counts over ``num_pages`` physical pages of ``page_size`` tokens.

    ``seed``: shuffle the initial free list (pages then land scattered in the pool; tests use it
    to make sure nothing relies on contiguous pages). ``contiguous``: hand each request's pages
    out as one run of adjacent free pages where one exists (the lowest such run), else as the
    longest free runs, so that chosen neighbouring pages can be fetched by one copy (the TPU
    kernels coalesce such runs); pages are the same in number, only placed differently.
    """

    def __init__(self, num_pages: int, page_size: int = 16, *, seed: int | None = None,
                 contiguous: bool = False):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page {NULL_PAGE} is reserved), "
                             f"got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        free = np.array([p for p in range(num_pages) if p != NULL_PAGE], np.int32)
        if seed is not None:
            np.random.default_rng(seed).shuffle(free)
        self._free = list(free[::-1])  # pop() from the end hands out free[0] first
        self.contiguous = contiguous
        self.refcount = np.zeros(num_pages, np.int32)
        self._seq_pages: dict[int, np.ndarray] = {}
        self._next_id = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Pages that can ever be allocated (the pool less the null page)."""
        return self.num_pages - 1

    def allocate(self, prompt_lengths, num_samples=1, max_new_tokens=0, *,
                 max_pages_per_seq: int | None = None) -> Allocation:
        """Allocates every page of ``num_samples`` samples of each prompt, or raises
        :class:`PoolExhaustedError` before touching the pool.

        ``prompt_lengths [Np]``; ``num_samples`` and ``max_new_tokens`` scalars or ``[Np]``.
        ``max_pages_per_seq`` fixes the page-table width (stable jit shapes across batches);
        by default the widest sequence's page count.
        """
        lengths, samples, max_new = _as_request(prompt_lengths, num_samples, max_new_tokens)
        p = self.page_size
        need = pages_needed(lengths, samples, max_new, p)
        total = int(need.sum())
        if total > self.num_free:
            where = ("the pool can never hold it" if total > self.num_usable
                     else "release finished sequences first")
            raise PoolExhaustedError(
                f"request needs {total} pages ({len(lengths)} prompts, {int(samples.sum())} "
                f"sequences, page size {p}) but the pool has {self.num_usable} usable pages, "
                f"{self.num_free} free: {where}")
        seq_pages = -(-(lengths + max_new) // p)
        width = int(seq_pages.max())
        if max_pages_per_seq is not None:
            if max_pages_per_seq < width:
                raise ValueError(f"max_pages_per_seq={max_pages_per_seq} is too small: a "
                                 f"sequence needs {width} pages")
            width = max_pages_per_seq

        num_seqs = int(samples.sum())
        table = np.full((num_seqs, width), NULL_PAGE, np.int32)
        prompt_index = np.repeat(np.arange(len(lengths), dtype=np.int32), samples)
        prompt_rows = np.concatenate([[0], np.cumsum(samples)[:-1]]).astype(np.int32)
        copy_src, copy_dst = [], []
        for i, (length, n, n_pages) in enumerate(zip(lengths, samples, seq_pages)):
            full = int(length // p)
            shared = self._take(full, refs=int(n))
            partial = length % p != 0
            for s in range(int(n)):
                own = self._take(int(n_pages) - full, refs=1)
                row = prompt_rows[i] + s
                table[row, :full] = shared
                table[row, full:n_pages] = own
                if partial and s > 0:
                    copy_src.append(table[prompt_rows[i], full])
                    copy_dst.append(own[0])
        seq_ids = np.arange(self._next_id, self._next_id + num_seqs, dtype=np.int64)
        for sid, row, n_pages in zip(seq_ids, table, np.repeat(seq_pages, samples)):
            self._seq_pages[int(sid)] = row[:n_pages].copy()
        self._next_id += num_seqs
        return Allocation(seq_ids=seq_ids, page_table=table, prompt_index=prompt_index,
                          prompt_rows=prompt_rows, prompt_lengths=lengths.astype(np.int32),
                          copy_src=np.asarray(copy_src, np.int32),
                          copy_dst=np.asarray(copy_dst, np.int32))

    def _take(self, n: int, refs: int) -> np.ndarray:
        if self.contiguous and n > 1:
            pages = _runs_of(np.asarray(self._free, np.int32), n)
            taken = set(pages.tolist())
            self._free = [q for q in self._free if q not in taken]
        else:
            pages = np.array([self._free.pop() for _ in range(n)], np.int32)
        self.refcount[pages] = refs
        return pages

    def release(self, seq_id: int) -> None:
        """Returns a finished sequence's pages; a shared page is freed with its last sharer."""
        pages = self._seq_pages.pop(int(seq_id), None)
        if pages is None:
            raise KeyError(f"sequence {seq_id} is not allocated (never was, or released twice)")
        self.refcount[pages] -= 1
        freed = pages[self.refcount[pages] == 0]
        self._free.extend(freed[::-1].tolist())


def _runs_of(free: np.ndarray, n: int) -> np.ndarray:
    """n of the ``free`` pages (n <= their count), in runs of adjacent pages: the lowest run of at
    least n if there is one, else the longest runs (ties to the lower page) until n are taken."""
    free = np.sort(free)
    starts = np.flatnonzero(np.diff(free, prepend=free[0] - 2) != 1)
    lengths = np.diff(np.append(starts, len(free)))
    fits = np.flatnonzero(lengths >= n)
    if len(fits):
        i = starts[fits[0]]
        return free[i:i + n].astype(np.int32)
    out, left = [], n
    for j in sorted(range(len(starts)), key=lambda j: (-lengths[j], starts[j])):
        take = min(left, int(lengths[j]))
        out.append(free[starts[j]:starts[j] + take])
        left -= take
        if not left:
            break
    return np.concatenate(out).astype(np.int32)
