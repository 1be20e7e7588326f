"""Paged top-k sparse decode as Triton kernels called through jax-triton (GPU only).

The same step as :mod:`pallas_kernels.sparse_decode_gpu` (docs/design.md, section 3), written
in Triton directly (:mod:`pallas_kernels.triton_decode_kernels`) so that what Pallas cannot
express is in reach: scatter stores with masks, in-kernel scans and histograms, loops whose
loads Triton pipelines. One step is a few launches, planned once by :func:`plan` and run by
:func:`sparse_decode_triton_checked` through ``jax_triton.triton_call`` (the CPU tests run the
same plan in Triton's interpreter):

1. scoring (grid rows x chunks; page centroids, or Quest's kmin and kmax), then selection
   (grid rows);
2. attention, grid rows x S splits, BP pages a step, all query heads of a KV head together,
   bf16 inputs with float32 accumulation;
3. the S partial results merged in XLA (:func:`pallas_kernels.paged_attend_gpu.merge_splits`).

Two variants measured slower on an H100 at every batch size and were removed (BENCHMARKS.md,
the Triton path; the code is in the history): scoring and selection of a row fused into one
program, and one persistent launch whose programs take scoring, selection and attention tasks
in turn, a row's attention waiting for its selection's flag.

jax-triton and triton are imported only when these kernels run: a missing package gives one
line saying what to install.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attend_gpu import default_splits, merge_splits, pow2
from pallas_kernels.sparse_decode_gpu import check_launch_settings, checked_args
from sparrow_jax.attention.sparse_args import as_summaries

MISSING = ("impl='triton' needs the jax-triton and triton packages: pip install "
           "'sparrow-jax[triton]' (on a machine with an NVIDIA GPU)")


@dataclasses.dataclass(frozen=True)
class TritonDecodeTuning:
    """Settings of the Triton kernels that change speed, never the result.

    block_pages: pages per attention step (a power of two, at least 16 tokens).
    splits: parts of each page list attended in parallel (None: one wave of programs,
      :func:`pallas_kernels.paged_attend_gpu.default_splits`).
    score_chunk: page slots scored per program (a power of two >= 16; None: 64 for
      centroids, 32 for Quest's two summaries, the settings this path was measured with).
    histogram: find the selection threshold by four 256-bin histogram rounds, else by 32
      one-bit counting rounds.
    score_warps, select_warps, attend_warps: Triton warps of each kernel.
    attend_stages: Triton's pipelining depth of the attention loop.
    """
    block_pages: int = 4
    splits: int | None = None
    score_chunk: int | None = None
    histogram: bool = True
    score_warps: int = 4
    select_warps: int = 8
    attend_warps: int = 4
    attend_stages: int = 2

    def __post_init__(self):
        if self.block_pages is None:
            raise ValueError("block_pages must be a power of two, got None")
        check_launch_settings(self)


class Launch(NamedTuple):
    """One kernel launch: the kernel's name in :mod:`pallas_kernels.triton_decode_kernels`,
    its grid, the buffers it reads (by name), those it writes (name, shape, dtype), its
    compile-time constants and Triton settings."""
    kernel: str
    grid: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[tuple[str, tuple[int, ...], str], ...]
    constants: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int


SUMMARIES = {"centroid": ("centroids",), "quest": ("kmin", "kmax")}


def plan(*, batch, q_heads, kv_heads, head_dim, pages_total, page_size, table_width,
         max_pages, compute_dtype, tuning: TritonDecodeTuning,
         scorer: str = "centroid") -> tuple[Launch, ...]:
    """The launches of one step. Buffers the first launch reads: ``q`` ``[B, Hq, D]`` (in
    ``compute_dtype``), ``k``, ``v`` ``[Hkv, N, P, D]``, the scorer's page summaries
    (``SUMMARIES[scorer]``: ``centroids``, or ``kmin`` and ``kmax``, each ``[Hkv, N, D]``),
    ``table`` ``[B, M]``, ``lengths``, ``budgets`` ``[B]`` int32; the last writes ``o``, ``m``,
    ``l`` (partial results of :func:`pallas_kernels.paged_attend_gpu.merge_splits`'s shapes)."""
    rows = batch * kv_heads
    r = q_heads // kv_heads
    rpad = max(16, pow2(r))
    summaries = SUMMARIES[scorer]
    # 64 slots from centroids, 32 from Quest's two summaries: the settings this path was
    # measured with (the Pallas scoring's 32 for centroids came later, not timed here).
    m, c = table_width, tuning.score_chunk or 64 // len(summaries)
    splits = tuning.splits or default_splits(batch, kv_heads, max_pages, tuning.block_pages)
    common = dict(HKV=kv_heads, HQ=q_heads, R=r, RPAD=rpad, D=head_dim, P=page_size,
                  N=pages_total)
    select = dict(M=m, MPAD=max(pow2(m), 16), MAXP=max_pages, HISTOGRAM=tuning.histogram)
    lists = (("keys", (rows, m), "uint32"), ("phys", (rows, max_pages), "int32"),
             ("slots", (rows, max_pages), "int32"), ("count", (rows,), "int32"))
    partials = (("o", (batch, kv_heads, splits, rpad, head_dim), "float32"),
                ("m", (batch, kv_heads, splits, rpad), "float32"),
                ("l", (batch, kv_heads, splits, rpad), "float32"))
    attending = {**common, "MAXP": max_pages, "BP": tuning.block_pages, "S": splits,
                 "SCALE": head_dim ** -0.5,
                 "IEEE": bool(jnp.dtype(compute_dtype) == jnp.float32)}
    selecting = (
        Launch("score_kernel" if scorer == "centroid" else "quest_score_kernel",
               (rows, -(-m // c)), ("q", *summaries, "table", "lengths"), lists[:1],
               tuple({**common, "M": m, "C": c}.items()), tuning.score_warps, 1),
        Launch("select_kernel", (rows,), ("keys", "table", "lengths", "budgets"), lists[1:],
               tuple({"HKV": kv_heads, "P": page_size, **select}.items()),
               tuning.select_warps, 1))
    attend = Launch(
        "attend_kernel", (rows, splits), ("q", "k", "v", "phys", "slots", "count", "lengths"),
        partials, tuple(attending.items()), tuning.attend_warps, tuning.attend_stages)
    return (*selecting, attend)


def sparse_decode_triton(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                         page_table: jax.Array, lengths: jax.Array, budget_pages: jax.Array, *,
                         page_size: int = 16, scorer: str = "centroid",
                         centroids: jax.Array | None = None,
                         summaries: tuple[jax.Array, jax.Array] | None = None,
                         max_budget_pages: int | None = None,
                         tuning: TritonDecodeTuning = TritonDecodeTuning()) -> jax.Array:
    """Block top-k sparse decode attention (docs/design.md, section 3), the Triton kernels.

    ``sparrow_jax.sparse_decode(..., impl="triton")`` is the usual way in; this entry point
    also takes the tuning settings. Arguments and result as for
    :func:`pallas_kernels.sparse_decode_gpu.sparse_decode_pallas` (the same checks and limits),
    ``tuning`` a :class:`TritonDecodeTuning`. GPU only."""
    summ = checked_args(
        "sparse_decode_triton", q, k_pages, v_pages, page_table, lengths, budget_pages,
        page_size=page_size, scorer=scorer, centroids=centroids, summaries=summaries,
        max_budget_pages=max_budget_pages, block_pages=tuning.block_pages)
    return sparse_decode_triton_checked(q, k_pages, v_pages, summ, page_table, lengths,
                                        budget_pages, page_size=page_size,
                                        max_budget_pages=max_budget_pages, tuning=tuning)


def kernels_module():
    """:mod:`pallas_kernels.triton_decode_kernels` and ``jax_triton``, or ImportError naming
    what to install."""
    try:
        import jax_triton
        from pallas_kernels import triton_decode_kernels
    except ImportError as e:
        raise ImportError(f"{MISSING} ({e})") from None
    return triton_decode_kernels, jax_triton


def sparse_decode_triton_checked(q, k_pages, v_pages, summaries, page_table, lengths,
                                 budget_pages, *, page_size, max_budget_pages=None,
                                 tuning=TritonDecodeTuning()):
    """:func:`sparse_decode_triton` for arguments its caller has already checked (as
    ``sparse_decode`` does) and given page summaries (centroids, or the pair (kmin, kmax)
    for Quest)."""
    kernels_module()
    if jax.default_backend() != "gpu":
        raise ValueError("impl='triton' runs on a GPU only (jax-triton); the CPU tests run its "
                         "kernels in Triton's interpreter, and impl='pallas' runs interpreted")
    return _sparse_decode(q, k_pages, v_pages, as_summaries(summaries),
                          page_table.astype(jnp.int32),
                          lengths.astype(jnp.int32), budget_pages.astype(jnp.int32),
                          page_size=page_size,
                          max_pages=max_budget_pages or page_table.shape[1], tuning=tuning)


@functools.partial(jax.jit, static_argnames=("page_size", "max_pages", "tuning"))
def _sparse_decode(q, k_pages, v_pages, summaries, page_table, lengths, budget_pages, *,
                   page_size, max_pages, tuning):
    b, hq, d = q.shape
    hkv, n_total = k_pages.shape[:2]
    cdt = jnp.promote_types(q.dtype, k_pages.dtype)
    scorer = "centroid" if len(summaries) == 1 else "quest"   # as_summaries' rule
    launches = plan(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, pages_total=n_total,
                    page_size=page_size, table_width=page_table.shape[1], max_pages=max_pages,
                    compute_dtype=cdt, tuning=tuning, scorer=scorer)
    buf = run_launches(launches, dict(q=q.astype(cdt), k=k_pages, v=v_pages,
                                      **dict(zip(SUMMARIES[scorer], summaries)),
                                      table=page_table, lengths=lengths, budgets=budget_pages))
    return merge_splits(buf["o"], buf["m"], buf["l"], hq // hkv).astype(q.dtype)


def run_launches(launches, buffers: dict) -> dict:
    """Runs the launches of :func:`plan` through ``jax_triton.triton_call`` (GPU): the named
    input buffers -> those and every buffer the launches write."""
    kernels, jt = kernels_module()
    buf = dict(buffers)
    for launch in launches:
        outs = jt.triton_call(
            *(buf[name] for name in launch.inputs), kernel=getattr(kernels, launch.kernel),
            out_shape=[jax.ShapeDtypeStruct(shape, dtype) for _, shape, dtype in launch.outputs],
            grid=launch.grid, num_warps=launch.num_warps, num_stages=launch.num_stages,
            name=f"sparse_decode_{launch.kernel}", **dict(launch.constants))
        buf.update(zip((name for name, _, _ in launch.outputs), outs))
    return buf
