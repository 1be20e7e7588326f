"""Where a decode step's time goes: the engine's own decode chunks at a fixed context
(``sparrow_jax.rollout.profile``) traced with ``jax.profiler``, and the device's events summed
per name and divided by the steps traced, per trace line (on a GPU: XLA's ops, and the kernels
of each stream).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=. python3 scripts/profile_step.py \
        --mode sparse --rows 48 --context 128 --min-width 2048 --out $OUT/step_profile.json

With several ``--rows`` (e.g. ``--rows 19 34``) each count is profiled in turn and the busiest
line's kernels are compared between the smallest and the largest: what each further row adds
to each kernel's time a step (``sparrow_jax.benchmarking.growth_per_row``), to set beside
that kernel's bytes a row.

``--min-width``: the page table at least this many pages wide (short rows beside a long one,
as in continuous refill). The rows hold pages for their context only, so any row count fits.
The script turns CUDA graphs off (``--graphs`` keeps them, as the engine runs; the trace then
still shows each kernel): the kernels are the same, the gaps between them are not, so compare
the sums with the step time printed beside them. Printed too: the busiest trace line's span a
step against its kernels' own time, and the largest gaps between consecutive kernels by their
sum a step (``sparrow_jax.benchmarking.launch_gaps``): with graphs on, the time a step spends
with the device idle, and where.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

from sparrow_jax.benchmarking import (device_timeline, events_by_name, growth_per_row,
                                      launch_gaps, summarize_events)
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rollout.engine import RolloutConfig
from sparrow_jax.rollout.profile import fixed_context_batch, time_context
from sparrow_jax.schedule import BudgetSchedule


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-1.7b", help="a preset of configs/models")
    ap.add_argument("--mode", choices=("sparse", "dense"), default="sparse",
                    help="sparse: the paper's qwen3-1.7b schedule; dense: every layer dense")
    ap.add_argument("--rows", type=int, nargs="+", default=[48],
                    help="row counts, each profiled in turn; with two or more, what each "
                         "further row adds to each kernel's time a step (smallest to largest)")
    ap.add_argument("--context", type=int, default=128, help="the timed chunks' mean context")
    ap.add_argument("--min-width", type=int, default=0, help="page-table width at least")
    ap.add_argument("--live", type=int, default=None,
                    help="only the first LIVE rows running, the others finished (a lone row "
                         "at the end of a batch: --live 1)")
    ap.add_argument("--max-new", type=int, default=32768)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="timed chunks of 64 steps")
    ap.add_argument("--top", type=int, default=25, help="events listed per trace line")
    ap.add_argument("--dtype", default="bfloat16", help="float32 for CPU smoke tests")
    ap.add_argument("--graphs", action="store_true", help="keep CUDA graphs on")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not args.graphs:     # read when the backend starts, at the first device use below
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_enable_command_buffer=").strip()
    if args.context < args.prompt_len + 1 or args.context > args.prompt_len + args.max_new:
        raise SystemExit(f"--context {args.context}: between --prompt-len + 1 "
                         f"({args.prompt_len + 1}) and --prompt-len + --max-new "
                         f"({args.prompt_len + args.max_new})")
    if args.live is not None and not 1 <= args.live <= min(args.rows):
        raise SystemExit(f"--live {args.live}: between 1 and the smallest --rows "
                         f"({min(args.rows)})")
    if len(set(args.rows)) != len(args.rows):
        raise SystemExit(f"--rows {args.rows}: each count once")

    cfg = ModelConfig.preset(args.model)
    dtype = jnp.dtype(args.dtype)
    model = init_model(cfg, dtype=dtype, param_dtype=dtype)
    runs = [profile_rows(model, rows, args) for rows in sorted(args.rows)]
    for r in runs:
        r["argv"] = sys.argv[1:] if argv is None else argv
    out = runs[0] if len(runs) == 1 else dict(runs=runs)
    if len(runs) > 1:
        small, large = runs[0], runs[-1]
        growth = growth_per_row(small.pop("busiest_us"), large.pop("busiest_us"),
                                small["rows"], large["rows"])
        for r in runs[1:-1]:
            r.pop("busiest_us")
        out["growth"] = growth
        step = (large["step_us"] - small["step_us"]) / (large["rows"] - small["rows"])
        print(f"\nthe busiest line, {small['rows']} -> {large['rows']} rows: what each further "
              f"row adds to a step, by kernel (the step: {step:.1f} us a row)")
        print(f"| us a row | us a step at {small['rows']} | at {large['rows']} | name |\n"
              "| --- | --- | --- | --- |")
        for r in growth[:args.top]:
            print(f"| {r['per_row']:.2f} | {r['us_small']:.1f} | {r['us_large']:.1f} | "
                  f"{r['name'][:100]} |")
    else:
        out.pop("busiest_us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def profile_rows(model, rows: int, args) -> dict:
    """The engine's decode chunks at ``rows`` rows traced and summarised (printed as it goes);
    ``busiest_us``: the busiest trace line's us a step per event name."""
    steps = 64
    dtype = jnp.dtype(args.dtype)
    rc = RolloutConfig(n=1, max_new_tokens=args.max_new, temperature=1.0, eos_ids=(),
                       table_bucket_pages=256, steps_per_call=steps, cache_dtype=dtype.name)
    schedule = BudgetSchedule.paper("qwen3-1.7b") if args.mode == "sparse" else None
    span = steps * (args.repeats + 3)
    max_context = min(args.prompt_len + args.max_new, args.context + span)
    batch, graphdef, params, state = fixed_context_batch(
        model, rc, rows=rows, prompt_len=args.prompt_len, key=jax.random.key(0),
        schedule=schedule, max_context=max_context)
    timing = dict(repeats=args.repeats, min_width=args.min_width or None, live=args.live)
    state, warm = time_context(batch, graphdef, params, state, args.context, **timing)
    trace_dir = tempfile.mkdtemp(prefix="profile_step_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        state, timed = time_context(batch, graphdef, params, state, args.context, **timing)
    del state   # the next row count's cache needs the memory
    # The trace holds time_context's untimed first chunk too.
    traced_steps = steps * (args.repeats + 1)
    step_us = 1e6 * min(timed.step_seconds)
    timeline = device_timeline(trace_dir)
    by_name = events_by_name(timeline)
    lines = summarize_events(by_name, traced_steps, args.top)
    # The busiest line's span against its kernels' own time: idle time between kernels.
    busiest = max(timeline, key=lambda line: len(timeline[line]))
    gaps = launch_gaps(timeline[busiest], traced_steps)
    dev = jax.devices()[0]
    out = dict(device=dev.device_kind,
               backend=jax.default_backend(), jax=jax.__version__, model=args.model,
               mode=args.mode, rows=rows, live=args.live, context=timed.mean_context,
               table_width=timed.table_width, graphs=args.graphs, step_us=step_us,
               step_us_warm_up=1e6 * min(warm.step_seconds), traced_steps=traced_steps,
               lines=lines, span_us=gaps["span_us"], busy_us=gaps["busy_us"],
               gap_sum_us=gaps["gap_sum_us"],
               busiest_us={n: sum(d) / traced_steps for n, d in by_name[busiest].items()})
    running = f" ({args.live} running)" if args.live is not None else ""
    print(f"{dev.device_kind}: {args.model} {args.mode}, {rows} rows{running} at context "
          f"{timed.mean_context:.0f}, table {timed.table_width} pages, CUDA graphs "
          f"{'on' if args.graphs else 'off'}: {step_us:.0f} us a step; the busiest trace "
          f"line spans {gaps['span_us']:.0f} us a step, its kernels {gaps['busy_us']:.0f}")
    largest = sorted(gaps["gap_sum_us"].items(), key=lambda kv: -kv[1])[:args.top // 3]
    print("largest gaps between kernels, us a step: "
          + "; ".join(f"{k[:90]} {v:.1f}" for k, v in largest))
    for line, entry in sorted(lines.items(), key=lambda kv: -kv[1]["total_us"]):
        print(f"\n{line}: {entry['total_us']:.0f} us a step")
        print("| us a step | launches a step | name |\n| --- | --- | --- |")
        for r in entry["top"]:
            print(f"| {r['us']:.1f} | {r['per_step']:.2f} | {r['name'][:100]} |")
    return out


if __name__ == "__main__":
    main()
