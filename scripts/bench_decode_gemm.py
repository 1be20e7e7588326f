"""Probe: the decode step's weight matmuls (a few rows times a whole weight matrix) as the Pallas
GEMM of pallas_kernels/decode_gemm_gpu.py (split-K partial sums in float32) against XLA's own
GEMM on Qwen3-1.7B's four shapes; the gate-up pair with SiLU x up as one kernel
(pallas_kernels/decode_mlp_gpu.py); the add-norm kernel (residual add + RMSNorm over a
projection's partial sums) against XLA's ops.

Question it answered first (rollout run I): can a Pallas GEMM whose partial sums our own
kernels consume (so that the residual add, the norms, SiLU x up and the q/k preparation take
them directly instead of XLA's separate reduction fusions) read the weights as fast as XLA's
autotuned split-K GEMM? Each variant runs ``--chain`` times in one loop, each call's input the
previous call's output (the sum of the partials, sliced or tiled to the input's width), and the
device time a call is read from a profiler trace (CUDA graphs off): GEMM plus that consumer,
for both.

    PYTHONPATH=. python3 scripts/bench_decode_gemm.py --out $OUT/decode_gemm.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_gemm_gpu import add_norm_pallas, gemm_partials_pallas, padded_rows
from pallas_kernels.decode_mlp_gpu import gate_up_silu_pallas
from sparrow_jax.models.qk_prep import rms_norm
from sparrow_jax.benchmarking import chained, profile_calls, write_record

SHAPES = {"qkv": (2048, 4096), "o": (2048, 2048), "gate_up": (2048, 12288), "down": (6144, 2048)}


def _next_input(y, k):
    """The chained call's input from its output ``[M, N]``: width ``k``."""
    n = y.shape[1]
    y = y[:, :k] if n >= k else jnp.tile(y, (1, k // n))
    return (y * 1e-3).astype(jnp.bfloat16)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[19, 48])
    ap.add_argument("--shapes", nargs="+", default=[*SHAPES, "gate_up_silu", "add_norm"])
    ap.add_argument("--bn", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--bk", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--warps", type=int, nargs="+", default=[4])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--min-programs", type=int, default=128)
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--weights-mb", type=int, default=160,
                    help="distinct weight matrices of this many MB in all, used in turn")
    ap.add_argument("--interpret", action="store_true", help="CPU: check, do not time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not args.interpret:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_enable_command_buffer=").strip()
    rng = np.random.default_rng(0)
    results = []
    for name in (s for s in args.shapes if s in SHAPES):
        k, n = SHAPES[name]
        ws = _weights(args, rng, k, n, 1)
        for m in args.rows:
            x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
            ref = np.asarray(x, np.float64) @ np.asarray(ws[0][0], np.float64)
            xla = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
            variants = [("xla", xla, None)]
            for bn, bk, s, wp, st in itertools.product(args.bn, args.bk, args.splits,
                                                       args.warps, args.stages):
                if (n % bn or (k // s) % bk or (n // bn) * s < args.min_programs
                        or bk * bn * 2 * st > 160 * 1024):
                    continue
                cfg = dict(block_n=bn, block_k=bk, splits=s, num_warps=wp, num_stages=st)
                fn = functools.partial(gemm_partials_pallas, **cfg, interpret=args.interpret)
                variants.append((f"pallas bn{bn} bk{bk} s{s} w{wp} g{st}",
                                 lambda x, w, fn=fn: fn(x, w)[:, :x.shape[0]].sum(0), cfg))
            for label, fn, cfg in variants:
                if args.interpret:
                    if cfg is not None:
                        got = np.asarray(gemm_partials_pallas(x, *ws[0], **cfg, interpret=True)
                                         [:, :m].sum(0))
                        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
                        print(f"{name} m{m} {label}: max rel err {err:.2e}", flush=True)
                        assert err < 1e-2, err
                    continue

                _time(lambda x, w, fn=fn: _next_input(fn(x, w), k), x, ws, args.chain,
                      f"{name:8s} m{m:3d} {label}", results, shape=name, rows=m, config=cfg)
            if not args.interpret:
                mine = [r for r in results if r["shape"] == name and r["rows"] == m]
                base = next((r for r in mine if r["variant"] == "xla"), None)
                best = min((r for r in mine if r["variant"] != "xla"),
                           key=lambda r: r["device_us"], default=None)
                if base and best:
                    print(f"== {name} m{m}: xla {base['device_us']:.2f} us, best pallas "
                          f"{best['device_us']:.2f} ({best['variant']}); weights at 3 TB/s "
                          f"{k * n * 2 / 3e6:.2f} us", flush=True)
    if "gate_up_silu" in args.shapes:
        gate_up_cases(args, rng, results)
    if "add_norm" in args.shapes:
        add_norm_cases(args, rng, results)
    write_record(args.out, rows=args.rows, chain=args.chain, results=results)


def _weights(args, rng, k, n, per_call):
    """Sets of ``per_call`` bf16 ``[k, n]`` matrices, distinct past the L2 cache (50 MB on an
    H100) in all, used in turn: each call reads its weights from memory, as a decode step's
    layers do (one set when only checking)."""
    mb = max(1, per_call * k * n * 2 >> 20)
    sets = 1 if args.interpret else max(1, -(-args.weights_mb // mb))
    return tuple(tuple(jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), jnp.bfloat16)
                       for _ in range(per_call)) for _ in range(sets))


def _time(fn, x, ws, chain, label, results, **fields):
    """Device us a call of ``fn`` chained over the weight sets ``ws`` (a profiler trace)."""
    def step(x, ws):
        for w in ws:
            x = fn(x, *w)
        return x

    try:
        run = chained(step, chain)
        jax.block_until_ready(run(x, ws))
        lines = profile_calls(run, (x, ws), chain * len(ws), top=4)
    except Exception as e:      # a setting the device cannot run: say so, go on
        print(f"{label:50s} failed: {str(e)[:120]}", flush=True)
        return
    dev = max(lines.values(), key=lambda e: e["total_us"])
    results.append(dict(variant=label, device_us=dev["total_us"], kernels=dev["top"], **fields))
    print(f"{label:50s} {dev['total_us']:7.2f} us a call (" + ", ".join(
        f"{e['name']} {e['us']:.2f}" for e in dev["top"][:3]) + ")", flush=True)


def gate_up_cases(args, rng, results):
    """The MLP's first half: XLA's (one split-K GEMM for both projections, then SiLU x up over
    their sums) against one Pallas kernel with SiLU x up as its epilogue."""
    k, f = SHAPES["gate_up"][0], SHAPES["gate_up"][1] // 2
    ws = _weights(args, rng, k, f, 2)
    bf = jnp.bfloat16

    def xla(x, g, u):
        act = jax.nn.silu(jnp.dot(x, g).astype(bf)) * jnp.dot(x, u).astype(bf)
        return act[:, :k] * bf(1e-3)

    for m in args.rows:
        x = jnp.asarray(rng.normal(size=(m, k)), bf)
        want = np.asarray(xla(x, *ws[0]), np.float64) / 1e-3
        variants = [("xla", xla, None)]
        for bn, bk, wp, st in itertools.product([32, 64, 128], [64, 128], args.warps,
                                                args.stages):
            if 2 * bk * bn * 2 * st > 160 * 1024:
                continue
            cfg = dict(block_n=bn, block_k=bk, num_warps=wp, num_stages=st)
            fn = functools.partial(gate_up_silu_pallas, **cfg, interpret=args.interpret)
            variants.append((f"pallas bn{bn} bk{bk} w{wp} g{st}",
                             lambda x, g, u, fn=fn: fn(x, g, u)[:x.shape[0], :k] * bf(1e-3),
                             cfg))
        for label, fn, cfg in variants:
            if args.interpret:
                if cfg is not None:
                    got = np.asarray(gate_up_silu_pallas(x, *ws[0], **cfg, interpret=True)
                                     [:m, :k],
                                     np.float64)
                    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                    print(f"gate_up_silu m{m} {label}: max rel err against XLA {err:.2e}")
                    assert err < 2e-2, err
                continue
            _time(fn, x, ws, args.chain, f"gate_up_silu m{m:3d} {label}", results,
                  shape="gate_up_silu", rows=m, config=cfg)


def add_norm_cases(args, rng, results):
    """A projection's split-K partial sums (4 of Qwen3-1.7B's 2048-wide rows) summed into the
    residual, then RMSNorm, both outputs kept: XLA's ops against one Pallas kernel at several
    warp counts. The carry is (residual, normed), so neither output can be dropped."""
    n, splits = SHAPES["o"][1], 4
    weight = jnp.asarray(1 + 0.1 * rng.normal(size=(n,)), jnp.float32)
    for m in args.rows:
        parts = jnp.asarray(rng.normal(size=(splits, padded_rows(m), n)), jnp.float32)
        carry = (jnp.asarray(rng.normal(size=(m, n)), jnp.bfloat16),) * 2

        def xla(c, p, w, m=m):
            x = c[0] + p.sum(0)[:m].astype(jnp.bfloat16)
            return x, rms_norm(x, w, 1e-6)

        variants = [("xla", xla)] + [
            (f"pallas w{wp}", lambda c, p, w, wp=wp: add_norm_pallas(
                p, c[0], w, eps=1e-6, num_warps=wp, interpret=args.interpret))
            for wp in (1, 2, 4, 8)]
        want = xla(carry, parts, weight)
        for label, fn in variants:
            if args.interpret:
                got = fn(carry, parts, weight)
                for g, w in zip(got, want):
                    np.testing.assert_allclose(np.asarray(g, np.float32),
                                               np.asarray(w, np.float32), rtol=2e-2, atol=2e-2)
                print(f"add_norm m{m} {label}: matches XLA's")
                continue
            _time(fn, carry, ((parts, weight),), args.chain, f"add_norm m{m:3d} {label}",
                  results, shape="add_norm", rows=m)


if __name__ == "__main__":
    main()
