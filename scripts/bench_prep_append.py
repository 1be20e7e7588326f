"""The decode step's per-layer work between the QKV projection and attention, alone: q/k-norm,
RoPE and the token's cache write as XLA fusions beside the one-kernel write
(``QKPrep`` + ``append_token(impl="pallas")``), against the fused kernel
(``prep_append_token_pallas``) at several warps a program. Qwen3-1.7B's layer by default (16
query heads, 8 KV heads, head_dim 128, bf16), one layer's cache of ``--pages`` pages.

Each timing runs ``--chain`` calls in one jitted loop; each call's projections are the previous
call's (its q output written back over the q heads), so XLA can neither merge nor hoist them;
warm-up, then the median of ``--repeats`` runs, per call. The loop's own cost per iteration (on
a GPU, its condition goes back to the host) is of the order of the work timed, so the kernels'
device time a call, from a ``jax.profiler`` trace of one run (CUDA graphs off), is printed
beside it: that is the figure to compare.

    PYTHONPATH=. python3 scripts/bench_prep_append.py --out $OUT/prep_append.json
"""

from __future__ import annotations

import argparse
import os

import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_append_gpu import append_token_pallas, prep_append_token_pallas
from sparrow_jax.benchmarking import chained, median_seconds, profile_calls, write_record
from sparrow_jax.models.qk_prep import QKPrep
from sparrow_jax.models.rope import rope_angles


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 19, 32, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")      # read at the first device use
                               + " --xla_gpu_enable_command_buffer=").strip()
    hq, h, d, p, eps = args.q_heads, args.kv_heads, args.head_dim, 16, 1e-6
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batches:
        qkv = jnp.asarray(rng.normal(size=(b, hq + 2 * h, d)), jnp.bfloat16)
        qw, kw = (jnp.asarray(rng.uniform(0.5, 1.5, d), jnp.float32) for _ in range(2))
        cos, sin = rope_angles(jnp.asarray(rng.integers(0, 32768, b), jnp.int32)[:, None], d,
                               1e6)
        page = jnp.asarray(rng.permutation(args.pages)[:b], jnp.int32)
        slot = jnp.asarray(rng.integers(0, p, b), jnp.int32)
        cache = (jnp.zeros((1, b, h, d), jnp.float32),
                 *(jnp.zeros((h, args.pages, p, d), jnp.bfloat16) for _ in range(2)),
                 jnp.zeros((h, args.pages, d), jnp.bfloat16))

        def xla(x):
            qkv, cache = x
            prep = QKPrep(qw, kw, cos, sin, eps=eps)        # cos, sin [B, 1, D]
            q, k = prep(qkv[:, None, :hq], qkv[:, None, hq:hq + h])
            cache = append_token_pallas(page, slot, k[:, 0], qkv[:, hq + h:], *cache, layer=0,
                                        page_size=p)
            return jnp.concatenate([q[:, 0], qkv[:, hq:]], axis=1), tuple(cache)

        def fused(x, warps):
            qkv, cache = x
            q, *cache = prep_append_token_pallas(page, slot, qkv, qw, kw, cos[:, 0], sin[:, 0],
                                                 *cache, layer=0, page_size=p, eps=eps,
                                                 num_warps=warps)
            return jnp.concatenate([q, qkv[:, hq:]], axis=1), tuple(cache)

        variants = [("xla prep + write kernel", xla)] + [
            (f"fused, {w} warps", lambda x, w=w: fused(x, w)) for w in args.warps]
        for name, fn in variants:
            run = chained(fn, args.chain)
            us = 1e6 * median_seconds(run, ((qkv, cache),), args.repeats) / args.chain
            lines = profile_calls(run, ((qkv, cache),), args.chain, top=8)
            device = max(lines.values(), key=lambda e: e["total_us"])
            rows.append(dict(batch=b, variant=name, us=us, device_us=device["total_us"],
                             kernels=device["top"]))
            print(f"batch {b:3d}  {name:26s} {device['total_us']:6.2f} us of kernels a call "
                  f"({us:6.2f} us wall): " + ", ".join(
                      f"{k['name']} {k['us']:.2f}" for k in device["top"]), flush=True)
    write_record(args.out, q_heads=hq, kv_heads=h, head_dim=d, pages=args.pages,
                 chain=args.chain, rows=rows)


if __name__ == "__main__":
    main()
