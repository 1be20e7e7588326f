"""Resources of the sparse decode kernels as Triton compiles them (GPU machine, device tool).

XLA compiles the Pallas kernels' Triton IR inside its own Triton and reports nothing about
them. This script captures each kernel's IR as Pallas lowers it, compiles it with the
installed ``triton`` package for the local GPU and prints shared memory, registers, spills and
the occupancy those allow (programs per SM), and writes the TTGIR and PTX for reading (e.g.
whether the attention loop's loads became ``cp.async`` into a multi-stage buffer).

    PYTHONPATH=. python3 scripts/inspect_kernels.py --out $OUT/kernels --configs b4 b4s2g3

Triton's version may differ from XLA's, so the figures are those of the same IR compiled by
a near-identical compiler, not a reading of XLA's binary.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import HKV, HQ, D, P, parse_variant  # noqa: E402
from jax._src.pallas.triton import lowering as triton_lowering  # noqa: E402

from pallas_kernels.sparse_decode_gpu import sparse_decode_pallas  # noqa: E402


def capture_ir(fn, *args):
    """Lowers ``fn(*args)`` and returns {kernel name: (TTIR text, num_warps, num_stages)}."""
    seen = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def spy(*a, **kw):
        result = original(*a, **kw)
        seen.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    triton_lowering.lower_jaxpr_to_triton_module = spy
    try:
        hlo = jax.jit(fn).lower(*args).as_text()
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = original
    # The custom calls appear in lowering order; their configs carry name, warps and stages.
    configs = re.findall(r'name = "([^"]+)".*?num_stages = (\d+) : i32, num_warps = (\d+)', hlo)
    return {name: (ir, int(warps), int(stages))
            for ir, (name, stages, warps) in zip(seen, configs)}


def compile_ir(path: Path, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget

    cc = jax.devices()[0].compute_capability.replace(".", "")
    target = GPUTarget("cuda", int(cc), 32)
    return triton.compile(str(path), target=target,
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", nargs="+", default=["b4"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    args = ap.parse_args(argv)
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
    for spec in args.configs:
        name, tuning = parse_variant(spec)

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
            (out / f"{stem}.ttgir").write_text(compiled.asm["ttgir"])
            (out / f"{stem}.ptx").write_text(compiled.asm["ptx"])
            compiled._init_handles()    # loads the binary: fills n_regs and n_spills
            md = compiled.metadata
            shared = int(md.shared)
            regs = int(compiled.n_regs)
            threads = 32 * warps
            by_smem = smem_per_sm // max(shared, 1)
            by_regs = 65536 // max(regs * threads, 1)
            by_threads = 2048 // threads
            row = dict(warps=warps, stages=stages, shared_bytes=shared, registers=regs,
                       spills=int(compiled.n_spills),
                       programs_per_sm=min(by_smem, by_regs, by_threads, 32),
                       limit={"smem": by_smem, "regs": by_regs, "threads": by_threads},
                       cp_async=compiled.asm["ptx"].count("cp.async.cg")
                       + compiled.asm["ptx"].count("cp.async.ca"),
                       ld_global_v4=compiled.asm["ptx"].count("ld.global.v4"))
            report[stem] = row
            print(stem, json.dumps(row), flush=True)
    (out / "report.json").write_text(json.dumps(dict(device=jax.devices()[0].device_kind, kernels=report),
                                                indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
