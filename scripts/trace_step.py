"""The CUDA sparse step's timeline, block by block, at given batches, budgets and settings
(:mod:`pallas_kernels.cuda_trace`): where a call's time goes between the scoring's blocks, the
lists' choices and the attention's blocks waiting, streaming, merging and idle at the end.

The kernels are built with their trace marks (``SPARROW_CUDA_DEFINES`` gains
``SPARROW_TRACE``: a library of its own in the build cache, the default build untouched), on
the cases of ``scripts/bench_decode.py`` (every row at the full context, pages scattered),
each checked against the XLA reference first, then called ``--repeats`` times one call at a
time after ``--warmup`` calls; each call's marks are read and summarised on their own, the
medians printed, every call's summary in ``--out``.

    PYTHONPATH=. python3 scripts/trace_step.py --batches 19 32 64 --configs b4,b4x2a0s1 \\
        --out $OUT/trace.json

GPU only (a Hopper GPU and nvcc, as the CUDA attention).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_decode import P, decode_inputs, page_order, parse_variant, rel_err  # noqa: E402
from pallas_kernels import cuda_trace  # noqa: E402
from pallas_kernels.sparse_attend_cuda import unavailable  # noqa: E402
from pallas_kernels.sparse_decode_gpu import sparse_decode_pallas  # noqa: E402
from sparrow_jax.attention.sparse import sparse_decode  # noqa: E402

# What the one-line summary shows: (label, path into a call's summary, format).
LINE = (("span", ("span",), "{:.1f}"),
        ("score", ("score", "last_done"), "{:.1f}"),
        ("block", ("score", "block_us", "p50"), "{:.1f}"),
        ("choice", ("score", "choice_us", "p50"), "{:.1f}"),
        ("chosen", ("score", "chosen", "last"), "{:.1f}"),
        ("select", ("select", "last_done"), "{:.1f}"),
        ("attend@", ("attend", "first_start"), "{:.1f}"),
        ("go", ("attend", "go_us", "p50"), "{:.1f}"),
        ("wait", ("attend", "waiting"), "{:.0%}"),
        ("stream", ("attend", "streaming"), "{:.0%}"),
        ("finish", ("attend", "finishing"), "{:.0%}"),
        ("idle", ("attend", "idle"), "{:.0%}"),
        ("tail", ("attend", "tail_us"), "{:.1f}"),
        ("after-choice", ("attend", "after_last_choice_us"), "{:.1f}"))


def field(summary: dict, path: tuple):
    for key in path:
        if not isinstance(summary, dict) or summary.get(key) is None:
            return None
        summary = summary[key]
    return summary


def line(summaries: list[dict]) -> str:
    """The median over calls of each of :data:`LINE`'s figures (us, or shares of the
    attention's block time), those a call's kernels did not record left out."""
    parts = []
    for label, path, fmt in LINE:
        vals = [v for v in (field(s, path) for s in summaries) if v is not None]
        if vals:
            parts.append(f"{label} " + fmt.format(float(np.median(vals))))
    return " | ".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[19, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768])
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048],
                    help="budgets in tokens, the 3 reserved pages included")
    ap.add_argument("--configs", default="b4",
                    help="GpuDecodeTuning variants as bench_decode's --kernel-configs")
    ap.add_argument("--extra-slots", type=int, default=0,
                    help="page table slots past the rows' pages (the engine's tables: 2052 "
                         "slots at 32K, 4 past the rows')")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bin-us", type=float, default=1.0)
    ap.add_argument("--out", default=None, help="JSON file")
    args = ap.parse_args(argv)
    if args.extra_slots < 0 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit(f"trace_step: --extra-slots and --warmup must be >= 0 and --repeats "
                         f">= 1, got {args.extra_slots}, {args.warmup} and {args.repeats}")
    defines = os.environ.get("SPARROW_CUDA_DEFINES", "").split()
    if "SPARROW_TRACE" not in defines:    # before the first CUDA call builds the library
        os.environ["SPARROW_CUDA_DEFINES"] = " ".join([*defines, "SPARROW_TRACE"])
    why = unavailable()
    if why is not None:
        raise SystemExit(f"trace_step: the CUDA kernels cannot run here: {why}")
    cuda_trace.read()    # the library is the traced one, and its buffer empty
    rows = []
    for ctx in args.contexts:
        for b in args.batches:
            case = decode_inputs(b, ctx, page_order(b * ctx // P, ctx, b))
            q, k_pages, v_pages, centroids, table, lengths = case
            table = jnp.pad(table, ((0, 0), (0, args.extra_slots)))
            for budget in args.budgets:
                pages = budget // P
                budgets = jnp.full((b,), pages, jnp.int32)
                with jax.default_matmul_precision("highest"):   # float32, not TF32
                    ref = sparse_decode(q, k_pages, v_pages, table, lengths, budgets,
                                        page_size=P, centroids=centroids,
                                        max_budget_pages=pages, impl="reference")
                for spec in args.configs.split(","):
                    name, tuning = parse_variant(spec)
                    step = jax.jit(functools.partial(
                        sparse_decode_pallas, page_size=P, centroids=centroids,
                        max_budget_pages=pages, tuning=tuning))
                    out = step(q, k_pages, v_pages, table, lengths, budgets)
                    err = rel_err(out, ref)
                    for _ in range(args.warmup):
                        out = step(q, k_pages, v_pages, table, lengths, budgets)
                    out.block_until_ready()
                    cuda_trace.read()
                    calls = []
                    for _ in range(args.repeats):
                        step(q, k_pages, v_pages, table, lengths, budgets).block_until_ready()
                        calls.append(cuda_trace.summarize(cuda_trace.read(), args.bin_us))
                    for c in calls[1:]:
                        c.pop("busy", None)    # the first call's bins are enough
                    print(f"b{b} ctx{ctx}+{args.extra_slots} budget{budget} {name} "
                          f"(rel err {err:.1e}): "
                          f"{line(calls)}", flush=True)
                    rows.append(dict(batch=b, context=ctx, extra_slots=args.extra_slots,
                                     budget=budget, config=name,
                                     rel_err=err, calls=calls))
            del case, q, k_pages, v_pages, centroids, table, lengths
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
