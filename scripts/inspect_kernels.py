"""Resources and machine code of the sparse decode kernels as Triton compiles them, on a GPU
machine or on a CPU-only host.

XLA compiles the Pallas kernels' Triton IR inside its own Triton and reports nothing about
them. This script captures each kernel's IR as Pallas lowers it (for the local GPU, or, with
no GPU, for an H100 as tests/test_gpu_lowering.py does), compiles it with the installed
``triton`` package (no GPU needed: its compiler and the ptxas it bundles) and reports
registers, stack and local memory (spills) from the cubin, shared memory, the occupancy those
allow (programs per SM), and counts in the SASS that explain latency-bound kernels (barriers,
shuffles, shared-memory traffic, the TTGIR's layout conversions). It writes the TTGIR, PTX and
SASS of each kernel for reading (e.g. whether the attention loop's loads became ``cp.async``
into a multi-stage buffer, or what a scattered store costs).

    PYTHONPATH=. python3 scripts/inspect_kernels.py --out $OUT/kernels --configs b4 b4s2g3

The step's attention is the Pallas kernel in every variant (``auto``'s choice on a Hopper GPU,
the CUDA kernel, is not Triton; a variant asking for it, ``p0``, is refused).

Triton's version may differ from XLA's, so the figures are those of the same IR compiled by
a near-identical compiler, not a reading of XLA's binary.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import HKV, HQ, D, P, parse_variant  # noqa: E402
from jax._src import mesh as mesh_lib  # noqa: E402
from jax._src.pallas.triton import lowering as triton_lowering  # noqa: E402

from pallas_kernels.sparse_decode_gpu import sparse_decode_pallas  # noqa: E402

H100 = mesh_lib.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                               platform="gpu")
# SASS opcodes counted (the part before the first dot): what a latency-bound kernel waits on.
COUNTED = ("BAR", "SHFL", "REDUX", "STS", "LDS", "LDSM", "LDG", "STG", "ATOMG", "RED")


def capture_ir(fn, *args):
    """Lowers ``fn(*args)`` for the local GPU (an H100 without one) and returns
    {kernel name: (TTIR text, num_warps, num_stages)}."""
    seen = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def spy(*a, **kw):
        result = original(*a, **kw)
        seen.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    triton_lowering.lower_jaxpr_to_triton_module = spy
    try:
        if jax.default_backend() == "gpu":
            hlo = jax.jit(fn).lower(*args).as_text()
        else:
            mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H100)
            with jax.sharding.use_abstract_mesh(mesh):
                hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = original
    # Each kernel's launch settings, matched by name (the custom calls' order in the text need
    # not be the order the kernels were lowered in).
    launch = collections.defaultdict(list)
    for name, stages, warps in re.findall(
            r'name = "(\w+)".*?num_stages = (\d+) : i32, num_warps = (\d+)', hlo):
        launch[name].append((int(warps), int(stages)))
    return {name: (ir, *launch[name].pop(0)) for ir in seen
            for name in [re.search(r"tt.func public @(\w+)", ir).group(1)]}


def compile_ir(path: Path, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget

    cc = (int(jax.devices()[0].compute_capability.replace(".", ""))
          if jax.default_backend() == "gpu" else 90)
    return triton.compile(str(path), target=GPUTarget("cuda", cc, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def cuda_tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def cubin_report(cubin: Path) -> tuple[dict, str]:
    """({REG, STACK, LOCAL: per thread; SHARED: static bytes}, SASS text) of a one-kernel cubin,
    by the cuobjdump that the triton package bundles."""
    usage = subprocess.run([cuda_tool("cuobjdump"), "-res-usage", str(cubin)],
                           capture_output=True, text=True, check=True).stdout
    res = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    sass = subprocess.run([cuda_tool("cuobjdump"), "-sass", str(cubin)],
                          capture_output=True, text=True, check=True).stdout
    return res, sass


def sass_counts(sass: str) -> dict:
    """Instructions in the listing and how many of them are each of :data:`COUNTED` (static
    counts: a loop body counts once, every branch of a switch is in)."""
    ops = [re.sub(r"^\s*/\*\w+\*/\s*(@!?U?P\w+\s+)?", "", line).split()[0].split(".")[0]
           for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", line)]
    ops = [o.rstrip(";") for o in ops if o not in ("NOP",)]
    counts = collections.Counter(ops)
    return dict(instructions=len(ops), **{op: counts[op] for op in COUNTED})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", nargs="+", default=["b4"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    args = ap.parse_args(argv)
    variants = [parse_variant(spec) for spec in args.configs]
    for spec, (_, tuning) in zip(args.configs, variants):
        if tuning.attend == "cuda":
            ap.error(f"--configs {spec}: the CUDA attention is nvcc's, not a Triton kernel "
                     f"(its build keeps nvcc's output: pallas_kernels/cuda_build.py)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    b, m = args.batch, args.context // P
    n = b * m
    shapes = (jax.ShapeDtypeStruct((b, HQ, D), jnp.bfloat16),
              jax.ShapeDtypeStruct((HKV, n, P, D), jnp.bfloat16),
              jax.ShapeDtypeStruct((HKV, n, P, D), jnp.bfloat16),
              jax.ShapeDtypeStruct((HKV, n, D), jnp.bfloat16),
              jax.ShapeDtypeStruct((b, m), jnp.int32),
              jax.ShapeDtypeStruct((b,), jnp.int32),
              jax.ShapeDtypeStruct((b,), jnp.int32))
    smem_per_sm = 228 * 1024    # H100: 228 KB per SM, 227 KB per block
    report = {}
    for name, tuning in variants:
        # "auto" would take the CUDA attention on a Hopper GPU: the Triton kernels are read here.
        tuning = dataclasses.replace(tuning, attend="pallas")

        def fn(q, k, v, c, t, l, bu, tuning=tuning):
            return sparse_decode_pallas(q, k, v, t, l, bu, centroids=c, page_size=P,
                                        max_budget_pages=args.budget // P, tuning=tuning)

        for kernel, (ir, warps, stages) in capture_ir(fn, *shapes).items():
            stem = f"{name}_{kernel}"
            path = out / f"{stem}.ttir"
            path.write_text(ir)
            try:
                compiled = compile_ir(path, warps, stages)
            except Exception as e:   # a compiler mismatch is a result to report
                report[stem] = dict(error=f"{type(e).__name__}: {e}"[:1500])
                print(stem, report[stem], flush=True)
                continue
            ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
            (out / f"{stem}.ttgir").write_text(ttgir)
            (out / f"{stem}.ptx").write_text(ptx)
            cubin = out / f"{stem}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            res, sass = cubin_report(cubin)
            (out / f"{stem}.sass").write_text(sass)
            shared = int(compiled.metadata.shared)
            threads = 32 * warps
            by_smem = smem_per_sm // max(shared, 1)
            by_regs = 65536 // max(res["REG"] * threads, 1)
            by_threads = 2048 // threads
            row = dict(warps=warps, stages=stages, shared_bytes=shared, registers=res["REG"],
                       stack_bytes=res["STACK"], local_bytes=res["LOCAL"],
                       programs_per_sm=min(by_smem, by_regs, by_threads, 32),
                       limit={"smem": by_smem, "regs": by_regs, "threads": by_threads},
                       cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                       ld_global_v4=ptx.count("ld.global.v4"),
                       convert_layout=ttgir.count("ttg.convert_layout"),
                       sass=sass_counts(sass))
            report[stem] = row
            print(stem, json.dumps(row), flush=True)
    device = (jax.devices()[0].device_kind if jax.default_backend() == "gpu"
              else f"{H100.device_kind} (lowered and compiled on a CPU host)")
    (out / "report.json").write_text(json.dumps(dict(device=device, kernels=report), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
