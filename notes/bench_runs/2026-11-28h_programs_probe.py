"""Probe (session 34): the balanced attention on fewer programs than one full wave.

Run X put 4, 8 and 16 attention programs on each SM (1, 2, 4 waves: 4 fit at once) and found
each step up slower; this times the other side, 2 and 3 programs an SM (fewer programs, more
blocks each, fewer prologues and partials to merge, fewer reads in flight) against 4, at 32K
context and budget 2048 on one GPU, by what a call adds to a chain (marginal), beside the
marginal read ceiling and the dense kernel of the same run: the whole step, and the attention
alone from the default step's lists. The module constant ATTEND_PROGRAMS_PER_SM is set and
jax's caches cleared between settings; each step's output is checked against the float32 XLA
reference.

    PYTHONPATH=.:scripts python3 notes/bench_runs/2026-11-28h_programs_probe.py --out $OUT/p.json
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
from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, select_page_lists,
                                              sparse_decode_pallas)
from sparrow_jax.attention.paged_dense import paged_attention
from sparrow_jax.attention.sparse import sparse_decode
from sparrow_jax.benchmarking import marginal_seconds, read_ceiling, write_record

CONTEXT, BUDGET = 32768, 2048


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--per-sm", type=int, nargs="+", default=[4, 3, 2, 4])
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
        q, k, v, c, table, lengths = decode_inputs(b, CONTEXT,
                                                   np.random.default_rng(b).permutation(b * m))
        budgets = jnp.full((b,), kb, jnp.int32)
        sparse_bytes = b * 8 * ((m - 3) * 128 + kb * P * 128 * 2) * 2
        attend_bytes = b * 8 * kb * P * 128 * 2 * 2
        with jax.default_matmul_precision("highest"):
            want = np.asarray(jax.jit(functools.partial(
                sparse_decode, page_size=P, centroids=c, max_budget_pages=kb,
                impl="reference"))(q, k, v, table, lengths, budgets), np.float32)

        def row(name, seconds, nbytes, **extra):
            r = dict(batch=b, name=name, us=seconds * 1e6,
                     of_ceiling=nbytes / seconds / 1e9 / ceiling, **extra)
            rows.append(r)
            print(r, flush=True)

        dense = marginal_seconds(lambda x, k_, v_, t_, n_: paged_attention(x, k_, v_, t_, n_),
                                 (q, k, v, table, lengths), args.chain, args.repeats)
        row("dense", dense, 2 * b * CONTEXT * 8 * 128 * 2)
        tuning = GpuDecodeTuning().resolve(page_size=P, batch=b, kv_heads=8, max_pages=kb)
        phys, slots, count = select_page_lists(q, c, table, lengths, budgets, page_size=P,
                                               max_pages=kb, tuning=tuning)

        def step(x, k_, v_, c_, t_, n_, bu_):
            return sparse_decode_pallas(x, k_, v_, t_, n_, bu_, page_size=P, centroids=c_,
                                        max_budget_pages=kb, tuning=GpuDecodeTuning())

        def attend(x, k_, v_, ph_, sl_, co_, n_):
            return pag.attend_page_lists_balanced(x, k_, v_, ph_, sl_, co_, n_, page_size=P,
                                                  tuning=tuning)

        for per_sm in args.per_sm:
            pag.ATTEND_PROGRAMS_PER_SM = per_sm
            jax.clear_caches()
            got = np.asarray(jax.jit(step)(q, k, v, c, table, lengths, budgets), np.float32)
            e = float(np.abs(got - want).max() / np.abs(want).max())
            s = marginal_seconds(step, (q, k, v, c, table, lengths, budgets), args.chain,
                                 args.repeats)
            row(f"step_per_sm{per_sm}", s, sparse_bytes, rel_err=e, x_dense=dense / s)
            s = marginal_seconds(attend, (q, k, v, phys, slots, count, lengths), args.chain,
                                 args.repeats)
            row(f"attend_per_sm{per_sm}", s, attend_bytes)
        pag.ATTEND_PROGRAMS_PER_SM = 4
        del q, k, v, c
    write_record(args.out, ceiling_gb_s=ceiling, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
