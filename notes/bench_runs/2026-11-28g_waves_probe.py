"""Probe (session 33): do the sparse step's kernels read faster on more, shorter programs?

The balanced attention runs one wave of programs (4 an SM), all ramping and draining together;
the dense kernel, at 88% of the read ceiling, runs ~15 waves. This times, at 32K context and
budget 2048 on one GPU, by what a call adds to a chain (marginal), beside the marginal read
ceiling and the dense baseline of the same run:
  - the whole step with the attention on 1, 2 and 4 waves of programs (the module constant
    ATTEND_PROGRAMS_PER_SM set to 4, 8, 16 and jax's caches cleared between, so that only
    the balanced attention's program count changes; dense decode is timed before, at 4);
  - the attention alone (from the default step's lists) on 1, 2, 4 waves;
  - the step and the scoring alone with 64 (default), 32 and 16 slots a scoring program
    (more scoring programs: at batch 8 the default is about one wave of them).
Each variant's output is checked against the float32 XLA reference.

    PYTHONPATH=.:scripts python3 notes/bench_runs/2026-11-28g_waves_probe.py --out $OUT/w.json
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels.paged_attend_gpu as pag
from bench_decode import P, decode_inputs
from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, score_keys, select_page_lists,
                                              sparse_decode_pallas, list_sizes)
from sparrow_jax.attention.paged_dense import paged_attention
from sparrow_jax.attention.sparse import sparse_decode
from sparrow_jax.benchmarking import marginal_seconds, read_ceiling, write_record

CONTEXT, BUDGET = 32768, 2048


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--waves", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--chunks", type=int, nargs="+", default=[32, 16])
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    kb = BUDGET // P
    ceiling = read_ceiling(marginal=True)
    print(f"ceiling {ceiling:.0f} GB/s", flush=True)
    rows = []
    for b in args.batches:
        m = CONTEXT // P
        order = np.random.default_rng(b).permutation(b * m)
        q, k, v, c, table, lengths = decode_inputs(b, CONTEXT, order)
        budgets = jnp.full((b,), kb, jnp.int32)
        sparse_bytes = b * 8 * ((m - 3) * 128 + kb * P * 128 * 2) * 2
        attend_bytes = b * 8 * kb * P * 128 * 2 * 2
        score_bytes = b * 8 * (m - 3) * 128 * 2
        with jax.default_matmul_precision("highest"):
            want = np.asarray(jax.jit(functools.partial(
                sparse_decode, page_size=P, centroids=c, max_budget_pages=kb,
                impl="reference"))(q, k, v, table, lengths, budgets), np.float32)

        def err(got):
            got = np.asarray(got, np.float32)
            return float(np.abs(got - want).max() / np.abs(want).max())

        def row(name, seconds, nbytes, **extra):
            r = dict(batch=b, name=name, us=seconds * 1e6,
                     of_ceiling=nbytes / seconds / 1e9 / ceiling, **extra)
            rows.append(r)
            print(r, flush=True)
            return r

        dense = marginal_seconds(lambda x, k_, v_, t_, n_: paged_attention(x, k_, v_, t_, n_),
                                 (q, k, v, table, lengths), args.chain, args.repeats)
        row("dense", dense, 2 * b * CONTEXT * 8 * 128 * 2)

        def step(tuning):
            return lambda x, k_, v_, c_, t_, n_, bu_: sparse_decode_pallas(
                x, k_, v_, t_, n_, bu_, page_size=P, centroids=c_, max_budget_pages=kb,
                tuning=tuning)

        tuning = GpuDecodeTuning().resolve(page_size=P, batch=b, kv_heads=8, max_pages=kb)
        phys, slots, count = select_page_lists(q, c, table, lengths, budgets, page_size=P,
                                               max_pages=kb, tuning=tuning)
        for waves in args.waves:
            pag.ATTEND_PROGRAMS_PER_SM = 4 * waves
            jax.clear_caches()
            f = step(GpuDecodeTuning())
            e = err(jax.jit(f)(q, k, v, c, table, lengths, budgets))
            s = marginal_seconds(f, (q, k, v, c, table, lengths, budgets), args.chain,
                                 args.repeats)
            row(f"step_waves{waves}", s, sparse_bytes, rel_err=e, x_dense=dense / s)

            def attend(x, k_, v_, ph_, sl_, co_, n_):
                return pag.attend_page_lists_balanced(x, k_, v_, ph_, sl_, co_, n_,
                                                      page_size=P, tuning=tuning)
            s = marginal_seconds(attend, (q, k, v, phys, slots, count, lengths), args.chain,
                                 args.repeats)
            row(f"attend_waves{waves}", s, attend_bytes)
        pag.ATTEND_PROGRAMS_PER_SM = 4
        jax.clear_caches()
        mpad, _ = list_sizes(m, kb, tuning)
        table_pad = jnp.pad(table, ((0, 0), (0, mpad - m)))
        for chunk in [64] + args.chunks:
            t = GpuDecodeTuning(score_chunk=chunk)
            if chunk != 64:
                f = step(t)
                e = err(jax.jit(f)(q, k, v, c, table, lengths, budgets))
                s = marginal_seconds(f, (q, k, v, c, table, lengths, budgets), args.chain,
                                     args.repeats)
                row(f"step_chunk{chunk}", s, sparse_bytes, rel_err=e, x_dense=dense / s)
            tr = t.resolve(page_size=P, batch=b, kv_heads=8, max_pages=kb)

            def score(x, c_, t_, n_, tr=tr):
                keys = score_keys(x, c_, t_, n_, page_size=P, tuning=tr)
                return x + (keys[:, :, 1].sum() == -1).astype(x.dtype)
            s = marginal_seconds(score, (q, c, table_pad, lengths), args.chain, args.repeats)
            row(f"score_chunk{chunk}", s, score_bytes)
        del q, k, v, c
    write_record(args.out, ceiling_gb_s=ceiling, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
