"""The sparse decode step's attention over page lists as a CUDA C kernel (GPU only).

:func:`attend_page_lists_cuda` takes what
:func:`pallas_kernels.paged_attend_gpu.attend_page_lists` takes and returns what it returns,
computed by ``sparse_attend_cuda.cu`` (beside this file) through an XLA FFI call: each warp
streams its own pages through shared-memory stages by ``cp.async`` while it runs the previous
page's products on the tensor cores, which the Pallas and Triton lowerings could not express
(notes/kernel_notes.md). H200, 32K context, budget 2048, the attention alone: 71.5 us at
batch 32 against 87.0 for the Pallas attention (83% of the read ceiling against 68%), 23.4
against 28.6 at batch 8; the whole step 10-11% faster at batches 8-64 (BENCHMARKS.md, kernel
runs AJ and AK).

:func:`attend_selected_cuda` is the same attention whose blocks choose their lists
themselves from the scoring's keys (no selection kernel), where every block holds one part
of one list in one wave (kernel run AW). :func:`select_lists_cuda` is that choice alone, one
block a list, writing the lists the Pallas selection writes; :func:`select_attend_lists_cuda`
is it and the attention over its lists in one call, the attention started by programmatic
dependent launch while the selection drains. :func:`score_select_attend_cuda` is the whole
step in one call: one kernel scores the pages and chooses each list as soon as its keys are
in, and the attention's blocks may start on each list as soon as it is chosen.

Supported: bf16 queries and pages, head_dim 128, page size 16, up to 8 query heads a KV head,
an NVIDIA Hopper GPU (compute capability 9.x: H100, H200; measured on an H200), and ``nvcc``
(tested with CUDA 13.0) to build the kernel's library once, at first use, into
``$SPARROW_CACHE`` (default ``~/.cache/sparrow_jax``), keyed by the source, the compiler and
its flags. :func:`unsupported_args` and :func:`unavailable` say why not, in one line, for
everything else; ``GpuDecodeTuning(attend="auto")`` then falls back to the Pallas attention
(with a warning when the machine, not the arguments, is what is missing).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cuda_build import hopper_missing, register
from pallas_kernels.paged_attend_gpu import sm_count

SOURCE = Path(__file__).with_suffix(".cu")
TARGET = "sparrow_sparse_attend"
SELECT_TARGET = "sparrow_sparse_select_attend"
LISTS_TARGET = "sparrow_sparse_select_lists"
LISTS_ATTEND_TARGET = "sparrow_sparse_select_lists_attend"
SCORE_TARGET = "sparrow_sparse_score_select_attend"
PAGE_SIZE, HEAD_DIM, MAX_GROUP = 16, 128, 8
# The kernel's warps a block, and the most parts a list may be merged from (the blocks, or
# the even splits: their weights fill the shared memory of the kernel's page ring).
WARPS = 8
MAX_PARTS = 4096
# The kernel's `balance` for each `balanced`: the device's choice, even splits, stream-K.
BALANCE = {None: -1, False: 0, True: 1}
# The most blocks of a cluster that every Hopper launch allows.
MAX_CLUSTER = 8
# The widest page table whose keys and pages a block holds to choose its list (in the shared
# memory of its page ring, before the pages stream).
MAX_CHOICE_WIDTH = 8192
# The least share of its last round of blocks that even list parts must fill for the one
# scoring-and-choosing kernel to be the default (scores_and_chooses): 97% gained, 58% lost
# (BENCHMARKS.md, kernel runs BF and BG); between them, about where a round's idle tenth
# costs what the one kernel saves.
FUSED_FILL = 0.9


@functools.cache
def _registered() -> str | None:
    return (register(SOURCE, "SparrowSparseAttend", TARGET, "the CUDA attention")
            or register(SOURCE, "SparrowSparseSelectAttend", SELECT_TARGET,
                        "the CUDA attention")
            or register(SOURCE, "SparrowSparseSelectLists", LISTS_TARGET, "the CUDA attention")
            or register(SOURCE, "SparrowSparseSelectListsAttend", LISTS_ATTEND_TARGET,
                        "the CUDA attention")
            or register(SOURCE, "SparrowSparseScoreSelectAttend", SCORE_TARGET,
                        "the CUDA attention"))


def unavailable() -> str | None:
    """None when the CUDA attention can run here, else why not (one line): an NVIDIA GPU of
    compute capability 9.x, and the kernel's library built (on first use)."""
    return hopper_missing() or _registered()


def unsupported_args(q, k_pages, page_size: int) -> str | None:
    """None when :func:`attend_page_lists_cuda` takes arguments of these shapes and dtypes,
    else why not (one line)."""
    if q.dtype != jnp.bfloat16 or k_pages.dtype != jnp.bfloat16:
        return f"needs bf16 queries and pages, have {q.dtype} and {k_pages.dtype}"
    if q.shape[-1] != HEAD_DIM or page_size != PAGE_SIZE:
        return (f"needs head_dim {HEAD_DIM} and page size {PAGE_SIZE}, have {q.shape[-1]} "
                f"and {page_size}")
    group = q.shape[1] // k_pages.shape[0]
    if group > MAX_GROUP:
        return f"needs at most {MAX_GROUP} query heads a KV head, have {group}"
    return None


def default_cuda_splits(lists: int, max_pages: int, sms: int) -> int:
    """Even splits of each list: enough that the lists' blocks number about half the SMs
    (H200, run AJ: at batches 1, 8 and 32 the fastest had 64, 64 and 256 blocks of 8 warps
    on 132 SMs; more splits lose to the merges), and at least one page a warp."""
    return max(1, min((sms // 2) // lists, max_pages // WARPS))


def attend_page_lists_cuda(q, k_pages, v_pages, phys, slots, count, lengths, *,
                           splits: int | None = None, programs: int | None = None,
                           balanced: bool | None = None, cluster: bool | None = None,
                           arrivals=None):
    """q ``[B, Hq, D]``, pages ``[Hkv, N, P, D]``, phys and slots ``[B, Hkv, L]``, count
    ``[B, Hkv, 1]`` (the lists of
    :func:`pallas_kernels.sparse_decode_gpu.select_page_lists`), lengths ``[B]`` ->
    ``[B, Hq, D]`` bf16, on ``programs`` blocks (None: one an SM, what their shared memory
    allows). How the blocks share the lists (``balanced``): True, stream-K, each block the
    same share of all the lists' pages however ragged they are; False, even splits, each
    list in ``splits`` parts (None: :func:`default_cuda_splits`) taken by the blocks in
    turn; None, even splits for one row (its KV heads' lists are all of one length, so the
    kernel skips reading the counts to choose), else decided on the device for the lists at
    hand by a model of each way's time (the kernel's attend_kernel): stream-K where even
    parts leave the GPU idle (19 rows' 152 lists, two waves on 132 SMs, the second 20
    blocks) or the lists are ragged (one long row among rows of one page), else even
    splits. ``cluster``: with even splits of 2-8 parts a list, one block a part and each
    list's parts one cluster of blocks, which merge their partial results through each
    other's shared memory instead of global memory and a counter (None: wherever that
    applies and the parts fit one wave, as at one row). ``arrivals``: zeros
    ``[B, Hkv, 1]`` int32 the call may use as its merge counters (the selection's, which
    saves a launch); None: made here. Arguments it does not take raise one line
    (:func:`unsupported_args`); where it cannot run (:func:`unavailable`) the call fails
    when it runs, so check that first."""
    why = unsupported_args(q, k_pages, k_pages.shape[2])
    if why is not None:
        raise ValueError(f"attend_page_lists_cuda: {why}")
    # Registers the handler on first use where the library builds; not a check, since a host
    # without the GPU may still lower this call for one.
    _registered()
    b, hq, d = q.shape
    hkv = k_pages.shape[0]
    splits, programs, balanced, cluster = _launch_settings(
        "attend_page_lists_cuda", b, hkv, phys.shape[-1], splits, programs, balanced, cluster)
    if arrivals is None:
        arrivals = jnp.zeros((b, hkv, 1), jnp.int32)
    call = jax.ffi.ffi_call(
        TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct(arrivals.shape, jnp.int32),
         *_part_buffers(b * hkv, hq // hkv, d, splits, programs)),
        input_output_aliases={7: 1})
    out, *_ = call(q, k_pages, v_pages, phys.astype(jnp.int32), slots.astype(jnp.int32),
                   count.astype(jnp.int32), lengths.astype(jnp.int32), arrivals,
                   splits=np.int64(splits), programs=np.int64(programs),
                   balance=np.int64(BALANCE[balanced]),
                   cluster=np.int64(splits if cluster else 1))
    return out


def _launch_settings(entry: str, b: int, hkv: int, width: int, splits, programs, balanced,
                     cluster) -> tuple[int, int, bool | None, bool]:
    """:func:`attend_page_lists_cuda`'s settings decided for ``b`` rows of ``hkv`` lists of
    ``width`` entries -> (splits, programs, balanced, cluster); what it cannot take, one line
    naming ``entry``."""
    lists = b * hkv
    programs = sm_count() if programs is None else programs
    splits = default_cuda_splits(lists, width, sm_count()) if splits is None else splits
    if not (1 <= programs <= MAX_PARTS and 1 <= splits <= MAX_PARTS):
        raise ValueError(f"{entry}: programs and splits must be in [1, {MAX_PARTS}], got "
                         f"{programs} and {splits}")
    if balanced is None and b == 1:
        balanced = False
    clusters = balanced is False and 2 <= splits <= MAX_CLUSTER and lists * splits <= programs
    if cluster and not clusters:
        raise ValueError(f"{entry}: cluster=True needs balanced=False and 2 to {MAX_CLUSTER} "
                         f"splits on at least lists x splits programs, got balanced={balanced}, "
                         f"splits={splits}, {lists} lists and {programs} programs")
    cluster = clusters if cluster is None else cluster
    return splits, lists * splits if cluster else programs, balanced, cluster


def _part_buffers(lists: int, group: int, d: int, splits: int, programs: int):
    """The attention's partial results and their log-sum-exps (attend_kernel's parts)."""
    parts = max(programs + lists, lists * splits)
    return (jax.ShapeDtypeStruct((parts, group, d), jnp.float32),
            jax.ShapeDtypeStruct((parts, group), jnp.float32))


def selects_in_attention(lists: int, width: int, splits: int, programs: int, *,
                         balanced: bool | None = False, asked: bool | None = None) -> bool:
    """Whether :func:`attend_selected_cuda` takes ``lists`` lists in ``splits`` even parts on
    ``programs`` blocks from a ``width``-slot page table: one block a part in one wave, each
    list one part or its parts one cluster (2-8, merged in shared memory), and the row's keys
    and pages within the block's page ring; not with stream-K (``balanced`` True).
    ``asked`` (``GpuDecodeTuning.select_in_attention``): False, never; True where it does
    not apply, one line."""
    if asked is False:
        return False
    fits = (balanced is not True and lists * splits <= programs
            and 1 <= splits <= MAX_CLUSTER and 1 <= width <= MAX_CHOICE_WIDTH)
    if asked and not fits:
        raise ValueError(f"choosing the lists inside the attention needs even splits of 1 to "
                         f"{MAX_CLUSTER} parts, one block a part, and a table of at most "
                         f"{MAX_CHOICE_WIDTH} slots; have {lists} lists x {splits} splits on "
                         f"{programs} blocks (balanced={balanced}), {width} slots")
    return fits


def attend_selected_cuda(q, k_pages, v_pages, keys, table, lengths, budget_pages, *,
                         page_size: int, max_pages: int, splits: int | None = None):
    """The selection and the attention in one launch: q ``[B, Hq, D]``, pages ``[Hkv, N, P,
    D]``, the scoring's keys ``[Hkv, B, M]`` int32
    (:func:`pallas_kernels.sparse_decode_gpu.score_keys`), the page table ``[B, M]``, lengths
    and budget_pages ``[B]`` -> ``[B, Hq, D]`` bf16, the output of
    :func:`pallas_kernels.sparse_decode_gpu.select_page_lists` then
    :func:`attend_page_lists_cuda` (docs/design.md, section 3), where each block chooses its
    list's pages itself before it streams them: the selection kernel's launch and its lists'
    round trip through global memory are saved, the choice is made once a part (each block of
    a list's cluster makes it; their lists are the same). ``splits`` (None:
    :func:`default_cuda_splits`) must satisfy :func:`selects_in_attention` on one block an SM;
    else, and for arguments it does not take, one line."""
    why = unsupported_args(q, k_pages, page_size)
    if why is not None:
        raise ValueError(f"attend_selected_cuda: {why}")
    _registered()
    hkv, b, width = keys.shape
    splits = default_cuda_splits(b * hkv, max_pages, sm_count()) if splits is None else splits
    try:
        selects_in_attention(b * hkv, width, splits, sm_count(), asked=True)
    except ValueError as e:
        raise ValueError(f"attend_selected_cuda: {e}") from None
    return jax.ffi.ffi_call(SELECT_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q, k_pages, v_pages, keys.astype(jnp.int32), table.astype(jnp.int32),
        lengths.astype(jnp.int32), budget_pages.astype(jnp.int32), splits=np.int64(splits),
        page_size=np.int64(page_size), max_pages=np.int64(max_pages))


def select_lists_cuda(keys, table, lengths, budget_pages, *, page_size: int, max_pages: int,
                      kpad: int):
    """The choice of :func:`attend_selected_cuda` alone, one block of 256 threads a list
    (two an SM): keys ``[Hkv, B, M]`` int32 (the scoring's), table ``[B, M]``, lengths and
    budget_pages ``[B]`` -> (phys, slots ``[B, Hkv, 2 * kpad]``, count ``[B, Hkv, 1]``, zeros
    ``[B, Hkv, 1]``), as :func:`pallas_kernels.sparse_decode_gpu.select_from_keys` returns
    them with its arrival counters: a row of n pages with budget K (clipped to [3,
    max_pages]) takes every page when n <= K, else page 0, its last two and the K - 3
    eligible slots of largest key (ties from the lowest slot), in page order; entries from
    count to kpad - 1 repeat the row's last page, those from kpad on are not written.
    Tables up to 8192 slots; anything else it does not take raises one line."""
    hkv, b, width = keys.shape
    _check_choice("select_lists_cuda", width, max_pages, kpad)
    _registered()
    lists = jax.ShapeDtypeStruct((b, hkv, 2 * kpad), jnp.int32)
    one = jax.ShapeDtypeStruct((b, hkv, 1), jnp.int32)
    return jax.ffi.ffi_call(LISTS_TARGET, (lists, lists, one, one))(
        keys.astype(jnp.int32), table.astype(jnp.int32), lengths.astype(jnp.int32),
        budget_pages.astype(jnp.int32), page_size=np.int64(page_size),
        max_pages=np.int64(max_pages))


def _check_choice(entry: str, width: int, max_pages: int, kpad: int) -> None:
    if not 1 <= width <= MAX_CHOICE_WIDTH:
        raise ValueError(f"{entry}: takes tables of 1 to {MAX_CHOICE_WIDTH} slots, have {width}")
    if not 3 <= max_pages <= kpad:
        raise ValueError(f"{entry}: max_pages must be in [3, kpad={kpad}], got {max_pages}")


def select_attend_lists_cuda(q, k_pages, v_pages, keys, table, lengths, budget_pages, *,
                             page_size: int, max_pages: int, kpad: int,
                             splits: int | None = None, programs: int | None = None,
                             balanced: bool | None = None):
    """:func:`select_lists_cuda` then :func:`attend_page_lists_cuda` over its lists (the same
    arguments, the same ``[B, Hq, D]`` result) in one custom call, whose attention is launched
    by programmatic dependent launch: its blocks start while the selection drains and wait for
    its lists, and XLA's command buffer holds one node for both instead of two. Where the
    attention's settings merge each list's parts in a cluster of blocks, the two calls."""
    why = unsupported_args(q, k_pages, page_size)
    if why is not None:
        raise ValueError(f"select_attend_lists_cuda: {why}")
    b, hq, d = q.shape
    hkv = k_pages.shape[0]
    splits, programs, balanced, cluster = _launch_settings(
        "select_attend_lists_cuda", b, hkv, 2 * kpad, splits, programs, balanced, None)
    size = dict(page_size=page_size, max_pages=max_pages)
    if cluster:
        phys, slots, count, zeros = select_lists_cuda(keys, table, lengths, budget_pages,
                                                      kpad=kpad, **size)
        return attend_page_lists_cuda(q, k_pages, v_pages, phys, slots, count, lengths,
                                      splits=splits, programs=programs, balanced=balanced,
                                      cluster=True, arrivals=zeros)
    _check_choice("select_attend_lists_cuda", keys.shape[-1], max_pages, kpad)
    _registered()
    lists = jax.ShapeDtypeStruct((b, hkv, 2 * kpad), jnp.int32)
    one = jax.ShapeDtypeStruct((b, hkv, 1), jnp.int32)
    out, *_ = jax.ffi.ffi_call(
        LISTS_ATTEND_TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), lists, lists, one, one,
         *_part_buffers(b * hkv, hq // hkv, d, splits, programs)))(
        q, k_pages, v_pages, keys.astype(jnp.int32), table.astype(jnp.int32),
        lengths.astype(jnp.int32), budget_pages.astype(jnp.int32), splits=np.int64(splits),
        programs=np.int64(programs), balance=np.int64(BALANCE[balanced]),
        **{k: np.int64(v) for k, v in size.items()})
    return out


def scores_and_chooses(score: str, summaries, width: int, lists: int, *, splits: int,
                       programs: int, balanced: bool | None) -> bool:
    """Whether the step with the CUDA attention (``splits`` even parts of ``lists`` lists on
    ``programs`` blocks) takes :func:`score_select_attend_cuda` for
    ``GpuDecodeTuning.score``: "cuda", always; "auto", where the lists' parts outnumber a wave
    of blocks (fewer are chosen inside the attention) and fill their last round of blocks to
    :data:`FUSED_FILL` (that kernel's attention takes even parts; a round's idle blocks are
    its tail), stream-K is not asked, the page summaries are centroids in bf16 and the table
    at most 8192 slots. H100, 32K: the step 5-8 us shorter at 32 and 64 rows (256 and 512
    lists on 132 blocks, rounds 97% full; budget 2048, kernel run BF); at 19 rows (152
    lists, 58%) 2-12 us longer than the Pallas scoring and stream-K (kernel run BG)."""
    if score != "auto":
        return score == "cuda"
    summaries = summaries if isinstance(summaries, (tuple, list)) else (summaries,)
    parts = lists * splits
    fill = parts / (-(-parts // programs) * programs)
    return (parts > programs and fill >= FUSED_FILL and balanced is not True
            and len(summaries) == 1 and summaries[0].dtype == jnp.bfloat16
            and width <= MAX_CHOICE_WIDTH)


def score_select_attend_cuda(q, k_pages, v_pages, summaries, table, lengths, budget_pages, *,
                             page_size: int, max_pages: int, kpad: int,
                             splits: int | None = None, programs: int | None = None,
                             balanced: bool | None = None, overlap: bool | None = None,
                             lists: bool = False):
    """The whole sparse step in one custom call: the pages scored and the lists chosen by one
    kernel, then :func:`attend_page_lists_cuda` over them. q ``[B, Hq, D]``, pages ``[Hkv, N,
    P, D]``, the centroids ``[Hkv, N, D]`` bf16 (or ``(centroids,)``: no other page summary),
    the page table ``[B, M]``, lengths and budget_pages ``[B]`` -> ``[B, Hq, D]`` bf16 (with
    ``lists``: also the keys ``[Hkv, B, M]`` and the lists of :func:`select_lists_cuda`).
    A block scores 512 slots of a list (the keys of
    :func:`pallas_kernels.sparse_decode_gpu.score_keys`, summed in another order) and the last
    of a list's blocks to finish chooses it, beside later lists' scoring instead of after all
    of it. ``overlap`` (even splits only; None: wherever the splits are even): the attention's
    blocks start on each list as soon as it is chosen instead of after every list is.
    Anything it does not take raises one line."""
    why = unsupported_args(q, k_pages, page_size)
    summaries = summaries if isinstance(summaries, (tuple, list)) else (summaries,)
    centroids = summaries[0]
    if len(summaries) != 1:
        why = "scores centroids, not Quest's (kmin, kmax)"
    elif why is None and centroids.dtype != jnp.bfloat16:
        why = f"needs bf16 centroids, have {centroids.dtype}"
    if why is not None:
        raise ValueError(f"score_select_attend_cuda: {why}")
    b, hq, d = q.shape
    hkv, width = k_pages.shape[0], table.shape[1]
    _check_choice("score_select_attend_cuda", width, max_pages, kpad)
    splits, programs, balanced, _ = _launch_settings(
        "score_select_attend_cuda", b, hkv, 2 * kpad, splits, programs, balanced, False)
    if overlap and balanced is not False:
        raise ValueError(f"score_select_attend_cuda: overlap needs even splits "
                         f"(balanced=False), got balanced={balanced}")
    overlap = balanced is False if overlap is None else overlap
    _registered()
    rows = jax.ShapeDtypeStruct((b, hkv, 2 * kpad), jnp.int32)
    one = jax.ShapeDtypeStruct((b, hkv, 1), jnp.int32)
    out, keys, _, phys, slots, count, *_ = jax.ffi.ffi_call(
        SCORE_TARGET,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((hkv, b, width), jnp.int32),
         jax.ShapeDtypeStruct((2, b * hkv), jnp.int32), rows, rows, one, one,
         *_part_buffers(b * hkv, hq // hkv, d, splits, programs)))(
        q, k_pages, v_pages, centroids, table.astype(jnp.int32), lengths.astype(jnp.int32),
        budget_pages.astype(jnp.int32), splits=np.int64(splits), programs=np.int64(programs),
        balance=np.int64(BALANCE[balanced]), page_size=np.int64(page_size),
        max_pages=np.int64(max_pages), overlap=np.int64(overlap))
    return (out, keys, phys, slots, count) if lists else out
