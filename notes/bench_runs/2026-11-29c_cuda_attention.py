"""Probe (session 42): the sparse step's attention as a CUDA C kernel whose warps each stream
their pages through shared-memory stages by cp.async (2026-11-29c_cuda_attention.cu), against
the Pallas attention, in one process on one GPU. Run AI (2026-11-29b_page_read_ceiling.py)
found the Pallas attention's loads alone reading 74-89% of the ceiling at batch 32 where the
attention reads 59-66%: its per-block work is not overlapped with its loads. This asks whether
a kernel that overlaps them by construction reads at the loads' rate.

Data as in that probe (32K context, GQA 32/8, head_dim 128, page 16, bf16, ``--budget`` pages
a (row, KV head) list drawn from the row's pages, sorted; lengths 5 tokens short of the last
page so the mask is exercised). Checked: the CUDA output against float64 NumPy on four lists
and against the Pallas attention on all. Timed as what a call adds to a chain: the Pallas
kernels by ``marginal_seconds``, the CUDA kernels by CUDA graphs of n and 4n launches.
Needs nvcc and CuPy (both on the device image).

    python3 notes/bench_runs/2026-11-29c_cuda_attention.py --batches 32 8 1 --out x.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

import cupy as cp  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.paged_attend_gpu import attend_page_lists  # noqa: E402
from pallas_kernels.sparse_decode_gpu import GpuDecodeTuning  # noqa: E402
from sparrow_jax.benchmarking import marginal_seconds, read_ceiling  # noqa: E402

P, D, HKV, HQ = 16, 128, 8, 32
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "2026-11-29c_cuda_attention.cu")
KERNELS = {"attend_w4_s2": (4, 2), "attend_w4_s3": (4, 3), "attend_w4_s4": (4, 4),
           "attend_w8_s2": (8, 2), "attend_w8_s3": (8, 3), "attend_w2_s4": (2, 4),
           "loads_w4_s3": (4, 3), "loads_w4_s4": (4, 4), "loads_w8_s3": (8, 3)}


def build():
    cubin = os.path.join(tempfile.mkdtemp(), "attention.cubin")
    subprocess.run(["nvcc", "-cubin", "-gencode", "arch=compute_90,code=sm_90", "-O3",
                    "-o", cubin, SOURCE], check=True)
    return cp.RawModule(path=cubin)


def as_cupy(x):
    """A JAX array as a CuPy view of the same memory (bf16 as uint16: CuPy has no bf16)."""
    if x.dtype == jnp.bfloat16:
        x = jax.lax.bitcast_convert_type(x, jnp.uint16)
    return cp.from_dlpack(x)


def graph_seconds(launch, n, repeats, stream):
    """Median seconds of a CUDA graph of ``n`` launches."""
    stream.begin_capture()
    for _ in range(n):
        launch()
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    times = []
    for _ in range(repeats):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        graph.launch(stream)
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return float(np.median(times))


def run_batch(mod, b, m, count, args, ceiling):
    rng = np.random.default_rng(0)
    n_total = b * m
    table = rng.permutation(n_total).reshape(b, m).astype(np.int32)
    chosen = np.sort(np.stack([np.stack([rng.choice(m, count, replace=False)
                                         for _ in range(HKV)]) for _ in range(b)]), -1)
    lists = jnp.asarray(np.take_along_axis(table[:, None, :], chosen, axis=-1), jnp.int32)
    slots = jnp.asarray(chosen, jnp.int32)
    kk, kv, kq = jax.random.split(jax.random.key(1), 3)
    k_pages = jax.random.normal(kk, (HKV, n_total, P, D), jnp.bfloat16)
    v_pages = jax.random.normal(kv, (HKV, n_total, P, D), jnp.bfloat16)
    q = jax.random.normal(kq, (b, HQ, D), jnp.bfloat16)
    cnt = jnp.full((b, HKV, 1), count, jnp.int32)
    lengths = jnp.full((b,), m * P - 5, jnp.int32)
    nbytes = 2 * b * HKV * count * P * D * 2
    jax.block_until_ready((k_pages, v_pages, q, lists))

    tuning = GpuDecodeTuning().resolve(page_size=P, batch=b, kv_heads=HKV, max_pages=count)
    even = GpuDecodeTuning(balanced=False).resolve(page_size=P, batch=b, kv_heads=HKV,
                                                   max_pages=count)
    pallas = {name: (lambda x, *a, t=t: attend_page_lists(x, *a, page_size=P, tuning=t))
              for name, t in (("pallas_balanced", tuning), ("pallas_even", even))}
    pargs = (q, k_pages, v_pages, lists, slots, cnt, lengths)
    want_pallas = np.asarray(jax.jit(pallas["pallas_balanced"])(*pargs).astype(jnp.float32))

    # float64 reference on four lists.
    ref = {}
    for bi, hi in ((0, 0), (b - 1, HKV - 1), (b // 2, 3), (0, HKV - 1)):
        kk64 = np.asarray(k_pages[hi, lists[bi, hi]].astype(jnp.float32), np.float64)
        vv64 = np.asarray(v_pages[hi, lists[bi, hi]].astype(jnp.float32), np.float64)
        pos = (np.asarray(slots[bi, hi])[:, None] * P + np.arange(P)).reshape(-1)
        kk64, vv64 = kk64.reshape(-1, D), vv64.reshape(-1, D)
        qq = np.asarray(q[bi, hi * 4:(hi + 1) * 4].astype(jnp.float32), np.float64)
        s = qq @ kk64.T * D ** -0.5
        s[:, pos >= int(lengths[bi])] = -np.inf
        w = np.exp(s - s.max(-1, keepdims=True))
        ref[bi, hi] = (w / w.sum(-1, keepdims=True)) @ vv64
    err_pallas = max(np.abs(want_pallas[bi, hi * 4:(hi + 1) * 4] - r).max()
                     for (bi, hi), r in ref.items())

    stream = cp.cuda.Stream(non_blocking=True)
    c_q, c_k, c_v, c_lists, c_slots, c_len = (as_cupy(x) for x in
                                              (q, k_pages, v_pages, lists, slots, lengths))
    c_cnt = as_cupy(cnt.reshape(b, HKV))
    rows = []

    def record(name, t, **extra):
        row = dict(case=name, batch=b, pages_a_list=count, us=t * 1e6,
                   gb_per_s=nbytes / t / 1e9, frac_ceiling=nbytes / t / 1e9 / ceiling, **extra)
        rows.append(row)
        print(f"b{b:<3d} {name:26s} {t * 1e6:8.1f} us  {row['gb_per_s']:6.0f} GB/s  "
              f"{row['frac_ceiling']:5.1%}  {extra or ''}", flush=True)

    for name, fn in pallas.items():
        record(name, marginal_seconds(fn, pargs, args.chain, args.repeats),
               max_err_f64=float(err_pallas) if name == "pallas_balanced" else None)

    for name, (w, stages) in KERNELS.items():
        fn = mod.get_function(name)
        smem = w * stages * 2 * P * D * 2
        fn.max_dynamic_shared_size_bytes = smem
        for splits in args.splits:
            per = -(-count // splits)
            if per < w or per > 256:
                continue
            out = cp.zeros((b, HQ, D), cp.uint16)
            part_o = cp.zeros((b * HKV * splits, 4, D), cp.float32)
            part_lse = cp.zeros((b * HKV * splits, 4), cp.float32)
            arrivals = cp.zeros((b * HKV,), cp.int32)
            kargs = (c_q, c_k, c_v, c_lists, c_slots, c_cnt, c_len, out, part_o, part_lse,
                     arrivals, np.int32(HKV), np.int32(n_total), np.int32(count),
                     np.int32(splits), np.float32(D ** -0.5 * np.log2(np.e)))

            def launch(fn=fn, kargs=kargs, splits=splits, w=w, smem=smem):
                fn((b * HKV * splits,), (w * 32,), kargs, shared_mem=smem, stream=stream)
            launch()
            stream.synchronize()
            extra = dict(splits=splits)
            if name.startswith("attend"):
                got = cp.asnumpy(out).view(jnp.bfloat16).astype(np.float32)
                extra["max_err_f64"] = float(max(
                    np.abs(got[bi, hi * 4:(hi + 1) * 4] - r).max() for (bi, hi), r in ref.items()))
                extra["max_diff_pallas"] = float(np.abs(got - want_pallas).max())
                if extra["max_err_f64"] > 2e-2:
                    print(f"b{b} {name} splits {splits}: WRONG {extra}", flush=True)
            n = args.chain
            t1 = graph_seconds(launch, n, args.repeats, stream)
            t4 = graph_seconds(launch, 4 * n, args.repeats, stream)
            record(f"{name}_s{splits}", (t4 - t1) / (3 * n), **extra)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 8, 1])
    ap.add_argument("--pages", type=int, default=2048, help="pages a row (32K context)")
    ap.add_argument("--budget", type=int, default=128, help="pages a list")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()
    mod = build()
    ceiling = read_ceiling(marginal=True)
    print(f"{jax.devices()[0].device_kind}: ceiling {ceiling:.0f} GB/s", flush=True)
    rows = []
    for b in args.batches:
        rows += run_batch(mod, b, args.pages, args.budget, args, ceiling)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, ceiling_gb_s=ceiling,
                           args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
