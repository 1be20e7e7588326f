"""Paged top-k sparse decode as Pallas kernels (Triton lowering on GPU, interpret mode on CPU).

One decode step of docs/design.md, section 3 for one layer, in three kernels and a small combine:

1. ``_score_kernel``, grid ``(B, Hkv, M / C)``: float32 scores of the pages that may be chosen
   (``1 .. n-3``): ``qbar . centroid``, or Quest's bound (the largest over the group's heads of
   ``sum_d max(q_d kmax_d, q_d kmin_d)``), turned into int32 keys whose signed order is the
   order of the scores (ineligible slots get the smallest key), reading one vector a page of
   the row (two for Quest), nothing past it. ``GpuDecodeTuning.score``: the same keys from
   XLA, or (past a wave of lists that fill their last round, the default) one CUDA kernel.
2. ``_select_kernel``, grid ``(B, Hkv)``: the ``K - 3``-th largest key by a bitwise threshold
   search (a block-wide count per bit from the sign bit down, stopping once exactly ``K - 3``
   keys reach it; no sort), ties to the lower page by a bitwise search over slots, plus the
   reserved pages, compacted in page order into a page list (it also zeroes the balanced
   attention's arrival counter). Its cost, and the scoring's, follows the row's length, not
   the table's width (continuous refill: a long row beside short ones). The CUDA selection
   (``GpuDecodeTuning.select``) writes the same lists; where the CUDA attention's blocks
   each hold one list part, they choose their lists themselves.
3. the attention over the lists (:mod:`pallas_kernels.paged_attend_gpu`, shared with dense
   decode): online softmax of all query heads of the group over the listed pages, each list
   split (flash-decoding) so that small batches still fill the GPU, each split looping only
   over its share of its own row's list, so the cost follows each sequence's budget.

Shapes inside the kernels are powers of two (Triton's rule): the page table is padded to
``Mpad`` slots, the page list to ``Kpad`` entries, and a group's query heads are read from the
unpadded ``[B, Hq, D]`` into ``Rpad >= 16`` rows (the matrix units' minimum; so any group size,
e.g. 5, works) by a masked load inside the kernels: padding in XLA cost a kernel launch a
layer, and 16 rows where Qwen3-1.7B's group holds 2 are 8x the bytes. The settings are one
static :class:`GpuDecodeTuning`; variants found no faster: notes/kernel_notes.md.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attend_gpu import (attend_page_lists, default_splits, group_queries,
                                             pow2, sm_count)
from pallas_kernels.sparse_attend_cuda import MAX_CHOICE_WIDTH as CUDA_MAX_CHOICE_WIDTH
from pallas_kernels.sparse_attend_cuda import MAX_PARTS as CUDA_MAX_PARTS
from pallas_kernels.sparse_attend_cuda import (attend_page_lists_cuda, attend_selected_cuda,
                                               default_cuda_splits, score_select_attend_cuda,
                                               scores_and_chooses, select_attend_lists_cuda,
                                               select_lists_cuda, selects_in_attention)
from pallas_kernels.sparse_attend_cuda import unavailable as cuda_unavailable
from pallas_kernels.sparse_attend_cuda import unsupported_args as cuda_unsupported_args
from sparrow_jax.attention.selection import MIN_BUDGET_PAGES, SCORERS, num_pages, order_key
from sparrow_jax.attention.sparse_args import (as_summaries, check_sparse_decode_args,
                                               checked_summaries)

RESERVED = MIN_BUDGET_PAGES    # page 0 and the last two pages (docs/design.md, section 3)
_INT_MIN = -(2 ** 31)
_INT_MAX = 2 ** 31 - 1
# Scalars inside kernels are typed (jnp.int32(0), not 0): the Triton lowering gives a weakly
# typed constant in jnp.where the predicate's type.


def _is_pow2(x: int) -> bool:
    return x >= 1 and not x & (x - 1)


ATTEND_IMPLS = ("auto", "cuda", "pallas")
SCORE_IMPLS = ("auto", "pallas", "xla", "cuda")
SELECT_IMPLS = ("auto", "pallas", "cuda")


def resolve_attend(choice: str, q, k_pages, page_size: int, interpret: bool) -> str:
    """``GpuDecodeTuning.attend`` decided for these arguments: "cuda" or "pallas"; an explicit
    "cuda" that cannot run raises one line saying why. "auto" falls back to pallas silently
    for arguments the CUDA kernel does not take (a float32 cache, another head size), with a
    warning when it is the machine that lacks what it needs (:func:`cuda_unavailable`)."""
    if choice == "pallas" or (choice == "auto" and interpret):
        return "pallas"
    bad_args = cuda_unsupported_args(q, k_pages, page_size)
    why = bad_args or ("it runs on a GPU only, not in interpret mode" if interpret
                       else cuda_unavailable())
    if why is None:
        return "cuda"
    if choice == "cuda":
        raise ValueError(f"GpuDecodeTuning(attend='cuda'): {why}")
    if bad_args is None:
        # Python's default filter shows it once per run.
        warnings.warn(f"sparse decode: the Pallas kernel instead of the CUDA one for "
                      f"attend: {why}", stacklevel=3)
    return "pallas"


def check_launch_settings(tuning) -> None:
    """The launch settings the GPU kernels share (Pallas' :class:`GpuDecodeTuning` and the
    Triton path's): block_pages and score_chunk (None allowed), splits, warps, attend_stages."""
    if tuning.block_pages is not None and not _is_pow2(tuning.block_pages):
        raise ValueError(f"block_pages must be a power of two, got {tuning.block_pages}")
    if tuning.splits is not None and tuning.splits < 1:
        raise ValueError(f"splits must be >= 1, got {tuning.splits}")
    if tuning.score_chunk is not None and (not _is_pow2(tuning.score_chunk)
                                           or tuning.score_chunk < 16):
        raise ValueError(f"score_chunk must be a power of two >= 16, got {tuning.score_chunk}")
    for name in ("score_warps", "select_warps", "attend_warps"):
        w = getattr(tuning, name)
        if not _is_pow2(w) or w > 32:
            raise ValueError(f"{name} must be a power of two in [1, 32], got {w}")
    if tuning.attend_stages < 1:
        raise ValueError(f"attend_stages must be >= 1, got {tuning.attend_stages}")


def checked_args(entry: str, q, k_pages, v_pages, page_table, lengths, budget_pages, *,
                 page_size, scorer, centroids, summaries, max_budget_pages, block_pages,
                 limits=None) -> tuple:
    """The checks of a GPU kernel's entry point ``entry`` (those of ``sparse_decode`` and the
    kernels' own ``limits``, default :func:`kernel_limits`) -> the scorer's page summaries,
    computed from the pages when not given (``checked_summaries``)."""
    check_sparse_decode_args(q, k_pages, v_pages, page_table, lengths, budget_pages,
                             page_size=page_size, max_budget_pages=max_budget_pages)
    why = (limits or kernel_limits)(q.shape[-1], page_size, scorer, block_pages)
    if why is not None:
        raise ValueError(f"{entry}: {why}")
    return checked_summaries(k_pages, scorer, centroids, summaries)


@dataclasses.dataclass(frozen=True)
class GpuDecodeTuning:
    """Settings of the GPU kernels that change speed, never the result beyond float32
    rounding (one static argument, as jax's Pallas ops take their block sizes).

    block_pages: pages per attention step, a power of two with at least 16 tokens (None:
      :func:`default_block_pages`).
    splits: parts of each page list attended in parallel by even splits (None:
      :func:`default_splits`); set, it selects even splits when ``balanced`` is None.
    score_chunk: page slots per scoring program, a power of two (None:
      :func:`default_score_chunk`).
    score_warps, select_warps: Triton warps of the scoring and selection kernels.
    attend_warps, attend_stages: Triton warps and pipelining depth of the Pallas attention
      (defaults: the H100 sweep's, notes/kernel_notes.md, item 10).
    balanced: the attention on one wave of programs sharing the lists' blocks evenly
      (:func:`pallas_kernels.paged_attend_gpu.attend_page_lists_balanced`) instead of
      ``splits`` for every list (True: ``splits`` unused); None: balanced in the sparse step
      unless ``splits`` is set or the batch is one row, even splits in dense decode: a long
      row among short or finished ones gets the programs they leave idle (run O); one row's
      lists, all of one length, have nothing to balance (run AG; BENCHMARKS.md).
    attend: the attention over the lists: ``"cuda"``
      (:func:`pallas_kernels.sparse_attend_cuda.attend_page_lists_cuda`: each warp streams
      its pages through shared memory while it computes; BENCHMARKS.md, kernel run AK),
      ``"pallas"`` (:func:`pallas_kernels.paged_attend_gpu.attend_page_lists`, the only one
      in interpret mode), or ``"auto"``: cuda where it runs (bf16, head_dim 128, page 16,
      a Hopper GPU, nvcc to build it once: :func:`resolve_attend`), else pallas. With
      cuda (``block_pages``, ``attend_warps`` and ``attend_stages`` unused), ``balanced``
      True is stream-K, False even splits (``splits`` of each list, None:
      :func:`pallas_kernels.sparse_attend_cuda.default_cuda_splits`), None (unless
      ``splits`` is set) even splits for one row, else chosen on the device for each
      call's lists: stream-K where even parts leave the GPU idle or the lists are ragged.
    attend_programs: the CUDA attention's blocks (None: one an SM).
    select_in_attention: with the CUDA attention, each of its blocks chooses its list's
      pages itself (:func:`pallas_kernels.sparse_attend_cuda.attend_selected_cuda`: no
      selection kernel, no lists in global memory) where even splits give every block one
      part in one wave (up to 16 rows of 8 KV heads on 132 SMs): True (one line where not),
      False, or None (where it applies; the step 2.8-7.9 us shorter, kernel runs AW-AZ).
    score: the scoring: ``"pallas"`` (:func:`_score_kernel`), ``"xla"`` (:func:`score_keys_xla`,
      half as fast in a model: kernel run AT), ``"cuda"`` (scored and chosen by one kernel
      with the CUDA attention: :func:`pallas_kernels.sparse_attend_cuda.score_select_attend_cuda`)
      or ``"auto"``: cuda where ``scores_and_chooses`` (same module), else pallas. xla and
      cuda sum in another order, so near ties may be chosen differently.
    select: the selection where the attention does not choose the lists: ``"pallas"``
      (:func:`_select_kernel`), ``"cuda"`` (the CUDA attention's choice alone, one block a
      list, then the attention in the same call:
      :func:`pallas_kernels.sparse_attend_cuda.select_attend_lists_cuda`), or ``"auto"``:
      cuda with the CUDA attention (:func:`cuda_selection`; kernel run BE).
    """
    block_pages: int | None = None
    splits: int | None = None
    score_chunk: int | None = None
    score_warps: int = 4
    select_warps: int = 4
    attend_warps: int = 2
    attend_stages: int = 1
    balanced: bool | None = None
    attend: str = "auto"
    attend_programs: int | None = None
    score: str = "auto"
    select_in_attention: bool | None = None
    select: str = "auto"

    def __post_init__(self):
        check_launch_settings(self)
        if self.score not in SCORE_IMPLS:
            raise ValueError(f"score must be one of {SCORE_IMPLS}, got {self.score!r}")
        if self.select not in SELECT_IMPLS:
            raise ValueError(f"select must be one of {SELECT_IMPLS}, got {self.select!r}")
        if self.attend not in ATTEND_IMPLS:
            raise ValueError(f"attend must be one of {ATTEND_IMPLS}, got {self.attend!r}")
        if self.attend_programs is not None and not 1 <= self.attend_programs <= CUDA_MAX_PARTS:
            raise ValueError(f"attend_programs must be in [1, {CUDA_MAX_PARTS}], got "
                             f"{self.attend_programs}")
        if (self.select_in_attention or self.score == "cuda") and self.attend == "pallas":
            raise ValueError("select_in_attention and score='cuda' need attend='cuda' or 'auto'")
        if self.attend != "pallas" and (self.splits or 0) > CUDA_MAX_PARTS:
            raise ValueError(f"splits must be <= {CUDA_MAX_PARTS} for the CUDA attention, got "
                             f"{self.splits}")

    def resolve(self, *, page_size: int, batch: int, kv_heads: int, max_pages: int,
                summaries: int = 1) -> GpuDecodeTuning:
        """These settings with block_pages, splits, balanced and score_chunk decided for one
        problem (``summaries``: vectors a page is scored from, 2 for Quest)."""
        bp = self.block_pages or default_block_pages(page_size)
        chunk = self.score_chunk or default_score_chunk(summaries)
        if self.attend == "cuda":
            return dataclasses.replace(
                self, block_pages=bp, score_chunk=chunk,
                splits=self.splits or default_cuda_splits(batch * kv_heads, max_pages,
                                                          sm_count()),
                balanced=False if self.balanced is None and self.splits else self.balanced,
                attend_programs=self.attend_programs or sm_count())
        splits = self.splits or default_splits(batch, kv_heads, max_pages, bp)
        balanced = (self.splits is None and batch > 1) if self.balanced is None else self.balanced
        return dataclasses.replace(self, block_pages=bp, splits=splits, balanced=balanced,
                                   score_chunk=chunk)


def _quest_scores(q_ref, h, group: int, kmin: jax.Array, kmax: jax.Array) -> jax.Array:
    """q ``[Hq, D]`` (this row), kmin, kmax ``[C, D]`` float32 -> ``[C]`` the largest over KV
    head h's query heads of ``sum_d max(q_d kmax_d, q_d kmin_d)``. Each head's row is loaded
    on its own (a row taken out of the group's tile is a reduction across warps)."""
    best = None
    for r in range(group):
        qr = q_ref[h * group + r, :].astype(jnp.float32)[None, :]
        s = jnp.sum(jnp.maximum(qr * kmax, qr * kmin), axis=1)
        best = s if best is None else jnp.maximum(best, s)
    return best


def _score_kernel(q_ref, *refs, page_size, chunk, group):
    """Grid (B, Hkv, Mpad / C): q ``[Hq, D]`` (this row), the page summaries (centroids, or
    Quest's kmin and kmax), each ``[N, D]`` (this KV head), table ``[C]`` (this program's
    slots), length ``[1]`` -> keys ``[C]``."""
    *summary_refs, table_ref, len_ref, key_ref = refs
    h, c = pl.program_id(1), pl.program_id(2)
    n = (len_ref[0] + page_size - 1) // page_size
    slot = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    eligible = (slot >= 1) & (slot < n - 2)

    # A program wholly past the row's eligible pages only marks its slots: a short row in a
    # wide table (the longest row of the batch sets the width) then costs little more than
    # in a table of its own width. (H100, 48 rows of 128 tokens: scoring at width 2048 took
    # 5.2x its time at width 256 while every program read the query.)
    @pl.when(c * chunk >= n - 2)
    def _():
        key_ref[...] = jnp.full((chunk,), _INT_MIN, jnp.int32)

    @pl.when(c * chunk < n - 2)
    def _():
        if len(summary_refs) == 1:
            queries = group_queries(q_ref, h, group, pow2(group)).astype(jnp.float32)
        # Masked loads: slots past the row's pages read nothing.
        phys = plgpu.load(table_ref, mask=eligible, other=jnp.int32(0))
        d = q_ref.shape[1]
        # Both dimensions indexed by arrays (interpret mode has no masked load of a slice).
        col = lax.broadcasted_iota(jnp.int32, (chunk, d), 1)
        pages = [plgpu.load(ref.at[jnp.broadcast_to(phys[:, None], (chunk, d)), col],
                            mask=jnp.broadcast_to(eligible[:, None], (chunk, d)),
                            other=0).astype(jnp.float32) for ref in summary_refs]   # [C, D]
        # Elementwise products and float32 sums: exact float32 arithmetic, never TF32.
        if len(pages) == 1:
            qbar = jnp.sum(queries, axis=0) / group
            score = jnp.sum(pages[0] * qbar[None, :], axis=1)
        else:
            score = _quest_scores(q_ref, h, group, *pages)
        key_ref[...] = jnp.where(eligible, order_key(score), jnp.int32(_INT_MIN))


def _count(mask: jax.Array) -> jax.Array:
    return jnp.sum(mask.astype(jnp.int32))


def _select_kernel(key_ref, table_ref, len_ref, budget_ref, phys_ref, slot_ref, count_ref,
                   *arrivals_ref, page_size, max_pages):
    """Grid (B, Hkv): keys ``[Mpad]``, table ``[Mpad]``, length, budget -> the page list
    (physical and logical, each ``[2 * Kpad]``: entries ``count .. Kpad-1`` repeat the last page,
    the second half is never written on GPU), the count ``[1]`` and, if asked, a zero ``[1]``
    (the balanced attention's arrival counter of this list)."""
    n = (len_ref[0] + page_size - 1) // page_size
    mpad = table_ref.shape[0]
    kpad = phys_ref.shape[0] // 2
    budget = jnp.clip(budget_ref[0], RESERVED, max_pages)
    k = budget - RESERVED

    def search(keys, slot):
        """(t, need, j) of the keys: the threshold, how many keys equal to it to take, and the
        last slot among those taken."""
        # A threshold T with #(keys >= T) >= k, built from the sign bit down. count(keys >= t)
        # >= k holds throughout, so each round counts only the candidate with its bit set.
        # Ineligible keys are INT_MIN and every candidate is larger, so they are never counted.
        # The rounds stop once exactly k keys reach t: keys >= t are then the top k, whatever
        # the lower bits (the k-th and (k+1)-th keys first differ at that round's bit, about
        # half-way down for scores of a few thousand pages). Otherwise t ends as the k-th
        # largest key (k = 0: INT_MAX, nothing chosen) and ties at t are split below.
        first = _count(keys >= 0)
        t = jnp.where(first >= k, jnp.int32(0), jnp.int32(_INT_MIN))

        def round_(carry):
            bit, t, _ = carry
            cand = t | lax.shift_left(jnp.int32(1), bit)
            count = _count(keys >= cand)
            return bit - 1, jnp.where(count >= k, cand, t), count == k

        _, t, _ = lax.while_loop(lambda c: (c[0] >= 0) & ~c[2], round_,
                                 (jnp.int32(30), t, first == k))
        need = k - _count(keys > t)              # how many keys equal to t to take, >= 0
        equal = keys == t
        size = keys.shape[0]

        # Ties: the `need` lowest slots among the equal keys: the largest j with fewer than
        # `need` equal keys below it is the last one taken. Usually exactly `need` keys equal
        # t (no tie at the threshold) and the search is skipped.
        def lowest_equal():
            j = jnp.int32(0)
            for bit in range(size.bit_length() - 2, -1, -1):
                cand = j + (1 << bit)
                j = jnp.where(_count(equal & (slot < cand)) < need, cand, j)
            return j

        # need <= size, so the first branch is size (no limit); it is computed from a traced
        # value because the Triton lowering cannot yield a literal from a cond.
        j = lax.cond(_count(equal) == need, lambda: jnp.maximum(need, jnp.int32(size)),
                     lowest_equal)
        return t, need, j

    def select(size):
        """The page list from the first ``size`` slots, which hold the row's pages (and
        ``size >= Kpad``, so every list entry gets a value): the same as from all ``Mpad``."""
        keys = key_ref[pl.ds(0, size)]
        table = table_ref[pl.ds(0, size)]
        idx = lax.broadcasted_iota(jnp.int32, (size,), 0)
        # No search when the budget covers the row (traced values: the Triton lowering
        # cannot yield a literal from a cond).
        skip = lambda: (jnp.maximum(n, jnp.int32(_INT_MAX)), k * 0, k * 0)
        t, need, j = lax.cond(n <= budget, skip, lambda: search(keys, idx))
        chosen = (keys > t) | ((keys == t) & (idx <= j) & (need > 0))
        reserved = (idx == 0) | ((idx >= n - 2) & (idx < n))
        sel = jnp.where(n <= budget, idx < n, reserved | chosen)

        # Compact in page order: chosen slots go to ranks 0 .. total-1, the others after them
        # and carry the last page, so entries past the count repeat it (the attention kernel
        # reads whole blocks of entries; a repeated page comes from cache, not memory). Ranks
        # are distinct; those past the list go to the junk half of the buffer with their stores
        # masked off (masked lanes sharing a destination would write stale values back in
        # interpret mode).
        sel_i = sel.astype(jnp.int32)
        upto = jnp.cumsum(sel_i)                 # chosen slots at or below each slot
        total = jnp.sum(sel_i)
        rank = jnp.where(sel, upto - 1, total + idx - upto)
        last = jnp.maximum(n - 1, 0)
        last_phys = jnp.sum(jnp.where(idx == last, table, jnp.int32(0)))
        keep = rank < kpad
        dest = jnp.where(keep, rank, jnp.int32(kpad))
        plgpu.store(phys_ref.at[dest], jnp.where(sel, table, last_phys), mask=keep)
        plgpu.store(slot_ref.at[dest], jnp.where(sel, idx, last), mask=keep)
        count_ref[...] = jnp.full((1,), total, jnp.int32)
        for ref in arrivals_ref:
            ref[...] = jnp.zeros((1,), jnp.int32)

    # The selection runs over the smallest power of two of slots (256 at least) holding the
    # row's pages, a branch per size: its cost follows the row's length, not the table's
    # width, which the longest row of the batch sets.
    smallest = max(256, kpad)
    sizes = [1 << e for e in range(smallest.bit_length() - 1, mpad.bit_length() - 1)] + [mpad]
    which = sum((n > size).astype(jnp.int32) for size in sizes[:-1])
    lax.switch(which, [functools.partial(select, size) for size in sizes])


def kernel_limits(head_dim: int, page_size: int, scorer: str = "centroid",
                  block_pages: int | None = None) -> str | None:
    """Why the kernels cannot run a case (None when they can): Triton blocks need power-of-two
    sides, matrix-unit tiles at least 16 wide. Both scorers run."""
    if scorer not in SCORERS:
        return f"unknown scorer {scorer!r}; expected one of {SCORERS}"
    p, d = page_size, head_dim
    if not _is_pow2(p) or not _is_pow2(d) or d < 16:
        return (f"page_size ({p}) and head_dim ({d}) must be powers of two, head_dim >= 16 "
                "(Triton block shapes, matrix-unit tiles)")
    if block_pages is not None and (not _is_pow2(block_pages) or block_pages * p < 16):
        return (f"block_pages ({block_pages}) must be a power of two with block_pages x "
                f"page_size >= 16")
    return None


def default_score_chunk(summaries: int) -> int:
    """Page slots a scoring program holds: 32 whatever the summaries (H100: faster than 64,
    128 or 16 for centroids, kernel runs BC-BD; Quest's too, "Quest in the kernels")."""
    del summaries
    return 32


def default_block_pages(page_size: int) -> int:
    """Pages per attention step: 4 (the H100 sweep at page 16), at least 16 tokens."""
    return max(4, 16 // page_size)


def sparse_decode_pallas(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                         page_table: jax.Array, lengths: jax.Array, budget_pages: jax.Array, *,
                         page_size: int = 16, scorer: str = "centroid",
                         centroids: jax.Array | None = None,
                         summaries: tuple[jax.Array, jax.Array] | None = None,
                         max_budget_pages: int | None = None,
                         tuning: GpuDecodeTuning = GpuDecodeTuning(),
                         interpret: bool = False) -> jax.Array:
    """Block top-k sparse decode attention (docs/design.md, section 3), the Pallas kernels.

    ``sparrow_jax.sparse_decode(..., impl="pallas")`` (or ``"auto"`` on a GPU) is the usual way
    in; this entry point also takes the tuning settings.

    Args:
      q: ``[B, Hq, D]`` queries after q-norm and RoPE.
      k_pages, v_pages: ``[Hkv, N, P, D]`` one layer's paged cache, current token written.
      page_table: ``[B, M]`` int32 physical page of each sequence's j-th page.
      lengths: ``[B]`` int32 tokens in the cache, current token included, in ``[1, M * P]``
        (under jit, where it cannot be checked, a row of 0 returns zeros).
      budget_pages: ``[B]`` int32 pages per (sequence, KV head), the 3 reserved included
        (>= 3). Under jit, where they cannot be checked, clipped to ``[3, max_budget_pages]``.
      page_size: P, a power of two.
      scorer: ``"centroid"`` (qbar . page mean of keys) or ``"quest"`` (Quest's bound from
        each page's elementwise min and max of keys).
      centroids: ``[Hkv, N, D]`` page means of the keys in the cache dtype, for ``"centroid"``;
        computed from the pages when None (as the cache would store them).
      summaries: ``(kmin, kmax)``, each ``[Hkv, N, D]``, for ``"quest"``; computed when None.
      max_budget_pages: static size of the page lists; default M. Concrete budgets needing
        more pages raise.
      tuning: :class:`GpuDecodeTuning`.
      interpret: run the kernels in Pallas' interpreter (CPU tests).

    Arguments are checked as by ``sparse_decode`` (:mod:`sparrow_jax.attention.sparse_args`),
    plus the kernels' own limits (:func:`kernel_limits`).

    Returns:
      ``[B, Hq, D]`` in q's dtype.
    """
    summ = checked_args(
        "sparse_decode_pallas", q, k_pages, v_pages, page_table, lengths, budget_pages,
        page_size=page_size, scorer=scorer, centroids=centroids, summaries=summaries,
        max_budget_pages=max_budget_pages, block_pages=tuning.block_pages)
    return sparse_decode_pallas_checked(
        q, k_pages, v_pages, summ, page_table, lengths, budget_pages, page_size=page_size,
        max_budget_pages=max_budget_pages, tuning=tuning, interpret=interpret)


def sparse_decode_pallas_checked(q, k_pages, v_pages, summaries, page_table, lengths,
                                 budget_pages, *, page_size, max_budget_pages=None,
                                 tuning=GpuDecodeTuning(), interpret=False):
    """:func:`sparse_decode_pallas` for arguments its caller has already checked (as
    ``sparse_decode`` does) and given page summaries (centroids, or the pair (kmin, kmax) for
    Quest): no checks here."""
    max_pages = max_budget_pages or page_table.shape[1]
    summaries = as_summaries(summaries)
    attend = resolve_attend(tuning.attend, q, k_pages, page_size, interpret)
    if tuning.score == "cuda" and attend != "cuda":
        raise ValueError("GpuDecodeTuning(score='cuda'): the CUDA attention cannot run here")
    tuning = dataclasses.replace(tuning, attend=attend)
    tuning = tuning.resolve(page_size=page_size, batch=q.shape[0], kv_heads=k_pages.shape[0],
                            max_pages=max_pages, summaries=len(summaries))
    return _sparse_decode(q, k_pages, v_pages, summaries, page_table.astype(jnp.int32),
                          lengths.astype(jnp.int32), budget_pages.astype(jnp.int32),
                          page_size=page_size, max_pages=max_pages, tuning=tuning,
                          interpret=interpret)


def list_sizes(table_width: int, max_pages: int, tuning: GpuDecodeTuning) -> tuple[int, int]:
    """(Mpad, Kpad): the padded page-table width and page-list length; ``tuning`` resolved."""
    kpad = max(pow2(max_pages), tuning.block_pages)
    # mpad >= kpad: every list entry below kpad gets a value.
    mpad = max(pow2(table_width), tuning.score_chunk, kpad)
    return mpad, kpad


def select_page_lists(q, summaries, page_table, lengths, budget_pages, *, page_size, max_pages,
                      tuning=GpuDecodeTuning(), interpret=False, arrivals=False):
    """Scoring and selection kernels: q ``[B, Hq, D]``, summaries (centroids ``[Hkv, N, D]``,
    or Quest's (kmin, kmax) of that shape), page_table
    ``[B, M]``, lengths ``[B]``, budget_pages ``[B]`` (all int32) -> (phys ``[B, Hkv, 2 * Kpad]``,
    slots ``[B, Hkv, 2 * Kpad]``, count ``[B, Hkv, 1]``) int32: the chosen pages of each
    (sequence, KV head) in page order, as physical pages and as slots of the sequence; entries
    from count to Kpad - 1 repeat the last page, those from Kpad on are junk (never read).
    ``arrivals``: a fourth output, zeros ``[B, Hkv, 1]`` written by the selection programs, the
    balanced attention's arrival counters (which would otherwise take an XLA launch of their
    own each layer; H100 at 32K: 0.9 us of device time and a launch gap)."""
    summaries = as_summaries(summaries)
    tuning = tuning.resolve(page_size=page_size, batch=q.shape[0],
                            kv_heads=summaries[0].shape[0], max_pages=max_pages,
                            summaries=len(summaries))
    keys, table, kpad = scored_table(q, summaries, page_table, lengths, page_size=page_size,
                                     max_pages=max_pages, tuning=tuning, interpret=interpret)
    return select_from_keys(keys, table, lengths, budget_pages, page_size=page_size,
                            max_pages=max_pages, kpad=kpad, tuning=tuning, interpret=interpret,
                            arrivals=arrivals)


def scored_table(q, summaries, page_table, lengths, *, page_size, max_pages, tuning,
                 interpret=False):
    """The scoring of the resolved ``tuning`` -> (keys ``[Hkv, B, Mpad]``, the page table
    padded to ``[B, Mpad]``, Kpad) (:func:`list_sizes`)."""
    summaries = as_summaries(summaries)
    mpad, kpad = list_sizes(page_table.shape[1], max_pages, tuning)
    table = jnp.pad(page_table, ((0, 0), (0, mpad - page_table.shape[1])))
    if tuning.score == "xla":
        keys = score_keys_xla(q, summaries, table, lengths, page_size=page_size)
    else:
        keys = score_keys(q, summaries, table, lengths, page_size=page_size, tuning=tuning,
                          interpret=interpret)
    return keys, table, kpad


def score_keys(q, summaries, table, lengths, *, page_size, tuning=GpuDecodeTuning(),
               interpret=False):
    """The scoring kernel alone: q ``[B, Hq, D]``, summaries (as for
    :func:`select_page_lists`), table ``[B, Mpad]`` (padded, :func:`list_sizes`) -> keys
    ``[Hkv, B, Mpad]`` int32 (:func:`_score_kernel`)."""
    summaries = as_summaries(summaries)
    b, hq, d = q.shape
    hkv, n_total = summaries[0].shape[:2]
    mpad = table.shape[1]
    chunk = tuning.score_chunk or default_score_chunk(len(summaries))
    return pl.pallas_call(
        functools.partial(_score_kernel, page_size=page_size, chunk=chunk, group=hq // hkv),
        grid=(b, hkv, mpad // chunk),
        in_specs=[pl.BlockSpec((None, hq, d), lambda bi, hi, ci: (bi, 0, 0)),
                  *[pl.BlockSpec((None, n_total, d), lambda bi, hi, ci: (hi, 0, 0))] * len(
                      summaries),
                  pl.BlockSpec((None, chunk), lambda bi, hi, ci: (bi, ci)),
                  pl.BlockSpec((1,), lambda bi, hi, ci: (bi,))],
        out_specs=pl.BlockSpec((None, None, chunk), lambda bi, hi, ci: (hi, bi, ci)),
        out_shape=jax.ShapeDtypeStruct((hkv, b, mpad), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=tuning.score_warps, num_stages=1),
        interpret=interpret, name="sparse_decode_score",
    )(q, *summaries, table, lengths)


def score_keys_xla(q, summaries, table, lengths, *, page_size):
    """The keys of :func:`score_keys` computed by XLA: each slot's summaries gathered and
    multiplied element-wise by the queries, summed in float32 over the head dimension (never
    TF32: no matmul). XLA fuses the gather into the sum, which read each gathered vector once
    at 4.2 TB/s on an H200 where the Pallas kernel read at 2.9 (BENCHMARKS.md, kernel run AT).
    Gathered and summed as ``[Hkv, B, M, D]``: as ``[B, Hkv, M, D]`` the same sum took twice
    as long (kernel run AT). The keys are head-major so that no transpose follows the sum:
    XLA sank one into it in the engine's step (rollout run V). Ineligible slots gather page
    0: XLA cannot skip them, as the Pallas kernel does."""
    summaries = as_summaries(summaries)
    b, hq, d = q.shape
    hkv = summaries[0].shape[0]
    slot = lax.broadcasted_iota(jnp.int32, table.shape, 1)
    eligible = (slot >= 1) & (slot < num_pages(lengths, page_size)[:, None] - 2)   # [B, Mpad]
    idx = jnp.where(eligible, table, 0)
    pages = [jnp.take(s, idx, axis=1).astype(jnp.float32) for s in summaries]  # [Hkv,B,M,D]
    qg = jnp.swapaxes(q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d), 0, 1)
    if len(pages) == 1:
        qbar = jnp.sum(qg, axis=2) / (hq // hkv)                           # [Hkv, B, D]
        score = jnp.sum(pages[0] * qbar[:, :, None], axis=-1)
    else:
        score = jnp.max(jnp.stack(
            [jnp.sum(jnp.maximum(qg[:, :, None, r] * pages[1], qg[:, :, None, r] * pages[0]),
                     axis=-1) for r in range(hq // hkv)]), axis=0)
    return jnp.where(eligible[None], order_key(score), jnp.int32(_INT_MIN))


def cuda_selection(tuning: GpuDecodeTuning, width: int) -> bool:
    """Whether ``tuning.select`` is the CUDA selection for keys ``width`` slots wide: "cuda",
    or "auto" where the attention resolved to the CUDA one (the same machine runs both)."""
    return tuning.select == "cuda" or (tuning.select == "auto" and tuning.attend == "cuda"
                                       and width <= CUDA_MAX_CHOICE_WIDTH)


def select_from_keys(keys, table, lengths, budget_pages, *, page_size, max_pages, kpad,
                     tuning=GpuDecodeTuning(), interpret=False, arrivals=False):
    """The selection kernel alone (``tuning.select``): keys ``[Hkv, B, Mpad]``, table ``[B,
    Mpad]`` -> the lists of :func:`select_page_lists` (and arrivals)."""
    if cuda_selection(tuning, keys.shape[2]):
        why = "it runs on a GPU only, not in interpret mode" if interpret else cuda_unavailable()
        if why is not None:
            raise ValueError(f"GpuDecodeTuning(select='cuda'): {why}")
        return tuple(select_lists_cuda(keys, table, lengths, budget_pages, page_size=page_size,
                                       max_pages=max_pages, kpad=kpad))[:3 + arrivals]
    hkv, b, mpad = keys.shape
    row = pl.BlockSpec((1,), lambda bi, hi: (bi,))
    out = lambda: pl.BlockSpec((None, None, 2 * kpad), lambda bi, hi: (bi, hi, 0))
    one = pl.BlockSpec((None, None, 1), lambda bi, hi: (bi, hi, 0))
    ones = [jax.ShapeDtypeStruct((b, hkv, 1), jnp.int32)] * (1 + arrivals)
    return pl.pallas_call(
        functools.partial(_select_kernel, page_size=page_size, max_pages=max_pages),
        grid=(b, hkv),
        in_specs=[pl.BlockSpec((None, None, mpad), lambda bi, hi: (hi, bi, 0)),
                  pl.BlockSpec((None, mpad), lambda bi, hi: (bi, 0)),
                  row, row],
        out_specs=[out(), out()] + [one] * len(ones),
        out_shape=[jax.ShapeDtypeStruct((b, hkv, 2 * kpad), jnp.int32),
                   jax.ShapeDtypeStruct((b, hkv, 2 * kpad), jnp.int32), *ones],
        compiler_params=plgpu.CompilerParams(num_warps=tuning.select_warps, num_stages=1),
        interpret=interpret, name="sparse_decode_select",
    )(keys, table, lengths, budget_pages)


@functools.partial(jax.jit, static_argnames=("page_size", "max_pages", "tuning", "interpret"))
def _sparse_decode(q, k_pages, v_pages, summaries, page_table, lengths, budget_pages, *,
                   page_size, max_pages, tuning, interpret):
    cuda = tuning.attend == "cuda"
    mpad, kpad = list_sizes(page_table.shape[1], max_pages, tuning)
    lists = q.shape[0] * k_pages.shape[0]
    launch = dict(splits=tuning.splits, programs=tuning.attend_programs, balanced=tuning.balanced)
    if cuda and scores_and_chooses(tuning.score, summaries, mpad, lists, **launch):
        launch["balanced"] = bool(tuning.balanced)   # even splits: blocks wait list by list
        return score_select_attend_cuda(
            q, k_pages, v_pages, summaries, page_table, lengths, budget_pages, kpad=kpad,
            page_size=page_size, max_pages=max_pages, **launch)
    inside = cuda and selects_in_attention(lists, mpad, tuning.splits, tuning.attend_programs,
                                           balanced=tuning.balanced,
                                           asked=tuning.select_in_attention)
    if inside or (cuda and cuda_selection(tuning, mpad)):
        keys, table, kpad = scored_table(q, summaries, page_table, lengths, page_size=page_size,
                                         max_pages=max_pages, tuning=tuning)
        args = (q, k_pages, v_pages, keys, table, lengths, budget_pages)
        size = dict(page_size=page_size, max_pages=max_pages)
        if inside:
            return attend_selected_cuda(*args, splits=tuning.splits, **size)
        return select_attend_lists_cuda(*args, kpad=kpad, **launch, **size)
    # The CUDA call takes its counters even with one split (an aliased buffer it leaves
    # alone): zeros from the selection, which would otherwise be a fill of their own.
    phys, slots, count, *arrivals = select_page_lists(
        q, summaries, page_table, lengths, budget_pages, page_size=page_size,
        max_pages=max_pages, tuning=tuning, interpret=interpret,
        arrivals=cuda or tuning.balanced)
    if cuda:
        return attend_page_lists_cuda(q, k_pages, v_pages, phys, slots, count, lengths,
                                      arrivals=arrivals[0], **launch)
    return attend_page_lists(q, k_pages, v_pages, phys, slots, count, lengths,
                             page_size=page_size, tuning=tuning, interpret=interpret,
                             arrivals=arrivals[0] if arrivals else None)
