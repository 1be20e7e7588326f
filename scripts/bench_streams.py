"""Probe: the sparse decode step's kernels overlapped across CUDA streams (issue 18).

XLA runs a jitted program's kernels one after another on one stream, so the selection's ~9 us of
latency and each launch's ramp and tail stand between the kernels (kernel notes, "Our own
launcher"). Two ways to let kernels run side by side, both compared here in one process:
``jax.experimental.compute_on.compute_on("gpu_stream:N")`` puts a called computation on stream
N (XLA's explicit stream annotation), and ``--xla_gpu_graph_enable_concurrent_region=true``
(set in ``XLA_FLAGS``) lets XLA's CUDA graphs run independent kernels concurrently. The batch is
cut into G row groups:

* ``base``: the default step on all rows;
* ``splitG``: G row groups' steps, no dependence between them (what cutting alone costs, or,
  with concurrent regions, the groups side by side);
* ``streamsG``: group g's whole step on stream g + 1;
* ``pipeG``: every group's scoring and selection on stream 1, its attention on the main stream
  (suffix ``s``: group g + 1's lists and group g's attention in one XLA scheduling group);
* ``chainG``: group g + 1's scoring starts after group g's (an operand it never reads), so that
  with concurrent regions group g's selection runs beside group g + 1's scoring and its
  attention beside group g + 1's selection: the selection's latency behind other rows' reads.

A suffix ``pN`` sizes each group's balanced attention to N programs (default: one wave for the
whole GPU), leaving SM room for the other groups' kernels. Each output is checked against
``base`` before timing; timing as in bench_decode: a jitted loop of ``--chain`` chained calls,
median of ``--repeats``, per call. ``--timeline`` traces one loop per variant (device events
by stream; the overlap across streams).

    XLA_FLAGS=--xla_gpu_graph_enable_concurrent_region=true PYTHONPATH=. \
      python3 scripts/bench_streams.py --batches 32 8 --variants base,chain2,chain2p264 \
      --timeline $OUT/tl.json --out $OUT/streams.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import gzip
import json
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on
from jax.experimental.xla_metadata import set_xla_metadata

from pallas_kernels.paged_attend_gpu import attend_page_lists_balanced
from pallas_kernels.sparse_decode_gpu import (GpuDecodeTuning, list_sizes, score_keys,
                                              select_from_keys, select_page_lists,
                                              sparse_decode_pallas_checked)
from sparrow_jax.benchmarking import chained, median_seconds, read_ceiling, write_record

HQ, HKV, D, P = 32, 8, 128, 16


def on_stream(n, fn):
    """``fn`` as a call XLA runs on stream ``n`` (0: the main stream, as is)."""
    if n == 0:
        return fn
    return compute_on(compute_type=f"gpu_stream:{n}",
                      out_memory_spaces=jax.memory.Space.Device)(fn)


def _tag_stream_calls():
    """Make the call that ``compute_on`` lowers to carry the ambient XLA metadata
    (``set_xla_metadata``), as every other op does: jax 0.11.2 gives it only to the call's
    memory-placement wrappers, and XLA's scheduler reads ``_scheduling_group_id`` from the call."""
    from jax._src import compute_on as con
    from jax._src.interpreters import mlir
    rule = con._compute_on_lowering

    def lowering(ctx, *args, **params):
        outs = rule(ctx, *args, **params)
        meta = ctx.jaxpr_eqn_ctx.xla_metadata if ctx.jaxpr_eqn_ctx else None
        for o in (outs if meta else []):
            op = o.owner
            while op.name != "func.call":
                op = op.operands[0].owner
            mlir._update_frontend_attributes(op, {k: mlir.ir.StringAttr.get(str(v))
                                                  for k, v in meta.items()})
        return outs
    mlir.register_lowering(con.compute_on_p, lowering)


_tag_stream_calls()


def step(q, k, v, c, t, l, bu, *, kb, programs=None, interpret=False):
    """One group's whole step: scoring, selection, balanced attention."""
    tuning = GpuDecodeTuning().resolve(page_size=P, batch=q.shape[0], kv_heads=HKV,
                                       max_pages=kb)
    phys, slots, count = lists(q, c, t, l, bu, kb=kb, interpret=interpret)
    return attend_page_lists_balanced(q, k, v, phys, slots, count, l, page_size=P,
                                      tuning=tuning, programs=programs, interpret=interpret)


def tuning(batch, kb=None):
    return GpuDecodeTuning().resolve(page_size=P, batch=batch, kv_heads=HKV, max_pages=kb or 1)


def score_after(prev, q, c, t, l, interpret=False):
    """``score_keys`` (default tuning) with ``prev`` as an operand the kernel never reads: it
    starts only once ``prev`` is written (an optimization barrier does not hold XLA to that)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    from pallas_kernels.sparse_decode_gpu import _score_kernel
    b, hq, d = q.shape
    n_total = c.shape[1]
    chunk = GpuDecodeTuning().score_chunk
    kernel = functools.partial(_score_kernel, page_size=P, chunk=chunk, group=hq // HKV)
    return pl.pallas_call(
        lambda q_ref, c_ref, t_ref, l_ref, _, key_ref: kernel(q_ref, c_ref, t_ref, l_ref,
                                                              key_ref),
        grid=(b, HKV, t.shape[1] // chunk),
        in_specs=[pl.BlockSpec((None, hq, d), lambda bi, hi, ci: (bi, 0, 0)),
                  pl.BlockSpec((None, n_total, d), lambda bi, hi, ci: (hi, 0, 0)),
                  pl.BlockSpec((None, chunk), lambda bi, hi, ci: (bi, ci)),
                  pl.BlockSpec((1,), lambda bi, hi, ci: (bi,)),
                  pl.BlockSpec((None, None, chunk), lambda bi, hi, ci: (0, 0, 0))],
        out_specs=pl.BlockSpec((None, None, chunk), lambda bi, hi, ci: (bi, hi, ci)),
        out_shape=jax.ShapeDtypeStruct((b, HKV, t.shape[1]), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="sparse_decode_score_after",
    )(q, c, t, l, prev)


def lists(q, c, t, l, bu, *, kb, interpret=False):
    return select_page_lists(q, c, t, l, bu, page_size=P, max_pages=kb, interpret=interpret)


def attend(q, k, v, phys, slots, count, l, *, kb, programs=None, interpret=False):
    tuning = GpuDecodeTuning().resolve(page_size=P, batch=q.shape[0], kv_heads=HKV,
                                       max_pages=kb)
    return attend_page_lists_balanced(q, k, v, phys, slots, count, l, page_size=P,
                                      tuning=tuning, programs=programs, interpret=interpret)


def variant_fn(spec, kb, interpret):
    """(groups, fn(qs, k, v, c, groups_args) -> qs) for a variant name."""
    m = re.fullmatch(r"(base|split|streams|pipe|chain)(\d*)(?:p(\d+))?(s?)", spec)
    if not m:
        raise SystemExit(f"--variants: {spec!r} is not base, splitG, streamsG or pipeG[pN]")
    kind, g, programs = m.group(1), int(m.group(2) or 1), m.group(3)
    programs = int(programs) if programs else None
    sched = bool(m.group(4))
    kw = dict(kb=kb, interpret=interpret)

    def run(qs, k, v, c, rows):
        if kind in ("base", "split"):
            return tuple(step(q, k, v, c, *r, programs=programs, **kw) for q, r in zip(qs, rows))
        if kind == "chain":
            # Group i + 1's scoring waits for group i's (a barrier, no kernel), so that with
            # concurrent command-buffer regions group i's selection runs beside group i + 1's
            # scoring, and its attention beside group i + 1's selection.
            made, prev = [], None
            for q, (t, l, bu) in zip(qs, rows):
                mpad, kpad = list_sizes(t.shape[1], kb, tuning(q.shape[0]))
                prev = (score_keys(q, c, t, l, page_size=P, interpret=interpret)
                        if prev is None else score_after(prev, q, c, t, l, interpret))
                made.append((q, select_from_keys(prev, t, l, bu, page_size=P, max_pages=kb,
                                                 kpad=kpad, interpret=interpret)))
            return tuple(attend(q, k, v, *li, r[1], programs=programs, **kw)
                         for (q, li), r in zip(made, rows))
        if kind == "streams":
            return tuple(on_stream(i + 1, functools.partial(step, programs=programs, **kw))(
                q, k, v, c, *r) for i, (q, r) in enumerate(zip(qs, rows)))
        # Group i + 1's lists and group i's attention share a scheduling group when ``sched``:
        # XLA's latency-hiding scheduler then places the attention between the lists' async
        # start and done (without it, the done follows the start at once).
        tag = lambda i: (set_xla_metadata(_scheduling_group_id=str(i)) if sched
                         else contextlib.nullcontext())
        made = []
        for i, (q, r) in enumerate(zip(qs, rows)):
            with tag(i):
                made.append(on_stream(1, functools.partial(lists, **kw))(q, c, *r))
        outs = []
        for i, (q, r) in enumerate(zip(qs, rows)):
            with tag(i + 1):
                outs.append(attend(q, k, v, *made[i], r[1], programs=programs, **kw))
        return tuple(outs)
    return (1 if kind == "base" else g), run


def timeline(loop, a):
    """One traced ``loop(*a)``: (its device events as (start, duration in us from the first
    event, line, name), the us during which events of two lines overlap: 0 when the streams
    never ran side by side)."""
    jax.block_until_ready(loop(*a))             # compiled and warm before the trace
    trace_dir = tempfile.mkdtemp(prefix="streams_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(loop(*a))
    with gzip.open(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)[0]) as f:
        events = json.load(f)["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev = ([e for e in events if e.get("ph") == "X"
            and procs.get(e["pid"], "").startswith("/device:")]
           or [e for e in events if e.get("ph") == "X"])      # CPU: no device lines
    t0 = min(float(e["ts"]) for e in dev)
    rows = sorted((float(e["ts"]) - t0, float(e.get("dur", 0)),
                   names.get((e["pid"], e.get("tid")), str(e.get("tid"))), e["name"]) for e in dev)
    overlap = 0.0
    for i, (t, d, line, _) in enumerate(rows):
        for t2, d2, line2, _ in rows[i + 1:]:
            if t2 >= t + d:
                break
            if line2 != line:
                overlap += min(t + d, t2 + d2) - t2
    return rows, overlap


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048, help="tokens")
    ap.add_argument("--variants", default="base,split2,streams2,pipe2,pipe4")
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--passes", type=int, default=2, help="times the variant list is timed")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeline", default=None,
                    help="JSON file: each variant's traced device events (one chained loop)")
    ap.add_argument("--unroll", action="store_true",
                    help="the chained calls written out, not in a while loop")
    ap.add_argument("--dump", default=None, help="folder for each variant's compiled HLO")
    args = ap.parse_args(argv)
    ceiling = read_ceiling(small=args.interpret)
    print(f"device {jax.devices()[0].device_kind}, read ceiling {ceiling:.0f} GB/s", flush=True)
    ctx, kb = args.context, args.budget // P
    m = ctx // P
    rows_out, timelines = [], {}
    for b in args.batches:
        n_total = b * m
        kk, kv, kq, kt = jax.random.split(jax.random.key(ctx * 131 + b), 4)
        k = jax.random.normal(kk, (HKV, n_total, P, D), jnp.bfloat16)
        k = k + 2 * jax.random.normal(kt, (HKV, n_total, 1, D), jnp.bfloat16)
        v = jax.random.normal(kv, (HKV, n_total, P, D), jnp.bfloat16)
        c = jnp.stack([jnp.mean(k[i].astype(jnp.float32), axis=1)
                       for i in range(HKV)]).astype(jnp.bfloat16)
        table = jnp.asarray(np.random.default_rng(0).permutation(n_total).reshape(b, m)
                            .astype(np.int32))
        lengths = jnp.full((b,), ctx, jnp.int32)
        budgets = jnp.full((b,), kb, jnp.int32)
        q = jax.random.normal(kq, (b, HQ, D), jnp.bfloat16)
        nbytes = b * HKV * ((m - 3) * D * 2 + kb * P * D * 2 * 2)
        want = np.asarray(jax.jit(functools.partial(
            sparse_decode_pallas_checked, page_size=P, max_budget_pages=kb,
            interpret=args.interpret))(q, k, v, c, table, lengths, budgets), np.float32)
        fns = {}
        for spec in args.variants.split(","):
            g, run = variant_fn(spec, kb, args.interpret)
            if b % g:
                continue
            cut = lambda x: tuple(x[i * (b // g):(i + 1) * (b // g)] for i in range(g))
            qs = cut(q)
            rows = tuple(zip(cut(table), cut(lengths), cut(budgets)))
            compiled = jax.jit(run).lower(qs, k, v, c, rows).compile()
            hlo = compiled.as_text()
            print(f"b={b} {spec}: compiled HLO has {hlo.count('call-start')} async calls, "
                  f"{len(re.findall(r'_xla_stream_annotation', hlo))} stream annotations",
                  flush=True)
            got = np.concatenate([np.asarray(o, np.float32) for o in
                                  compiled(qs, k, v, c, rows)])
            err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            print(f"b={b} {spec}: rel err vs base {err:.2e}", flush=True)
            if err > 1e-2:
                raise SystemExit(f"b={b} {spec}: output differs from base ({err:.2e})")
            fns[spec] = (chained(run, args.chain, unroll=args.unroll), (qs, k, v, c, rows))
            if args.dump:           # the timed loop's program, as scheduled
                with open(f"{args.dump}/b{b}_{spec}.hlo.txt", "w") as f:
                    f.write(fns[spec][0].lower(*fns[spec][1]).compile().as_text())
        for spec, (loop, a) in fns.items():
            if args.timeline:
                events, ov = timeline(loop, a)
                timelines[f"b{b}_{spec}"] = events
                print(f"b={b} {spec}: {len(events)} device events, {ov:.1f} us of overlap "
                      f"across lines in {args.chain} calls", flush=True)
        for p in range(args.passes):
            for spec, (loop, a) in fns.items():
                t = median_seconds(loop, a, args.repeats) / args.chain
                row = dict(batch=b, variant=spec, ms=t * 1e3, pass_=p,
                           pct_ceiling=100 * nbytes / t / 1e9 / ceiling)
                rows_out.append(row)
                print(f"b={b} pass {p} {spec:12s} {t * 1e6:7.1f} us  "
                      f"{row['pct_ceiling']:5.1f}% of ceiling", flush=True)
    write_record(args.out, ceiling_gbs=ceiling, context=ctx, budget=args.budget, rows=rows_out)
    if args.timeline:
        with open(args.timeline, "w") as f:
            json.dump(timelines, f)


if __name__ == "__main__":
    main()
