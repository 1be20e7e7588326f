"""The sparse step's selection kernel, variants against the default in one process (H100):
the selection alone (from fixed keys) and the whole step, each in a jitted chain of calls,
the variants timed in turn over several rounds (the median of each), every variant's page
lists and step output checked equal to the default's, beside the engine's dense kernel and
the read ceiling. The inputs are bench_decode.py's (32K, budget 2048, GQA 32/8, page 16).

    PYTHONPATH=. python3 scripts/bench_select.py --batches 1 8 32 --out $OUT/select.json
"""

from __future__ import annotations

import argparse
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, list_sizes, score_keys,
                                              select_from_keys, sparse_decode_pallas)
from sparrow_jax.attention.paged_dense import paged_attention_pallas
from sparrow_jax.benchmarking import (chained, median_seconds, profile_calls, read_ceiling,
                                     write_record)

HQ, HKV, D, P = 32, 8, 128, 16
VARIANTS = {"default": {}, "ternary": dict(select_search="ternary"),
            "flat": dict(select_flat=True), "fold": dict(fold_arrivals=True),
            "all": dict(select_search="ternary", select_flat=True, fold_arrivals=True)}


def inputs(b, ctx):
    m = ctx // P
    n_total = b * m
    kk, kv, kq, kt = jax.random.split(jax.random.key(ctx * 131 + b), 4)
    k_pages = (jax.random.normal(kk, (HKV, n_total, P, D), jnp.bfloat16)
               + 2 * jax.random.normal(kt, (HKV, n_total, 1, D), jnp.bfloat16))
    v_pages = jax.random.normal(kv, (HKV, n_total, P, D), jnp.bfloat16)
    centroids = jnp.stack([jnp.mean(k_pages[i].astype(jnp.float32), axis=1)
                           for i in range(HKV)]).astype(jnp.bfloat16)
    table = jnp.asarray(np.random.default_rng(0).permutation(n_total).reshape(b, m)
                        .astype(np.int32))
    return (jax.random.normal(kq, (b, HQ, D), jnp.bfloat16), k_pages, v_pages, centroids,
            table, jnp.full((b,), ctx, jnp.int32))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--trace", action="store_true",
                    help="also each step's device time by kernel (CUDA graphs off)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.trace:          # read when the backend starts, at the first device use below
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_enable_command_buffer=").strip()
    ceiling = read_ceiling()
    print(f"{jax.devices()[0].device_kind}, read ceiling {ceiling:.0f} GB/s", flush=True)
    kb = args.budget // P
    results = []
    for b in args.batches:
        q, k_pages, v_pages, centroids, table, lengths = inputs(b, args.context)
        budgets = jnp.full((b,), kb, jnp.int32)
        m = table.shape[1]
        tunings = {v: GpuDecodeTuning(**VARIANTS[v]) for v in args.variants}
        base = tunings[args.variants[0]].resolve(page_size=P, batch=b, kv_heads=HKV,
                                                 max_pages=kb)
        mpad, kpad = list_sizes(m, kb, base)
        table_pad = jnp.pad(table, ((0, 0), (0, mpad - m)))
        keys = score_keys(q, centroids, table_pad, lengths, page_size=P, tuning=base)
        runs, lists, outs = {}, {}, {}
        for name, tuning in tunings.items():
            res = tuning.resolve(page_size=P, batch=b, kv_heads=HKV, max_pages=kb)

            def select(keys_, t_, l_, bu_, res=res):
                phys, _, count, *_ = select_from_keys(keys_, t_, l_, bu_, page_size=P,
                                                      max_pages=kb, kpad=kpad, tuning=res)
                return keys_ + (phys[:, :, :1].sum() + count.sum() == -1).astype(keys_.dtype)

            def step(q_, k_, v_, c_, t_, l_, bu_, tuning=tuning):
                return sparse_decode_pallas(q_, k_, v_, t_, l_, bu_, centroids=c_,
                                            page_size=P, max_budget_pages=kb, tuning=tuning)

            lists[name] = [np.asarray(x)[..., :kpad] for x in jax.jit(
                lambda *a, res=res: select_from_keys(*a, page_size=P, max_pages=kb, kpad=kpad,
                                                     tuning=res)[:3])(
                keys, table_pad, lengths, budgets)]
            outs[name] = np.asarray(jax.jit(step)(q, k_pages, v_pages, centroids, table,
                                                  lengths, budgets).astype(jnp.float32))
            runs[f"select_{name}"] = (chained(select, args.chain),
                                      (keys, table_pad, lengths, budgets))
            runs[f"step_{name}"] = (chained(step, args.chain),
                                    (q, k_pages, v_pages, centroids, table, lengths, budgets))
        runs["dense"] = (chained(lambda q_, k_, v_, t_, l_: paged_attention_pallas(
            q_, k_, v_, t_, l_), args.chain), (q, k_pages, v_pages, table, lengths))
        first = args.variants[0]
        same = {n: all(np.array_equal(a, g) for a, g in zip(lists[first], lists[n]))
                and np.array_equal(outs[first], outs[n]) for n in tunings}
        times = {n: [] for n in runs}
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(runs)[::-1]
            for n in order:
                run, a = runs[n]
                times[n].append(median_seconds(run, a, args.repeats) / args.chain * 1e6)
        us = {n: statistics.median(t) for n, t in times.items()}
        traces = {}
        if args.trace:
            for n in tunings:
                run, a = runs[f"step_{n}"]
                traces[n] = profile_calls(run, a, args.chain)
        sparse_bytes = b * HKV * ((m - 3) * D * 2 + kb * P * D * 2 * 2)
        row = dict(batch=b, ceiling_gbs=ceiling, same_as_first=same, us=us, rounds_us=times,
                   traces=traces,
                   x_dense={n: us["dense"] / us[f"step_{n}"] for n in tunings},
                   pct_ceiling={n: 100 * sparse_bytes / (us[f"step_{n}"] * 1e-6) / 1e9
                                / ceiling for n in tunings})
        results.append(row)
        print(f"batch {b}: dense {us['dense']:.1f} us; same as {first}: {same}", flush=True)
        for n in tunings:
            print(f"  {n:8s} select {us[f'select_{n}']:7.2f} us  step {us[f'step_{n}']:7.2f} us"
                  f"  {row['x_dense'][n]:.2f}x dense  {row['pct_ceiling'][n]:.0f}% ceiling",
                  flush=True)
            for line, t in traces.get(n, {}).items():
                print(f"    {line}: {t['total_us']:.1f} us a call: " + ", ".join(
                    f"{e['name'][:40]} {e['us']:.2f}" for e in t["top"][:6]), flush=True)
    write_record(args.out, results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
