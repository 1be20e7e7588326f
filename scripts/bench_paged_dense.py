"""Dense decode attention over a paged KV cache: XLA gather vs the engine's Pallas kernel
(``paged_attention(impl="pallas")``) vs JAX's Pallas paged attention vs XLA on a contiguous cache
(one layer, bf16, GQA 32/8, head_dim 128, page 16).

Pages are scattered in the pool (a random permutation), as after real allocation.
``--width-pages W``: every row's page table W pages wide whatever its context (continuous
refill's short rows beside a long one; the contiguous baseline is left out there). Each timing
runs ``--chain`` calls inside one jitted loop whose next query is the previous output, so XLA
can neither merge nor skip them; warm-up first, then the median of ``--repeats`` runs, per call.

    PYTHONPATH=. python3 scripts/bench_paged_dense.py --out bench_paged_dense.jsonl

Needs only jax (no flax): it imports sparrow_jax.attention.paged_dense alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_decode_gpu import GpuDecodeTuning
from sparrow_jax.benchmarking import chained, contiguous_attention, median_seconds
from sparrow_jax.attention.paged_dense import (paged_attention_pallas, paged_attention_pallas_jax,
                                               paged_attention_xla)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--pallas-configs", default="8x16,16x8,4x32",
                    help="JAX's kernel: pages_per_compute_block x k_splits, comma separated")
    ap.add_argument("--width-pages", type=int, default=None,
                    help="page-table width for every row (default: the context's pages)")
    ap.add_argument("--live-rows", type=int, default=None,
                    help="only this many rows at the context, the rest at 1 token (a static "
                         "batch's tail); the contiguous baseline is left out")
    ap.add_argument("--splits", type=int, nargs="*", default=[],
                    help="the engine's kernel also with these fixed split counts")
    ap.add_argument("--balanced", action="store_true",
                    help="the engine's kernel also with its programs shared out by the rows' "
                         "pages (GpuDecodeTuning(balanced=True), the sparse step's default "
                         "from two rows)")
    ap.add_argument("--out", default=None, help="JSON lines file")
    args = ap.parse_args(argv)
    print(f"backend {jax.default_backend()}, device {jax.devices()[0].device_kind}, "
          f"jax {jax.__version__}", flush=True)
    hq, h, d, p = args.q_heads, args.kv_heads, args.head_dim, args.page_size
    configs = [tuple(int(x) for x in c.split("x")) for c in args.pallas_configs.split(",") if c]
    rows = []
    rng = np.random.default_rng(0)
    for ctx in args.contexts:
        for b in args.batches:
            m = args.width_pages or ctx // p
            if m * p < ctx:
                sys.exit(f"--width-pages {m}: narrower than context {ctx} ({ctx // p} pages)")
            n = b * m
            key = jax.random.key(ctx * 131 + b)
            kk, kv, kq = jax.random.split(key, 3)
            k_pages = jax.random.normal(kk, (h, n, p, d), jnp.bfloat16)
            v_pages = jax.random.normal(kv, (h, n, p, d), jnp.bfloat16)
            table = jnp.asarray(rng.permutation(n).reshape(b, m).astype(np.int32))
            live = min(b, args.live_rows or b)
            lengths = jnp.asarray([ctx] * live + [1] * (b - live), jnp.int32)
            q = jax.random.normal(kq, (b, hq, d), jnp.bfloat16)
            kv_bytes = 2 * int(jnp.sum(lengths)) * h * d * 2
            ref = np.asarray(paged_attention_xla(q, k_pages, v_pages, table, lengths), np.float32)

            paged_args = (q, k_pages, v_pages, table, lengths)
            cases = {"xla_paged": (paged_attention_xla, paged_args),
                     "pallas": (paged_attention_pallas, paged_args)}
            for splits in args.splits:
                cases[f"pallas_s{splits}"] = (functools.partial(
                    paged_attention_pallas, tuning=GpuDecodeTuning(splits=splits)), paged_args)
            if args.balanced:
                cases["pallas_balanced"] = (functools.partial(
                    paged_attention_pallas, tuning=GpuDecodeTuning(balanced=True)), paged_args)
            if m * p == ctx and live == b:
                # The same tokens, contiguous per row: [B, H, S, D].
                k_cont = jnp.swapaxes(jnp.take(k_pages, table, axis=1), 0, 1).reshape(
                    b, h, ctx, d)
                v_cont = jnp.swapaxes(jnp.take(v_pages, table, axis=1), 0, 1).reshape(
                    b, h, ctx, d)
                cases["xla_contiguous"] = (contiguous_attention, (q, k_cont, v_cont, lengths))
            for block, splits in configs:
                if m % (block * splits):
                    continue
                cases[f"pallas_jax_b{block}_s{splits}"] = (functools.partial(
                    paged_attention_pallas_jax, pages_per_compute_block=block, k_splits=splits),
                    paged_args)
            for name, (fn, fn_args) in cases.items():
                try:
                    err = float(np.abs(np.asarray(jax.jit(fn)(*fn_args), np.float32) - ref).max())
                    t = median_seconds(chained(fn, args.chain), fn_args, args.repeats) / args.chain
                except Exception as e:  # a kernel that fails to build is a result too
                    print(f"{name} ctx={ctx} b={b}: FAILED {type(e).__name__}: {e}", flush=True)
                    rows.append(dict(impl=name, context=ctx, batch=b, error=str(e)[:500]))
                    continue
                row = dict(impl=name, context=ctx, batch=b, ms=t * 1e3,
                           gb_per_s=kv_bytes / t / 1e9, max_abs_err_vs_xla=err)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del k_pages, v_pages, cases
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
