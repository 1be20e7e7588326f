"""Probe (session 47): the CUDA attention's warps a block and shared-memory stages a warp.

Kernel run AR's trace put the CUDA attention at batch 8 (32K, budget 2048: 64 lists of 128
pages, one block each) at ~26 us of device time, 2.6 TB/s: each warp streams 16 pages with
one page in flight while it computes the one before, so an SM holds 8 pages (64 KB) in
flight and a warp's page costs about one loaded round trip. This builds the library's
``sparse_attend_cuda.cu`` with other ``WARPS`` / ``STAGES`` (more pages in flight a warp,
or the same bytes over fewer warps), each as an FFI target of its own, and times the
attention alone over the selection's lists at each batch, every variant in one process:
device time from a trace (CUDA graphs off: ``--trace``) or what a call adds to a chain
(``marginal_seconds``). Each variant's output is checked against the library kernel's.

    python3 notes/bench_runs/2026-11-29h_cuda_stages_probe.py --batches 8 32 1 --trace
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import tempfile
from pathlib import Path

if "--trace" in sys.argv:   # read when the backend starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_enable_command_buffer=").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_decode import HKV, P, decode_inputs  # noqa: E402

from pallas_kernels import sparse_attend_cuda as sac  # noqa: E402
from pallas_kernels.cuda_build import build_library, find_nvcc  # noqa: E402
from pallas_kernels.paged_attend_gpu import sm_count  # noqa: E402
from pallas_kernels.sparse_decode_gpu import GpuDecodeTuning, select_page_lists  # noqa: E402
from sparrow_jax.benchmarking import chained, marginal_seconds, profile_calls  # noqa: E402


SPREAD = ("    for (int v = blockIdx.x; v < even_blocks; v += blocks) {\n",
          "    const int stride = max(1, blocks / even_blocks);\n"
          "    for (int v = blockIdx.x % stride ? even_blocks : blockIdx.x / stride;\n"
          "         v < even_blocks; v += blocks / stride) {\n")


def variant_target(warps: int, stages: int, source: Path = sac.SOURCE, name: str = "",
                   spread: bool = False) -> str:
    """``source`` (the library's by default) with WARPS and STAGES replaced, built and
    registered; ``spread``: even splits' parts, when fewer than the blocks, taken by every
    (blocks / parts)-th block instead of the first ones."""
    src = source.read_text()
    if spread:
        assert src.count(SPREAD[0]) == 1, "the even loop moved"
        src = src.replace(*SPREAD)
    line = "constexpr int WARPS = 8, STAGES = 2;"
    assert line in src, "the source's constants moved"
    src = src.replace(line, f"constexpr int WARPS = {warps}, STAGES = {stages};")
    name = name or f"w{warps}s{stages}"
    tmp = Path(tempfile.gettempdir()) / f"sparse_attend_{name}.cu"
    tmp.write_text(src)
    built = build_library(tmp, find_nvcc())
    lib = ctypes.CDLL(str(built))
    log = re.findall(r"Used \d+ registers|\d+ bytes spill stores",
                     built.with_suffix(".log").read_text())
    target = f"sparrow_attend_{name}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.SparrowSparseAttend),
                                platform="CUDA")
    print(f"{name}: built, ptxas {log}", flush=True)
    return target


def attend(target, warps, q, k, v, phys, slots, count, lengths, splits=None, balance=-1,
           programs=None):
    """``attend_page_lists_cuda`` through ``target`` (its splits default for ``warps``)."""
    b, hq, d = q.shape
    hkv = k.shape[0]
    lists, width = b * hkv, phys.shape[-1]
    programs = programs or sm_count()
    if splits is None:
        splits = max(1, min((programs // 2) // lists, width // warps))
    parts = max(programs + lists, lists * splits)
    arrivals = jnp.zeros((b, hkv, 1), jnp.int32)
    call = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct(arrivals.shape, jnp.int32),
         jax.ShapeDtypeStruct((parts, hq // hkv, d), jnp.float32),
         jax.ShapeDtypeStruct((parts, hq // hkv), jnp.float32)),
        input_output_aliases={7: 1})
    out, *_ = call(q, k, v, phys, slots, count, lengths, arrivals, splits=np.int64(splits),
                   programs=np.int64(programs), balance=np.int64(balance))
    return out


def selected_lists(b: int, context: int, budget: int):
    """bench_decode's case at batch ``b`` -> (q, (K, V pages, phys, slots, count, lengths):
    the selection's lists), and the library attention's output over them."""
    m = context // P
    q, kp, vp, cent, table, lengths = decode_inputs(
        b, context, np.random.default_rng(0).permutation(b * m))
    kb = budget // P
    tuning = GpuDecodeTuning().resolve(page_size=P, batch=b, kv_heads=HKV, max_pages=kb)
    phys, slots, count = select_page_lists(q, cent, table, lengths, jnp.full((b,), kb, jnp.int32),
                                           page_size=P, max_pages=kb, tuning=tuning)
    data = (kp, vp, phys, slots, count, lengths)
    return q, data, jax.jit(lambda q_, *a: sac.attend_page_lists_cuda(q_, *a))(q, *data)


def write_rows(path, rows) -> None:
    if path:
        Path(path).write_text(json.dumps(dict(device=jax.devices()[0].device_kind,
                                              argv=sys.argv[1:], rows=rows), indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 1])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--variants", default="w8s2,w8s3,w4s4,w4s6,w4s3,w8s2x2,w8s3x2",
                    help="wWsS[xN]: WARPS, STAGES, N times the default splits; 'lib': the "
                         "library's call as it is; 'base': --base-source's kernel (8 warps, "
                         "2 stages, the device's choice of layout); 'n64': the library's "
                         "kernel on 64 blocks; 'spread': --base-source's kernel (one from before "
                         "b93b44e, whose even parts took the first blocks) with them spread")
    ap.add_argument("--base-source", type=Path, default=None,
                    help="another revision's sparse_attend_cuda.cu, for 'base'")
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    specs, targets = [], {}
    for v in args.variants.split(","):
        if v in ("lib", "base", "n64", "spread"):
            specs.append((v, 8, 2, 1))
            if v == "base" and v not in targets:
                targets[v] = variant_target(8, 2, args.base_source, "base")
            if v == "spread" and v not in targets:
                targets[v] = variant_target(8, 2, args.base_source, "spread", spread=True)
            if v == "n64" and v not in targets:
                targets[v] = variant_target(8, 2, name="n64")
            continue
        w, s, x = re.fullmatch(r"w(\d+)s(\d+)(?:x(\d+))?", v).groups()
        specs.append((v, int(w), int(s), int(x or 1)))
        targets[(int(w), int(s))] = variant_target(int(w), int(s))
    rows = []
    for b in args.batches:
        q, data, ref = selected_lists(b, args.context, args.budget)
        kb = args.budget // P
        nbytes = b * HKV * kb * P * 128 * 2 * 2
        for name, w, s, x in specs:
            base = max(1, min((sm_count() // 2) // (b * HKV), kb // w))

            if name == "lib":
                fn = sac.attend_page_lists_cuda
            else:
                def fn(q_, *a, _t=targets.get(name) or targets[(w, s)], _w=w, _sp=base * x,
                       _n=64 if name == "n64" else None):
                    return attend(_t, _w, q_, *a, splits=_sp, programs=_n)
            out = jax.jit(fn)(q, *data)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            row = dict(batch=b, variant=name, warps=w, stages=s, splits=base * x, max_abs_diff=err,
                       bytes=nbytes)
            if args.trace:
                run = chained(fn, args.chain)
                jax.block_until_ready(run(q, *data))
                lines = profile_calls(run, (q, *data), args.chain)
                busiest = max(lines.values(), key=lambda e: e["total_us"])
                row["device_us"] = {e["name"][:40]: round(e["us"], 2) for e in busiest["top"]}
                row["attend_us"] = sum(us for n, us in row["device_us"].items()
                                       if "attend_kernel" in n)
            else:
                row["us"] = 1e6 * marginal_seconds(fn, (q, *data), args.chain, args.repeats)
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
