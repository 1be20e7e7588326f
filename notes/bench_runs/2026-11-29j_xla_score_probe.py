"""Probe (session 49): the page scoring written in XLA, in three formulations, against the Pallas
scoring kernel, each followed by the Pallas selection (which reads every key, so nothing of
the scoring can be dropped by XLA), timed in one process as bench_decode's marginal loop.

- ``pallas``: :func:`pallas_kernels.sparse_decode_gpu.score_keys`.
- ``take``: the group's mean query first (a fusion of its own), the centroids gathered as
  ``[Hkv, B, M, D]``, products summed over D, the keys transposed to ``[B, Hkv, M]``.
- ``direct``: as ``take`` but gathered as ``[B, Hkv, M, D]`` (no transpose).

(Since session 50 the selection takes head-major keys ``[Hkv, B, M]``: ``take`` and ``spread``
no longer transpose theirs, ``direct`` and ``group_sum`` do.)
- ``group_sum``: gathered as ``[B, Hkv, M, D]``, the products with each query head summed
  over the group and D at once (no mean query first); ``lib`` in the raw JSON of its run,
  the library's first ``score_keys_xla``. The library took ``take``'s formulation after it.
- ``spread``: as ``take``, but a slot that is not eligible gathers one of the pool's first
  64 pages (by its slot index) instead of page 0 for all of them.

``--length-frac F``: every row at F of the context, in the table as wide as the whole context
(as the engine's power-of-two table widths leave its rows: half the slots past the row at
times), so that ``take`` gathers page 0 for the other slots of every (row, KV head): whether
that one address (a hot L2 line) is what made the engine's step slower with the XLA scoring
(rollout run U) and ``spread`` avoids it. Each case's keys are checked against the Pallas
kernel's (the same ineligible slots, scores within float32 rounding); the optimized HLO's
kernels of each are printed.

    python3 notes/bench_runs/2026-11-29j_xla_score_probe.py --batches 1 2 4 8 16 32 64
    python3 notes/bench_runs/2026-11-29j_xla_score_probe.py --batches 19 32 --length-frac 0.5 \
        --cases pallas,take,spread

``--pools N`` (session 50): the chained calls read N copies of the centroids in turn, so that
none finds the previous call's pages in L2; ``--table rows``: each row's pages adjacent and
ascending, as the engine's allocator hands them out; ``--hlo-dir``: each case's optimized HLO.

``--rollout SCORE -- ARGS``: instead, ``scripts/bench_rollout.py ARGS`` with the engine's
sparse step scoring by SCORE: ``pallas`` (the default), ``xla`` (``score_keys_xla``) or
``spread`` (``score_keys_xla`` replaced by the case above), one process each:

    for s in pallas xla spread; do XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
      python3 notes/bench_runs/2026-11-29j_xla_score_probe.py --rollout $s -- --phase profile \
        --batch 19 --repeats 1 --modes sparse --contexts 8192 16384 --no-split \
        --no-emit-breakdown; done
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
import runpy
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_decode import HKV, P, decode_inputs  # noqa: E402

import pallas_kernels.sparse_decode_gpu as gpu  # noqa: E402
from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, list_sizes, score_keys,  # noqa: E402
                                              select_from_keys)
from sparrow_jax.attention import sparse  # noqa: E402
from sparrow_jax.attention.selection import num_pages, order_key  # noqa: E402
from sparrow_jax.benchmarking import marginal_seconds, write_record  # noqa: E402

INT_MIN = np.int32(-2 ** 31)


def eligible_of(table, lengths):
    slot = lax.broadcasted_iota(jnp.int32, table.shape, 1)
    return (slot >= 1) & (slot < num_pages(lengths, P)[:, None] - 2)


def take(q, cent, table, lengths):
    b, hq, d = q.shape
    hkv = cent.shape[0]
    ok = eligible_of(table, lengths)
    qbar = jnp.sum(q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d), axis=2) / (hq // hkv)
    pages = jnp.take(cent, jnp.where(ok, table, 0), axis=1).astype(jnp.float32)
    score = jnp.sum(pages * jnp.swapaxes(qbar, 0, 1)[:, :, None, :], axis=-1)
    return jnp.where(ok[None], order_key(score), INT_MIN)


def spread(q, cent, table, lengths):
    b, hq, d = q.shape
    hkv = cent.shape[0]
    ok = eligible_of(table, lengths)
    spare = lax.broadcasted_iota(jnp.int32, table.shape, 1) % min(64, cent.shape[1])
    qbar = jnp.sum(q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d), axis=2) / (hq // hkv)
    pages = jnp.take(cent, jnp.where(ok, table, spare), axis=1).astype(jnp.float32)
    score = jnp.sum(pages * jnp.swapaxes(qbar, 0, 1)[:, :, None, :], axis=-1)
    return jnp.where(ok[None], order_key(score), INT_MIN)


def direct(q, cent, table, lengths):
    b, hq, d = q.shape
    hkv = cent.shape[0]
    ok = eligible_of(table, lengths)[:, None]
    qbar = jnp.sum(q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d), axis=2) / (hq // hkv)
    heads = lax.broadcasted_iota(jnp.int32, (1, hkv, 1), 1)
    pages = cent[heads, jnp.where(ok, table[:, None], 0)].astype(jnp.float32)
    score = jnp.sum(pages * qbar[:, :, None, :], axis=-1)
    return jnp.swapaxes(jnp.where(ok, order_key(score), INT_MIN), 0, 1)


def group_sum(q, cent, table, lengths):
    b, hq, d = q.shape
    hkv = cent.shape[0]
    ok = eligible_of(table, lengths)[:, None]
    heads = lax.broadcasted_iota(jnp.int32, (1, hkv, 1), 1)
    pages = cent[heads, jnp.where(ok, table[:, None], 0)].astype(jnp.float32)[:, :, :, None]
    qg = q.astype(jnp.float32).reshape(b, hkv, 1, hq // hkv, d)
    score = jnp.sum(pages * qg, axis=(3, 4)) / (hq // hkv)
    return jnp.swapaxes(jnp.where(ok, order_key(score), INT_MIN), 0, 1)


def scores_of(keys):
    keys = np.asarray(keys, np.int32)
    return np.where(keys < 0, keys ^ np.int32(0x7FFFFFFF), keys).astype(np.int32).view(
        np.float32)


def rollout(score, argv):
    """scripts/bench_rollout.py with argv, the engine's sparse step scoring by ``score``."""
    if score != "pallas":
        sparse.sparse_decode_pallas_checked = functools.partial(
            gpu.sparse_decode_pallas_checked, tuning=GpuDecodeTuning(score="xla"))
    if score == "spread":
        def keys(q, summaries, table, lengths, *, page_size):
            assert page_size == P and len(gpu.as_summaries(summaries)) == 1, "centroids only"
            return spread(q, gpu.as_summaries(summaries)[0], table, lengths)
        gpu.score_keys_xla = keys
    sys.argv = [str(ROOT / "scripts" / "bench_rollout.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def main():
    if "--rollout" in sys.argv:
        i = sys.argv.index("--rollout")
        assert sys.argv[i + 2] == "--", "--rollout SCORE -- bench_rollout's arguments"
        return rollout(sys.argv[i + 1], sys.argv[i + 3:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--length-frac", type=float, default=1.0,
                    help="every row at this fraction of the context (the table stays as wide)")
    ap.add_argument("--cases", default="pallas,take,direct,group_sum,spread")
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", choices=("random", "rows"), default="random",
                    help="rows: each row's pages adjacent and ascending in the pool, as the "
                         "engine's allocator hands them out (random: a permutation)")
    ap.add_argument("--pools", type=int, default=1,
                    help="the chain's calls read POOLS copies of the centroids in turn (more "
                         "than L2 holds: no call finds the previous one's pages in cache)")
    ap.add_argument("--hlo-dir", type=Path, default=None, help="each case's optimized HLO")
    args = ap.parse_args()
    rows = []
    for b in args.batches:
        m = args.context // P
        kb = args.budget // P
        order = (np.arange(b * m) if args.table == "rows"
                 else np.random.default_rng(0).permutation(b * m))
        q, _, _, cent, table, lengths = decode_inputs(b, args.context, order)
        tuning = GpuDecodeTuning().resolve(page_size=P, batch=b, kv_heads=HKV, max_pages=kb)
        mpad, kpad = list_sizes(m, kb, tuning)
        table = jnp.pad(table, ((0, 0), (0, mpad - m)))
        lengths = jnp.maximum(lengths * args.length_frac, 1).astype(jnp.int32)
        budgets = jnp.full((b,), kb, jnp.int32)
        pools = jnp.concatenate([cent] * args.pools, axis=1)
        interpret = jax.default_backend() == "cpu"     # a check of the probe itself
        cases = dict(
            pallas=lambda q_, c_, t_, l_: score_keys(q_, c_, t_, l_, page_size=P, tuning=tuning,
                                                     interpret=interpret),
            take=take, direct=direct, group_sum=group_sum, spread=spread)
        ref = np.asarray(jax.jit(cases["pallas"])(q, cent, table, lengths))
        for name, fn in cases.items():
            if name not in args.cases.split(","):
                continue
            jitted = jax.jit(fn)
            keys = np.asarray(jitted(q, cent, table, lengths))
            ok = ref != INT_MIN
            hlo = jitted.lower(q, cent, table, lengths).compile().as_text()
            if args.hlo_dir is not None:
                args.hlo_dir.mkdir(parents=True, exist_ok=True)
                (args.hlo_dir / f"{name}_b{b}.txt").write_text(hlo)
            entry = hlo[hlo.index("ENTRY"):]
            kernels = re.findall(r"= \S+ (fusion|custom-call|copy|transpose|gather|reduce)\(",
                                 entry)

            calls = itertools.count()

            def step(q_, c_, t_, l_, bu_, fn=fn):
                # Each traced call of the unrolled chain reads the next copy of the pool.
                t_ = t_ + (next(calls) % args.pools) * cent.shape[1]
                phys, _, count = select_from_keys(fn(q_, c_, t_, l_), t_, l_, bu_, page_size=P,
                                                  max_pages=kb, kpad=kpad, tuning=tuning,
                                                  interpret=interpret)
                return q_ + ((phys[:, :, 0].sum() + count.sum()) == -1).astype(q_.dtype)
            row = dict(batch=b, case=name, kernels=kernels,
                       same_ineligible=bool(np.array_equal(keys == INT_MIN, ~ok)),
                       max_score_diff=float(np.max(np.abs(scores_of(keys)[ok]
                                                          - scores_of(ref)[ok]))),
                       pools=args.pools, table=args.table,
                       us=1e6 * marginal_seconds(step, (q, pools, table, lengths, budgets),
                                                 args.chain, args.repeats))
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_record(args.out, rows=rows)


if __name__ == "__main__":
    main()
