"""Probe (session 47): where the CUDA attention's fixed time goes.

Kernel run AR's device times fit the attention as ~7 us a call beside its streaming (batch 1,
64 blocks of 16 pages: 9.9 us; batch 8, 64 blocks of 128 pages: 27.1 us), whatever the
stages in flight. This builds the library's ``sparse_attend_cuda.cu`` with timestamps
(``%globaltimer``, ns, and ``clock64``) written by each block's thread 0 at the kernel's phases,
plus a second FFI handler that copies them out, and prints each phase's time since the
earliest block's start (median and max over the blocks that did work):

0 entry, 1 the lists' ends scanned (``list_ends``; the first part's entries staged
beside it since session 47), 2 a list's entries staged, 3 warp 0's
first page landed, 4 warp 0's pages done, 5 the warps merged (a list of one part written), 6
the part's arrival counted (and, for the last block, the parts merged), 7 exit, 8 the
layout chosen, 9 a part's entries worked out (even splits).
(2-6: the block's last list.) Each row also has the trace's device time of the same call.

    python3 notes/bench_runs/2026-11-29h_cuda_phases_probe.py --batches 8 1 32
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_gpu_enable_command_buffer=").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from pallas_kernels import sparse_attend_cuda as sac  # noqa: E402
from pallas_kernels.cuda_build import build_library, find_nvcc  # noqa: E402
from pallas_kernels.paged_attend_gpu import sm_count  # noqa: E402
from sparrow_jax.benchmarking import chained, profile_calls  # noqa: E402

# The stages probe beside this file: its cases and its record.
_spec = importlib.util.spec_from_file_location(
    "stages_probe", Path(__file__).with_name("2026-11-29h_cuda_stages_probe.py"))
stages_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stages_probe)

MAX_BLOCKS, PHASES = 1024, 10

PRELUDE = f"""
__device__ unsigned long long g_ph[{MAX_BLOCKS} * {PHASES} * 2];
__device__ __forceinline__ void rec(int k) {{
  if (threadIdx.x == 0 && blockIdx.x < {MAX_BLOCKS}) {{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    g_ph[(blockIdx.x * {PHASES} + k) * 2] = t;
    g_ph[(blockIdx.x * {PHASES} + k) * 2 + 1] = clock64();
  }}
}}
"""

READER = """
ffi::Error Phases(cudaStream_t stream, ffi::AnyBuffer, ffi::Result<ffi::Buffer<ffi::U64>> out) {
  return Check(cudaMemcpyFromSymbolAsync(out->typed_data(), g_ph, sizeof(g_ph), 0,
                                         cudaMemcpyDeviceToDevice, stream), "phases");
}
"""

EDITS = [   # (anchor, replacement): each anchor must occur once
    ("constexpr int LIST_UNITS = 8;\n", "constexpr int LIST_UNITS = 8;\n" + PRELUDE),
    ("    cp_wait<STAGES - 2>();\n    __syncwarp();   // every lane's copies of page i landed, "
     "and page i - 1's slot is read\n",
     "    cp_wait<STAGES - 2>();\n    __syncwarp();\n    if (i == 0) rec(3);\n"),
    ("  const int guess_each = (list_len + splits - 1) / splits;\n",
     "  rec(0);\n  const int guess_each = (list_len + splits - 1) / splits;\n"),
    ("  // Entries [from, to) of list i into `a`, `cap` staged",
     "  rec(1);\n  // Entries [from, to) of list i into `a`, `cap` staged"),
    ("  Acc a;\n  if (balance == 0 || (balance < 0 && even_faster())) {\n",
     "  Acc a;\n  const bool chose_even = balance == 0 || (balance < 0 && even_faster());\n"
     "  rec(8);\n  if (chose_even) {\n"),
    ("      const int from = min(split * each, count), to = min(from + each, count);\n",
     "      const int from = min(split * each, count), to = min(from + each, count);\n"
     "      rec(9);\n"),
    ("        stage(lists, slots, i, list_len, s, n, s_phys, s_slot);\n        __syncthreads();\n"
     "      }\n",
     "        stage(lists, slots, i, list_len, s, n, s_phys, s_slot);\n        __syncthreads();\n"
     "      }\n      rec(2);\n"),
    ("                     scale_log2, warp, lane, a);\n",
     "                     scale_log2, warp, lane, a);\n      rec(4);\n"),
    ("out_row[idx] = __float2bfloat16(val); });\n      return;\n",
     "out_row[idx] = __float2bfloat16(val); });\n      rec(5);\n      return;\n"),
    ("    arrive(&arrivals[i], n, part_o, part_lse, first, group, out_row, &s_last,\n"
     "           reinterpret_cast<float*>(smem));\n",
     "    rec(5);\n    arrive(&arrivals[i], n, part_o, part_lse, first, group, out_row, &s_last,\n"
     "           reinterpret_cast<float*>(smem));\n    rec(6);\n"),
    ("      finish(i, a, v, static_cast<int64_t>(i) * splits, splits);\n    }\n    return;\n",
     "      finish(i, a, v, static_cast<int64_t>(i) * splits, splits);\n    }\n    rec(7);\n"
     "    return;\n"),
    ("           p_last - p_first + 1);\n  }\n}\n",
     "           p_last - p_first + 1);\n  }\n  rec(7);\n}\n"),
    ("}  // namespace\n", READER + "}  // namespace\n"),
]
TAIL = """
XLA_FFI_DEFINE_HANDLER_SYMBOL(SparrowPhases, Phases,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::U64>>());
"""


def build() -> None:
    src = sac.SOURCE.read_text()
    for anchor, new in EDITS:
        assert src.count(anchor) == 1, anchor
        src = src.replace(anchor, new)
    path = Path(tempfile.gettempdir()) / "sparse_attend_phases.cu"
    path.write_text(src + TAIL)
    lib = ctypes.CDLL(str(build_library(path, find_nvcc())))
    for sym, target in (("SparrowSparseAttend", "sparrow_attend_phases"),
                        ("SparrowPhases", "sparrow_read_phases")):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, sym)),
                                    platform="CUDA")


def attend(q, k, v, phys, slots, count, lengths, balance):
    b, hq, d = q.shape
    hkv = k.shape[0]
    lists, programs = b * hkv, sm_count()
    splits = max(1, min((programs // 2) // lists, phys.shape[-1] // sac.WARPS))
    parts = max(programs + lists, lists * splits)
    arrivals = jnp.zeros((b, hkv, 1), jnp.int32)
    out, *_ = jax.ffi.ffi_call(
        "sparrow_attend_phases",
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(arrivals.shape, jnp.int32),
         jax.ShapeDtypeStruct((parts, hq // hkv, d), jnp.float32),
         jax.ShapeDtypeStruct((parts, hq // hkv), jnp.float32)),
        input_output_aliases={7: 1})(
            q, k, v, phys, slots, count, lengths, arrivals, splits=np.int64(splits),
            programs=np.int64(programs), balance=np.int64(balance))
    return out


def read_phases(dep):
    return jax.ffi.ffi_call("sparrow_read_phases", jax.ShapeDtypeStruct(
        (MAX_BLOCKS, PHASES, 2), jnp.uint64))(dep)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 1, 32])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--balance", type=int, nargs="+", default=[-1])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    jax.config.update("jax_enable_x64", False)
    build()
    rows = []
    for b in args.batches:
        q, data, ref = stages_probe.selected_lists(b, args.context, args.budget)
        for balance in args.balance:
            def fn(q_, *a, _bal=balance):
                return attend(q_, *a, _bal)
            step = jax.jit(lambda q_, *a, _f=fn: (lambda o: (o, read_phases(o)))(_f(q_, *a)))
            for _ in range(5):   # warm; the last call's stamps are read
                out, ph = step(q, *data)
            ph = np.asarray(ph).astype(np.int64)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            worked = ph[:, 7, 0] > 0
            worked &= ph[:, 4, 0] >= ph[:, 0, 0]     # a block that streamed pages this call
            t0 = ph[worked, 0, 0].min()
            phases = {}
            for k in range(PHASES):
                t = ph[worked, k, 0]
                t = t[t >= t0]
                if t.size:
                    phases[k] = dict(median_us=float(np.median(t - t0)) / 1e3,
                                     max_us=float((t - t0).max()) / 1e3, blocks=int(t.size))
            cycles = {k: float(np.median(ph[worked, k, 1] - ph[worked, 0, 1]))
                      for k in range(1, PHASES)}
            run = chained(fn, 20)
            jax.block_until_ready(run(q, *data))
            lines = profile_calls(run, (q, *data), 20)
            busiest = max(lines.values(), key=lambda e: e["total_us"])
            dev = sum(e["us"] for e in busiest["top"] if "attend_kernel" in e["name"])
            row = dict(batch=b, balance=balance, blocks_worked=int(worked.sum()),
                       max_abs_diff=err, device_us=dev, phases=phases,
                       cycles_since_entry=cycles)
            print(json.dumps(row), flush=True)
            rows.append(row)
    stages_probe.write_rows(args.out, rows)


if __name__ == "__main__":
    main()
