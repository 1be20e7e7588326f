"""Sparse decode benchmark (one layer, bf16, GQA 32/8, head_dim 128, page 16), checked and timed
in one run on the GPU:

* ``dense_xla_contiguous``: XLA attention on a contiguous cache (dense baseline 1);
* ``dense_pallas_paged``: ``paged_attention(impl="pallas")``, the sparse step's attention
  kernel over whole page tables (dense baseline 2, the engine's on GPU);
* ``dense_pallas_jax``: JAX's Pallas GPU paged attention (dense baseline 3);
* ``dense_cuda_lists``: the sparse step's CUDA attention over whole page tables (dense
  baseline 4); "x vs dense" is against the fastest dense baseline measured, "x issue 5" against
  the faster of baselines 1 and 2 (issue 5's measure, which the GPU targets are stated in);
* ``composition``: XLA centroid scores + ``lax.top_k`` + JAX's Pallas paged attention on the
  chosen pages (the off-the-shelf pieces);
* ``xla_reference``: ``sparrow_jax.attention.sparse.sparse_decode(impl="reference")``;
* ``kernel``: ``pallas_kernels.sparse_decode_gpu.sparse_decode_pallas``;
* ``triton`` (``--triton-configs``): ``pallas_kernels.sparse_decode_triton.sparse_decode_triton``
  (needs jax-triton);
* ``quest`` (``--quest``): each ``kernel`` and ``triton`` variant with ``scorer="quest"``,
  scoring Quest's bound from each page's min and max of keys (two summaries a page);

plus a read-bandwidth ceiling (the faster of a sum and a max over a 4 GiB array; with
``--loops marginal``, also timed that way for the marginal rows) and the bytes
each must move. Every sequence is at the full context, pages scattered in the pool. Each timing
runs ``--chain`` calls in one jitted loop whose next query is the previous output (XLA can
neither merge nor skip them), after warm-up; the median of ``--repeats`` runs, per call. With
``--loops marginal``, the time a call adds to a long chain instead: two unrolled chains (4x
apart) and the difference of their medians per call, which leaves out what each timed program
costs once (its dispatch, graph launch and the wait for its end, ~0.3 ms on an H100: 15 us a
call in a chain of 20). Each sparse output is checked against the XLA reference (float32
math) before it is timed. ``--clocks`` records the GPU's SM and memory clocks sampled while
each row is timed (``sparrow_jax.clock_sampler``), since a latency-bound step moves with the
SM clock and the dense baselines with the memory's.

    PYTHONPATH=. python3 scripts/bench_decode.py --out $OUT/bench_decode.json

Needs only jax and numpy.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.paged_attend_gpu import (attend_page_lists, attend_page_lists_balanced,
                                             merge_splits)
from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, list_sizes, score_keys,
                                              select_from_keys, select_page_lists,
                                              sparse_decode_pallas)
from pallas_kernels.sparse_attend_cuda import attend_page_lists_cuda
from pallas_kernels.sparse_attend_cuda import unavailable as cuda_unavailable
from pallas_kernels.sparse_attend_mgpu import attend_page_lists_mgpu, pad_heads
from pallas_kernels.sparse_decode_triton import (TritonDecodeTuning, plan, run_launches,
                                                 sparse_decode_triton)
from sparrow_jax.attention.paged_dense import paged_attention_pallas, paged_attention_pallas_jax
from sparrow_jax.attention.sparse import sparse_decode
from sparrow_jax.benchmarking import (chained, contiguous_attention, marginal_seconds,
                                      median_seconds, profile_calls, read_ceiling)
from sparrow_jax.clock_sampler import ClockSampler
from sparrow_jax.decode_bench import DecodeShape, random_case

HQ, HKV, D, P = 32, 8, 128, 16


def decode_inputs(b: int, ctx: int, order: np.ndarray):
    """One benchmark case, every sequence at the full context ``ctx``: (q ``[b, HQ, D]``, K and
    V pages ``[HKV, b * ctx / P, P, D]``, centroids ``[HKV, b * ctx / P, D]``, page table
    ``[b, ctx / P]``: ``order``, the pool's pages in the rows' order, lengths ``[b]``)."""
    return random_case(DecodeShape(HQ, HKV, D, P), b, ctx, seed=ctx * 131 + b, order=order)


def composition(q, k_pages, v_pages, centroids, table, lengths, *, budget, interpret=False):
    """Off-the-shelf pieces, for rows longer than the budget: XLA scores, ``lax.top_k`` of the
    eligible pages, the reserved pages, then JAX's Pallas paged attention with one "sequence" per
    (row, KV head) over its chosen pages in page order (so only the last one is partial)."""
    b, hq, d = q.shape
    h, n_total = k_pages.shape[:2]
    r = hq // h
    m = table.shape[1]
    qbar = jnp.mean(q.reshape(b, h, r, d).astype(jnp.float32), axis=2)
    cent = jnp.take(centroids, table, axis=1).astype(jnp.float32)            # [H, B, M, D]
    scores = jnp.einsum("bhd,hbmd->bhm", qbar, cent)
    n = (lengths + P - 1) // P
    j = jnp.arange(m)
    eligible = (j >= 1)[None, :] & (j[None, :] < (n - 2)[:, None])
    scores = jnp.where(eligible[:, None, :], scores, -jnp.inf)
    _, top = lax.top_k(scores, budget - 3)                                    # [B, H, K-3]
    fixed = jnp.stack([jnp.zeros_like(n), n - 2, n - 1], -1)[:, None, :]
    chosen = jnp.sort(jnp.concatenate([jnp.broadcast_to(fixed, (b, h, 3)), top], -1), -1)
    phys = jnp.take_along_axis(jnp.broadcast_to(table[:, None, :], (b, h, m)), chosen, -1)
    phys = phys + (jnp.arange(h) * n_total)[None, :, None]
    lens = (budget - 1) * P + lengths - (n - 1) * P
    out = paged_attention_pallas_jax(
        q.reshape(b * h, r, d), k_pages.reshape(1, h * n_total, P, d),
        v_pages.reshape(1, h * n_total, P, d), phys.reshape(b * h, budget),
        jnp.repeat(lens, h), interpret=interpret)
    return out.reshape(b, hq, d)


def page_order(n_pages: int, ctx: int, batch: int, *, seed: int = 0,
               contiguous: bool = False) -> np.ndarray:
    """The pool position of each of a case's ``n_pages`` pages: a permutation drawn from
    (seed, ctx, batch) alone, so that a case reads the same addresses whichever cases ran
    before it in the process (one shared generator made batch 32's order depend on the
    batches listed before it); ``contiguous``: in order."""
    if contiguous:
        return np.arange(n_pages)
    return np.random.default_rng((seed, ctx, batch)).permutation(n_pages)


def dense_cuda_lists(q, k_pages, v_pages, lists, lengths, *, slots):
    """Dense decode by the sparse step's CUDA attention: each row's page table as the list of
    each of its KV heads (``lists`` ``[B, Hkv, M]``)."""
    count = jnp.broadcast_to((-(-lengths // P))[:, None, None], (*lists.shape[:2], 1))
    return attend_page_lists_cuda(q, k_pages, v_pages, lists, slots, count.astype(jnp.int32),
                                  lengths)


def parse_variant(spec):
    """'b8s4w4' -> ('kernel_b8s4w4', GpuDecodeTuning(block_pages=8, splits=4,
    attend_warps=4)); 'a1': the balanced attention (CUDA: stream-K; 'a0' even splits, neither
    the device's choice); 'p1': the Pallas attention, 'p0' the CUDA one (neither: "auto", the
    CUDA one where it runs); 'n66': the CUDA attention on 66 blocks; 'x1': the scoring in
    XLA, 'x0' the Pallas scoring, 'x2' the scoring and selection in one CUDA kernel; 'f1': the lists chosen inside the CUDA attention
    (select_in_attention); 'e1': the CUDA selection kernel, 'e0' the Pallas one."""
    names = dict(b="block_pages", s="splits", w="attend_warps", c="score_chunk",
                 t="select_warps", g="attend_stages", v="score_warps", a="balanced",
                 p="attend", n="attend_programs", x="score", f="select_in_attention",
                 e="select")
    kw = {names[k]: int(v) for k, v in re.findall(r"([bswctgvapnxfe])(\d+)", spec)}
    for flag in ("balanced", "select_in_attention"):
        if flag in kw:
            kw[flag] = bool(kw[flag])
    if "attend" in kw:
        kw["attend"] = "pallas" if kw["attend"] else "cuda"
    if "score" in kw:
        kw["score"] = ("pallas", "xla", "cuda")[kw["score"]]
    if "select" in kw:
        kw["select"] = "cuda" if kw["select"] else "pallas"
    return f"kernel_{spec}", GpuDecodeTuning(**kw)


def parse_triton_variant(spec):
    """'b8w8h0' -> ('triton_b8w8h0', TritonDecodeTuning(block_pages=8, attend_warps=8,
    histogram=False)); a spec without letters and numbers ('default') -> the defaults."""
    names = dict(b="block_pages", s="splits", w="attend_warps", g="attend_stages",
                 c="score_chunk", v="score_warps", t="select_warps", h="histogram")
    kw = {names[k]: int(v) for k, v in re.findall(r"([bswgcvth])(\d+)", spec)}
    if "histogram" in kw:
        kw["histogram"] = bool(kw["histogram"])
    return f"triton_{spec}", TritonDecodeTuning(**kw)


def triton_breakdown_cases(tuning, q, k_pages, v_pages, centroids, table, lengths, budgets, kb,
                           b, m, minmax=None):
    """The Triton step's parts timed alone: its scoring launch, its scoring and selection
    launches, and its attention launch + merge from given lists (chained as in
    :func:`breakdown_cases`); with ``minmax``, Quest's scoring launch too."""
    shape = dict(batch=b, q_heads=HQ, kv_heads=HKV, head_dim=D, pages_total=k_pages.shape[1],
                 page_size=P, table_width=m, max_pages=kb, compute_dtype=q.dtype, tuning=tuning)
    launches = plan(**shape)

    def score_only(launch, names):
        def run(q_, *a):
            buf = run_launches([launch], dict(q=q_, **dict(zip(names, a))))
            return q_ + (buf["keys"][:, 1].sum() == 1).astype(q_.dtype)
        return run

    def select_only(q_, c_, t_, l_, bu_):
        buf = run_launches(launches[:-1], dict(q=q_, centroids=c_, table=t_, lengths=l_,
                                               budgets=bu_))
        return q_ + (buf["phys"][:, :1].sum() + buf["count"].sum() == -1).astype(q_.dtype)

    lists = jax.jit(lambda *a: run_launches(launches[:-1], dict(
        zip(("q", "centroids", "table", "lengths", "budgets"), a))))(
            q, centroids, table, lengths, budgets)

    def attend_only(q_, k_, v_, ph_, sl_, co_, l_):
        buf = run_launches(launches[-1:], dict(q=q_, k=k_, v=v_, phys=ph_, slots=sl_,
                                               count=co_, lengths=l_))
        return merge_splits(buf["o"], buf["m"], buf["l"], HQ // HKV).astype(q_.dtype)

    parts = {}
    if minmax is not None:
        parts["tpart_score_quest"] = (
            None, score_only(plan(**shape, scorer="quest")[0], ("kmin", "kmax", "table",
                                                                "lengths")),
            (q, *minmax, table, lengths), 2 * b * HKV * (m - 3) * D * 2)
    return {**parts,
            "tpart_score": (None, score_only(launches[0], ("centroids", "table", "lengths")),
                            (q, centroids, table, lengths), b * HKV * (m - 3) * D * 2),
            "tpart_score_select": (None, select_only, (q, centroids, table, lengths, budgets),
                                   b * HKV * (m - 3) * D * 2),
            "tpart_attend": (None, attend_only, (q, k_pages, v_pages, lists["phys"],
                                                 lists["slots"], lists["count"], lengths),
                             b * HKV * kb * P * D * 2 * 2)}


def breakdown_cases(tuning, q, k_pages, v_pages, centroids, table, lengths, budgets, kb, b, m,
                    interpret, minmax=None):
    """Parts of the kernel timed alone (settings of ``tuning``): scoring + selection, scoring,
    selection from given keys, attention + merge from given lists; with ``minmax``, Quest's
    scoring too. Each next call's input depends on the last output (through a zero), so the
    calls stay chained."""
    given = tuning
    tuning = tuning.resolve(page_size=P, batch=b, kv_heads=HKV, max_pages=kb)
    mpad, kpad = list_sizes(m, kb, tuning)
    table_pad = jnp.pad(table, ((0, 0), (0, mpad - m)))
    centroid_bytes = b * HKV * (m - 3) * D * 2

    def select_only(q_, c_, t_, l_, bu_):
        phys, _, count = select_page_lists(q_, c_, t_, l_, bu_,
                                           page_size=P, max_pages=kb, tuning=tuning,
                                           interpret=interpret)
        return q_ + (phys[:, :, :1].sum() + count.sum() == -1).astype(q_.dtype)

    def score_only(q_, c_, t_, l_):
        keys = score_keys(q_, c_, t_, l_, page_size=P,
                          tuning=tuning, interpret=interpret)
        return q_ + (keys[:, :, 1].sum() == -1).astype(q_.dtype)

    keys = score_keys(q, centroids, table_pad, lengths, page_size=P,
                      tuning=tuning, interpret=interpret)

    def select_keys_only(keys_, t_, l_, bu_):
        phys, _, count = select_from_keys(keys_, t_, l_, bu_, page_size=P, max_pages=kb,
                                          kpad=kpad, tuning=tuning, interpret=interpret)
        return keys_ + (phys[:, :, :1].sum() + count.sum() == -1).astype(keys_.dtype)

    phys, slots, count = select_page_lists(q, centroids, table, lengths,
                                           budgets, page_size=P, max_pages=kb, tuning=tuning,
                                           interpret=interpret)

    even = dataclasses.replace(tuning, balanced=False)

    def attend_only(q_, k_, v_, ph_, sl_, co_, l_):
        return attend_page_lists(q_, k_, v_, ph_, sl_, co_, l_,
                                 page_size=P, tuning=even, interpret=interpret)

    def attend_balanced(q_, k_, v_, ph_, sl_, co_, l_):
        return attend_page_lists_balanced(q_, k_, v_, ph_, sl_, co_, l_, page_size=P,
                                          tuning=tuning, interpret=interpret)

    def attend_mgpu(stages):
        def run(q_, k_, v_, ph_, sl_, co_, l_):
            return attend_page_lists_mgpu(pad_heads(q_, HKV), HQ // HKV, k_, v_, ph_, sl_, co_,
                                          l_, page_size=P, splits=tuning.splits,
                                          stages=stages, interpret=interpret)
        return run

    # Diagnostic: every row's list is kb consecutive pages of the pool (same count, same
    # bytes), so the attention reads 2 x kb x 4 KB contiguous per (row, KV head) instead of
    # 4 KB pieces scattered by the selection.
    run = (jnp.arange(b, dtype=jnp.int32) * m)[:, None, None] + jnp.arange(
        phys.shape[-1], dtype=jnp.int32)
    run = jnp.broadcast_to(jnp.minimum(run, b * m - 1), phys.shape)
    slots_run = jnp.broadcast_to(jnp.arange(phys.shape[-1], dtype=jnp.int32), phys.shape)
    # Diagnostic: a static batch's tail, row 0's lists whole and every other row reading one
    # page (as the engine runs finished rows).
    lone = count.at[1:].set(1)
    lone_bytes = HKV * kb * P * D * 2 * 2

    parts = {}
    if cuda_unavailable() is None:
        # The CUDA attention on the same lists, checked like a whole step's: as the device
        # decides, even splits, stream-K; then with one row running (not checked).
        for name, balanced in (("", None), ("_even", False), ("_streamk", True)):
            run_cuda = functools.partial(attend_page_lists_cuda, balanced=balanced)
            parts[f"part_attend_cuda{name}"] = (kb * P, run_cuda, (q, k_pages, v_pages, phys,
                                                                   slots, count, lengths),
                                                b * HKV * kb * P * D * 2 * 2)
            parts[f"part_attend_cuda{name}_lone"] = (None, run_cuda, (q, k_pages, v_pages, phys,
                                                                      slots, lone, lengths),
                                                     lone_bytes)
    if minmax is not None:
        quest = given.resolve(page_size=P, batch=b, kv_heads=HKV, max_pages=kb, summaries=2)

        def score_quest(q_, lo_, hi_, t_, l_):
            keys = score_keys(q_, (lo_, hi_), t_, l_, page_size=P, tuning=quest,
                              interpret=interpret)
            return q_ + (keys[:, :, 1].sum() == -1).astype(q_.dtype)
        parts["part_score_quest"] = (None, score_quest, (q, *minmax, table_pad, lengths),
                                     2 * centroid_bytes)
    return {**parts,
            "part_score_select": (None, select_only, (q, centroids, table, lengths, budgets),
                                  centroid_bytes),
            "part_score": (None, score_only, (q, centroids, table_pad, lengths),
                           centroid_bytes),
            # Diagnostic: the same rows' pages in increasing pool order (locality of the
            # 256-byte centroid reads; same bytes).
            "part_score_sorted": (None, score_only,
                                  (q, centroids, jnp.sort(table_pad, axis=1), lengths),
                                  centroid_bytes),
            "part_select": (None, select_keys_only, (keys, table_pad, lengths, budgets),
                            keys.nbytes),
            "part_attend": (None, attend_only, (q, k_pages, v_pages, phys, slots, count,
                                                lengths), b * HKV * kb * P * D * 2 * 2),
            "part_attend_runs": (None, attend_only, (q, k_pages, v_pages, run, slots_run,
                                                     count, lengths),
                                 b * HKV * kb * P * D * 2 * 2),
            # part_attend: every list in the same splits; _balanced: one wave shared out by
            # list length (the default since run O), checked like part_attend_mgpu below;
            # then both with one row running.
            "part_attend_balanced": (kb * P, attend_balanced, (q, k_pages, v_pages, phys,
                                                               slots, count, lengths),
                                     b * HKV * kb * P * D * 2 * 2),
            "part_attend_lone": (None, attend_only, (q, k_pages, v_pages, phys, slots, lone,
                                                     lengths), lone_bytes),
            "part_attend_balanced_lone": (None, attend_balanced, (q, k_pages, v_pages, phys,
                                                                  slots, lone, lengths),
                                          lone_bytes),
            # The same attention as a Mosaic GPU kernel, pages fetched by TMA, 2 and 4 stages
            # (pallas_kernels/sparse_attend_mgpu.py; experimental). With the budget
            # named, so its output is checked against the reference like a whole step's.
            **{f"part_attend_mgpu_s{st}": (kb * P, attend_mgpu(st), (q, k_pages, v_pages, phys,
                                                                     slots, count, lengths),
                                           b * HKV * kb * P * D * 2 * 2) for st in (2, 4)}}


def selection_agreement(q, centroids, table, lengths, budgets, max_pages):
    """Rows (sequence, KV head) whose kernel page set differs from the XLA reference's, and the
    largest relative float32 score gap between a page only one of them chose and one only the
    other chose (rounding-level gaps mean near-ties decided by summation order)."""
    from sparrow_jax.attention import selection
    b, hq, d = q.shape
    h = centroids.shape[0]
    _, slots, count = select_page_lists(q, centroids, table, lengths,
                                        budgets, page_size=P, max_pages=max_pages)
    slots, count = np.asarray(slots), np.asarray(count)[..., 0]
    per_seq = jnp.moveaxis(centroids[:, table], 0, 1)                      # [B, H, M, D]
    scores = selection.centroid_scores(q.reshape(b, h, hq // h, d), per_seq)
    want = np.asarray(selection.select_pages(scores, (lengths + P - 1)[:, None] // P,
                                             budgets[:, None]))
    scores = np.asarray(scores)
    got = np.zeros_like(want)
    for bi in range(b):
        for hi in range(h):
            got[bi, hi, slots[bi, hi, :count[bi, hi]]] = True
    bad = np.argwhere((got != want).any(-1))
    gap = 0.0
    for bi, hi in bad:
        only_k = scores[bi, hi][got[bi, hi] & ~want[bi, hi]]
        only_r = scores[bi, hi][want[bi, hi] & ~got[bi, hi]]
        gap = max(gap, float((only_r.max() - only_k.min()) / np.abs(only_r).max()))
    return len(bad), b * h, gap


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 2048, 4096],
                    help="budgets in tokens (reserved pages included) at --sweep-contexts")
    ap.add_argument("--sweep-contexts", type=int, nargs="*", default=[32768],
                    help="contexts that get every budget; the others get --main-budget only")
    ap.add_argument("--main-budget", type=int, default=2048)
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--skip", nargs="*", default=[],
                    help="implementations (and --breakdown parts) not to run")
    ap.add_argument("--kernel-configs", default="b4",
                    help="kernel variants (GpuDecodeTuning), comma separated, each "
                         "letters+numbers: b block_pages, s splits, w attention warps, "
                         "g attention stages, c score_chunk, v score warps, t select warps, "
                         "a1 the balanced attention (CUDA: stream-K, a0 even splits), "
                         "p1 the Pallas attention, n the CUDA attention's blocks, "
                         "x1 the scoring in XLA, f1 the lists chosen in the CUDA attention, "
                         "e1 the CUDA selection kernel (e.g. b4s2w2g1c64v4t4, b4a1, b4a1n66)")
    ap.add_argument("--triton-configs", default="",
                    help="Triton kernel variants (TritonDecodeTuning), comma separated: "
                         "'default', or letters+numbers: b block_pages, s splits, w attention "
                         "warps, g attention stages, c score_chunk, v score warps, t select "
                         "warps, h0 bitwise threshold search")
    ap.add_argument("--trace", action="store_true",
                    help="also trace each kernel variant's chained calls once: its device time "
                         "per call by kernel (CUDA graphs off for the whole run, as in "
                         "scripts/profile_step.py: compare times within the run)")
    ap.add_argument("--loops", nargs="+", choices=("fori", "unrolled", "marginal"),
                    default=["fori"],
                    help="how the chained calls are timed: an XLA while loop (its own "
                         "per-iteration cost in each call), written out in one program, and/or "
                         "marginal: what a call adds to a long chain (two unrolled chains, "
                         "--chain and 4x --chain calls), without the program's once-a-run cost")
    ap.add_argument("--quest", action="store_true",
                    help="also the Pallas kernels (and the Triton variants) with "
                         "scorer='quest'")
    ap.add_argument("--out", default=None, help="JSON file")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time, with the first variant's settings, scoring + selection, "
                         "scoring alone, selection alone (given keys) and attention + merge "
                         "alone (given lists)")
    ap.add_argument("--contiguous-table", action="store_true",
                    help="diagnostic: each sequence's pages consecutive in the pool (the same "
                         "bytes as the default scattered table, read in address order)")
    ap.add_argument("--order-seed", type=int, default=0,
                    help="seed of the pages' scattered order in the pool; each context and "
                         "batch draws its own order from it")
    ap.add_argument("--clocks", action="store_true",
                    help="sample the GPU's SM and memory clocks (nvidia-smi) while each row is "
                         "timed: median, minimum and samples in the row's JSON")
    ap.add_argument("--interpret", action="store_true",
                    help="run the Pallas kernels interpreted (a CPU dry run at small sizes)")
    args = ap.parse_args(argv)
    if args.trace:          # read when the backend starts, at the first device use below
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_enable_command_buffer=").strip()
    dev = jax.devices()[0]
    print(f"backend {jax.default_backend()}, device {dev.device_kind}, jax {jax.__version__}",
          flush=True)
    ceiling = read_ceiling(small=args.interpret)
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    # Rates of marginal times against a ceiling timed the same way.
    ceilings = {loop: ceiling for loop in args.loops}
    if "marginal" in args.loops:
        ceilings["marginal"] = read_ceiling(small=args.interpret, marginal=True)
        print(f"read ceiling, marginal {ceilings['marginal']:.0f} GB/s", flush=True)
    cuda_why = cuda_unavailable()         # the benchmark's shapes are ones it takes
    if cuda_why:
        print(f"the CUDA attention is left out: {cuda_why}", flush=True)
    variants = [parse_variant(c) for c in args.kernel_configs.split(",") if c]
    triton_variants = [parse_triton_variant(c) for c in args.triton_configs.split(",") if c]
    rows = []
    for ctx in args.contexts:
        for b in args.batches:
            m = ctx // P
            n_total = b * m
            order = page_order(n_total, ctx, b, seed=args.order_seed,
                               contiguous=args.contiguous_table)
            q, k_pages, v_pages, centroids, table, lengths = decode_inputs(b, ctx, order)
            minmax = None
            if args.quest:   # one KV head at a time, as the centroids
                minmax = tuple(jnp.stack([f(k_pages[i], axis=1) for i in range(HKV)])
                               for f in (jnp.min, jnp.max))
            dense_bytes = 2 * b * ctx * HKV * D * 2
            cases = {}
            if "dense_xla_contiguous" not in args.skip:
                k_cont = jnp.swapaxes(jnp.take(k_pages, table, axis=1), 0, 1).reshape(
                    b, HKV, ctx, D)
                v_cont = jnp.swapaxes(jnp.take(v_pages, table, axis=1), 0, 1).reshape(
                    b, HKV, ctx, D)
                cases["dense_xla_contiguous"] = (None, contiguous_attention,
                                                 (q, k_cont, v_cont, lengths), dense_bytes)
            if "dense_pallas_paged" not in args.skip:
                cases["dense_pallas_paged"] = (None, functools.partial(
                    paged_attention_pallas, interpret=args.interpret),
                                               (q, k_pages, v_pages, table, lengths), dense_bytes)
            if "dense_cuda_lists" not in args.skip and cuda_why is None:
                # The CUDA attention over every page of each row (its table as each KV
                # head's list): dense decode as fast as the sparse step's attention reads.
                whole = jnp.broadcast_to(table[:, None, :], (b, HKV, m))
                cases["dense_cuda_lists"] = (None, functools.partial(
                    dense_cuda_lists, slots=jnp.broadcast_to(
                        jnp.arange(m, dtype=jnp.int32), (b, HKV, m))),
                                             (q, k_pages, v_pages, whole, lengths), dense_bytes)
            if "dense_pallas_jax" not in args.skip:
                cases["dense_pallas_jax"] = (None, functools.partial(
                    paged_attention_pallas_jax, interpret=args.interpret),
                                             (q, k_pages, v_pages, table, lengths), dense_bytes)
            budget_list = (args.budgets if ctx in args.sweep_contexts else [args.main_budget])
            for budget_tokens in budget_list:
                kb = budget_tokens // P
                if kb >= m:
                    continue
                budgets = jnp.full((b,), kb, jnp.int32)
                # Centroids of the eligible pages plus the chosen pages' keys and values.
                sparse_bytes = b * HKV * ((m - 3) * D * 2 + kb * P * D * 2 * 2)
                if "composition" not in args.skip:
                    cases[f"composition@{budget_tokens}"] = (
                        budget_tokens, functools.partial(composition, budget=kb,
                                                         interpret=args.interpret),
                        (q, k_pages, v_pages, centroids, table, lengths), sparse_bytes)
                if "xla_reference" not in args.skip:
                    cases[f"xla_reference@{budget_tokens}"] = (
                        budget_tokens, functools.partial(sparse_decode, page_size=P,
                                                         impl="reference", max_budget_pages=kb),
                        (q, k_pages, v_pages, table, lengths, budgets), sparse_bytes)
                for name, tuning in variants:
                    fn = functools.partial(
                        lambda q_, k_, v_, c_, t_, l_, bu_, **kw_: sparse_decode_pallas(
                            q_, k_, v_, t_, l_, bu_, centroids=c_, **kw_),
                        page_size=P, max_budget_pages=kb, tuning=tuning,
                        interpret=args.interpret)
                    cases[f"{name}@{budget_tokens}"] = (
                        budget_tokens, fn, (q, k_pages, v_pages, centroids, table, lengths,
                                            budgets), sparse_bytes)
                for name, tuning in variants if args.quest else ():
                    fn = functools.partial(
                        lambda q_, k_, v_, lo_, hi_, t_, l_, bu_, **kw_: sparse_decode_pallas(
                            q_, k_, v_, t_, l_, bu_, summaries=(lo_, hi_), **kw_),
                        page_size=P, scorer="quest", max_budget_pages=kb, tuning=tuning,
                        interpret=args.interpret)
                    cases[f"quest_{name[7:]}@{budget_tokens}"] = (
                        budget_tokens, fn, (q, k_pages, v_pages, *minmax, table, lengths,
                                            budgets),
                        sparse_bytes + b * HKV * (m - 3) * D * 2)
                for name, tuning in triton_variants:
                    fn = functools.partial(
                        lambda q_, k_, v_, c_, t_, l_, bu_, **kw_: sparse_decode_triton(
                            q_, k_, v_, t_, l_, bu_, centroids=c_, **kw_),
                        page_size=P, max_budget_pages=kb, tuning=tuning)
                    cases[f"{name}@{budget_tokens}"] = (
                        budget_tokens, fn, (q, k_pages, v_pages, centroids, table, lengths,
                                            budgets), sparse_bytes)
                for name, tuning in triton_variants if args.quest else ():
                    fn = functools.partial(
                        lambda q_, k_, v_, lo_, hi_, t_, l_, bu_, **kw_: sparse_decode_triton(
                            q_, k_, v_, t_, l_, bu_, summaries=(lo_, hi_), **kw_),
                        page_size=P, scorer="quest", max_budget_pages=kb, tuning=tuning)
                    cases[f"quest_{name}@{budget_tokens}"] = (
                        budget_tokens, fn, (q, k_pages, v_pages, *minmax, table, lengths,
                                            budgets),
                        sparse_bytes + b * HKV * (m - 3) * D * 2)
                if args.breakdown and triton_variants:
                    try:
                        parts = triton_breakdown_cases(triton_variants[0][1], q, k_pages,
                                                       v_pages, centroids, table, lengths,
                                                       budgets, kb, b, m, minmax)
                        cases.update({f"{k}@{budget_tokens}": c for k, c in parts.items()})
                    except Exception as e:  # the lists' launch failing is a result too
                        print(f"triton breakdown ctx={ctx} b={b}: FAILED {e!r}"[:2000],
                              flush=True)
                if args.breakdown and variants:
                    parts = breakdown_cases(variants[0][1], q, k_pages, v_pages, centroids,
                                            table, lengths, budgets, kb, b, m, args.interpret,
                                            minmax)
                    cases.update({f"{k}@{budget_tokens}": c for k, c in parts.items()
                                  if k not in args.skip})
                    # Scoring alone with each other variant's settings.
                    for name, tuning in variants[1:]:
                        part = breakdown_cases(tuning, q, k_pages, v_pages, centroids, table,
                                               lengths, budgets, kb, b, m, args.interpret)
                        cases[f"part_score_{name[7:]}@{budget_tokens}"] = part["part_score"]
            refs = {}
            for name, (bt, fn, fn_args, nbytes) in cases.items():
                try:
                    out = jax.block_until_ready(jax.jit(fn)(*fn_args))
                    err = None
                    if bt is not None:
                        scorer = "quest" if name.startswith("quest") else "centroid"
                        if (bt, scorer) not in refs:
                            # float32 math on the bf16 cache (no float32 copy of it).
                            refs[bt, scorer] = np.asarray(sparse_decode(
                                q.astype(jnp.float32), k_pages, v_pages, table, lengths,
                                jnp.full((b,), bt // P, jnp.int32), page_size=P,
                                impl="reference", scorer=scorer,
                                max_budget_pages=bt // P,
                                **(dict(summaries=minmax) if scorer == "quest" else
                                   dict(centroids=centroids))))
                        err = rel_err(out, refs[bt, scorer])
                        if name.startswith("kernel") and err > 1e-2:
                            nbad, rows_, gap = selection_agreement(
                                q, centroids, table, lengths, jnp.full((b,), bt // P, jnp.int32),
                                bt // P)
                            print(f"{name} ctx={ctx} b={b}: rel err {err:.1e}; page sets differ "
                                  f"from the reference in {nbad}/{rows_} rows, largest relative "
                                  f"score gap {gap:.1e}", flush=True)
                    # "unrolled" and "marginal" time the same program of args.chain calls.
                    unrolled = {args.chain: chained(fn, args.chain, unroll=True)}
                    runs = {loop: (chained(fn, args.chain) if loop == "fori"
                                   else unrolled[args.chain]) for loop in args.loops}
                    times, clocks = {}, {}
                    for loop, run in runs.items():
                        with ClockSampler(enabled=args.clocks) as cs:
                            times[loop] = (marginal_seconds(fn, fn_args, args.chain,
                                                            args.repeats, runs=unrolled)
                                           if loop == "marginal" else
                                           median_seconds(run, fn_args, args.repeats)
                                           / args.chain)
                        clocks[loop] = cs.summary
                except Exception as e:  # a variant that fails to build is a result too
                    msg = f"{type(e).__name__}: {e}"
                    print(f"{name} ctx={ctx} b={b}: FAILED {msg[:2000]}", flush=True)
                    rows.append(dict(impl=name, context=ctx, batch=b, error=msg[:2000]))
                    continue
                for loop, t in times.items():
                    row = dict(impl=name.split("@")[0],
                               budget_tokens=bt or (int(name.split("@")[1]) if "@" in name
                                                    else None),
                               context=ctx, batch=b, loop=loop,
                               ms=t * 1e3, bytes=nbytes, gb_per_s=nbytes / t / 1e9,
                               frac_ceiling=nbytes / t / 1e9 / ceilings[loop],
                               rel_err_vs_ref=err)
                    if clocks[loop] is not None:
                        row["clocks"] = clocks[loop]
                    if args.trace and name.startswith("kernel_"):
                        lines = profile_calls(runs[loop], fn_args, args.chain)
                        busiest = max(lines.values(), key=lambda entry: entry["total_us"])
                        row["device_us"] = busiest
                        print(f"{name} ctx={ctx} b={b} {loop}: device "
                              f"{busiest['total_us']:.1f} us a call: "
                              + ", ".join(f"{e['name'][:40]} {e['us']:.1f}"
                                          for e in busiest["top"]), flush=True)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del k_pages, v_pages, cases
            fn_args = refs = k_cont = v_cont = out = minmax = None  # free the device buffers
    table_rows = summarize(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=dev.device_kind, jax=jax.__version__,
                           read_ceiling_gb_s=ceiling,
                           read_ceiling_marginal_gb_s=ceilings.get("marginal"),
                           argv=sys.argv[1:], rows=rows), f, indent=1)
    print(f"\nread ceiling {ceiling:.0f} GB/s (marginal: "
          f"{ceilings.get('marginal') or float('nan'):.0f}); device {dev.device_kind}")
    print("\n".join(table_rows))
    return 0


def summarize(rows):
    """A markdown table: per (context, batch, budget), each implementation's ms, the kernel's
    (the fastest ``kernel`` variant, else Triton) speedups and fraction of the read ceiling,
    and the best Triton variant's time, speedup over the Pallas kernel, fraction of the
    ceiling and error."""
    ok = [r for r in rows if "ms" in r]
    dense = {}
    for r in ok:
        if r["budget_tokens"] is None and r["impl"].startswith("dense"):
            dense.setdefault((r["context"], r["batch"], r["loop"]), {})[r["impl"]] = r["ms"]
    out = ["| loop | ctx | batch | budget | dense xla / pallas ms | composition ms | xla ref ms | "
           "kernel ms (best) | x vs dense | x issue 5 | x vs comp | % ceiling | rel err | "
           "triton ms (best) | triton x vs kernel | triton % ceiling | triton rel err |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | "
           "--- | --- | --- |"]
    keys = sorted({(r["loop"], r["context"], r["batch"], r["budget_tokens"]) for r in ok
                   if r["budget_tokens"] is not None})
    for loop, ctx, b, bt in keys:
        here = {r["impl"]: r for r in ok
                if (r["loop"], r["context"], r["batch"], r["budget_tokens"])
                == (loop, ctx, b, bt)}
        kern = [r for n, r in here.items() if n.startswith("kernel")]
        trit = [r for n, r in here.items() if n.startswith("triton")]
        if not kern and not trit:
            continue
        best = min(kern or trit, key=lambda r: r["ms"])
        triton_cells = "| - | - | - | - |"
        if trit:
            tb = min(trit, key=lambda r: r["ms"])
            triton_cells = (f"| {tb['ms']:.3f} ({tb['impl']}) | {best['ms'] / tb['ms']:.2f} | "
                            f"{100 * tb['frac_ceiling']:.0f} | {tb['rel_err_vs_ref']:.1e} |")
        d = dense.get((ctx, b, loop), {})
        dbest = min(d.values()) if d else float("nan")
        issue5 = min((d[n] for n in ("dense_xla_contiguous", "dense_pallas_paged") if n in d),
                     default=float("nan"))
        comp = here.get("composition", {}).get("ms", float("nan"))
        ref = here.get("xla_reference", {}).get("ms", float("nan"))
        out.append(f"| {loop} | {ctx} | {b} | {bt} | "
                   f"{d.get('dense_xla_contiguous', float('nan')):.3f} / "
                   f"{d.get('dense_pallas_paged', float('nan')):.3f} | {comp:.3f} | {ref:.3f} | "
                   f"{best['ms']:.3f} ({best['impl']}) | {dbest / best['ms']:.1f} | "
                   f"{issue5 / best['ms']:.2f} | {comp / best['ms']:.2f} | "
                   f"{100 * best['frac_ceiling']:.0f} | "
                   f"{best['rel_err_vs_ref']:.1e} " + triton_cells)
    for r in ok:
        if r["impl"].startswith("quest_"):
            # The same settings scoring centroids: kernel_X for quest_X, triton_X for
            # quest_triton_X.
            base = r["impl"][6:] if r["impl"].startswith("quest_triton_") else (
                "kernel_" + r["impl"][6:])
            kern = [k for k in ok if k["impl"] == base and all(
                k[f] == r[f] for f in ("loop", "context", "batch", "budget_tokens"))]
            d = dense.get((r["context"], r["batch"], r["loop"]), {})
            vs = (f"{r['ms'] / kern[0]['ms']:.2f}x the centroid kernel's time, "
                  if kern else "")
            out.append(f"{r['impl']} {r['loop']} ctx {r['context']} b {r['batch']} budget "
                       f"{r['budget_tokens']}: {r['ms']:.3f} ms, {vs}"
                       f"{min(d.values(), default=float('nan')) / r['ms']:.1f}x dense, "
                       f"{100 * r['frac_ceiling']:.0f}% ceiling, rel err "
                       f"{r['rel_err_vs_ref']:.1e}")
    parts = [r for r in ok if r["impl"].startswith(("part_", "tpart_"))]
    if parts:
        out.append("")
        out.append("breakdown (first variant's settings): " + "; ".join(
            f"{r['loop']} ctx {r['context']} b {r['batch']} budget {r['budget_tokens']} "
            f"{r['impl']} "
            f"{r['ms'] * 1e3:.1f} us ({r['gb_per_s']:.0f} GB/s)" for r in parts))
    return out


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        sys.exit(main())
