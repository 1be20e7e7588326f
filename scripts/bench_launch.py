"""What the time between kernels is, on this GPU: chains of dependent Pallas kernels that do
next to nothing, and the sparse decode step, each timed as bench_decode.py times it (a jitted
chain of calls, median of runs) and traced, so that wall time, the device's span and the gaps
between kernels stand side by side.

    PYTHONPATH=. python3 scripts/bench_launch.py --out $OUT/launch.json
    PYTHONPATH=. python3 scripts/bench_launch.py --no-graphs --out ..    # CUDA graphs off

Probe kernels add one to a float32 array ``[programs, 128]``, one program a row, so every
kernel depends on the one before; ``programs`` 1, 132 (one an SM) and 528 (the sparse
attention's one wave). The step: ``sparse_decode_pallas`` at 32K context, budget 2048
(bench_decode.py's case), each call's query the last call's output. For each: wall time a
kernel (probe) or a call (step) in a chain of ``--chain``, in an XLA while loop and unrolled;
from one traced run, the device's span (first kernel's start to last kernel's end) and busy
time a call and the gaps between consecutive kernels; for the step, also the marginal time a
call (``sparrow_jax.benchmarking.marginal_seconds``). Wall time less span, times the chain,
is what the timed program costs once.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

from bench_decode import P, decode_inputs  # noqa: E402
from pallas_kernels.sparse_decode_gpu import sparse_decode_pallas  # noqa: E402
from sparrow_jax.benchmarking import (chained, device_timeline, launch_gaps,  # noqa: E402
                                      marginal_seconds, median_seconds, write_record)

CONTEXT, BUDGET = 32768, 2048


def _add_one_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


def add_one(x: jax.Array, interpret: bool = False) -> jax.Array:
    """x ``[programs, 128]`` float32 -> x + 1, one program a row."""
    return pl.pallas_call(
        _add_one_kernel, grid=(x.shape[0],),
        in_specs=[pl.BlockSpec((1, x.shape[1]), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((1, x.shape[1]), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret,
        name="launch_probe")(x)


def traced(run, args, calls: int) -> dict:
    """:func:`launch_gaps` of the busiest device line of one traced ``run(*args)``."""
    trace_dir = tempfile.mkdtemp(prefix="bench_launch_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(run(*args))
    events = max(device_timeline(trace_dir).values(), key=len)
    return launch_gaps(events, calls)


def timed(name, fn, args, *, chain, repeats, per_call, marginal, interpret) -> list[dict]:
    """Rows for ``fn`` chained ``chain`` times, in a while loop and unrolled: wall us a kernel
    (``per_call`` kernels a call: the probe's, or 1 for the step); off CPU the trace's span
    and busy time, us a call, and its gaps; ``marginal``: the marginal us a call too."""
    rows = []
    for unroll in (False, True):
        run = chained(fn, chain, unroll=unroll)
        jax.block_until_ready(run(*args))
        row = dict(case=name, loop="unrolled" if unroll else "fori",
                   wall_us=median_seconds(run, args, repeats) / chain / per_call * 1e6)
        if not interpret:
            row.update(traced(run, args, chain))
        if unroll and marginal:
            row["marginal_us"] = marginal_seconds(fn, args, chain, repeats) * 1e6
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--programs", type=int, nargs="*", default=[1, 132, 528])
    ap.add_argument("--kernels", type=int, default=3, help="probe kernels a chained call")
    ap.add_argument("--step-batches", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-graphs", action="store_true", help="CUDA graphs off (XLA flag)")
    ap.add_argument("--interpret", action="store_true",
                    help="a CPU dry run (no trace; the step at a 256-token context)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.no_graphs:      # read when the backend starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_enable_command_buffer=").strip()
    print(f"backend {jax.default_backend()}, device {jax.devices()[0].device_kind}",
          flush=True)
    kw = dict(chain=args.chain, repeats=args.repeats, interpret=args.interpret)

    def call(x):
        for _ in range(args.kernels):
            x = add_one(x, args.interpret)
        return x

    rows = []
    for programs in args.programs:
        x = jnp.zeros((programs, 128), jnp.float32)
        expect = float(args.chain * args.kernels)
        if not bool(jnp.all(chained(call, args.chain)(x) == expect)):   # every kernel ran
            raise SystemExit(f"programs={programs}: the chain did not add {expect}")
        rows += timed(f"probe_{programs}", call, (x,), per_call=args.kernels, marginal=False,
                      **kw)
    context, budget = (256, 64) if args.interpret else (CONTEXT, BUDGET)
    for b in args.step_batches:
        order = np.random.default_rng(0).permutation(b * context // P)
        q, k, v, c, table, lengths = decode_inputs(b, context, order)
        budgets = jnp.full((b,), budget // P, jnp.int32)

        def step(q_, k_, v_, c_, t_, l_, bu_):
            return sparse_decode_pallas(q_, k_, v_, t_, l_, bu_, centroids=c_, page_size=P,
                                        max_budget_pages=budget // P, interpret=args.interpret)
        rows += timed(f"step_b{b}", step, (q, k, v, c, table, lengths, budgets), per_call=1,
                      marginal=True, **kw)
    write_record(args.out, graphs=not args.no_graphs, kernels=args.kernels, chain=args.chain,
                 context=context, budget_tokens=budget, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
