"""Timing helpers shared by the benchmark scripts (``scripts/bench_*.py``).

XLA merges repeated identical calls inside one jit, so a timed loop chains them: each call takes
the previous call's output as its input (:func:`chained`). Times are medians of wall-clock runs
after a compile and a warm-up run (:func:`median_seconds`); what one call adds to a long chain,
without what the timed program costs once, comes from two chain lengths
(:func:`marginal_seconds`). Where the time goes, by kernel: a ``jax.profiler`` trace summed per
event name (:func:`device_events`, :func:`summarize_events`, :func:`profile_calls`).
"""

from __future__ import annotations

import collections
import datetime
import functools
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp


def chained(fn, chain: int, unroll: bool = False):
    """A jitted ``run(x, *args)`` applying ``x = fn(x, *args)`` ``chain`` times in a loop.

    ``unroll``: the ``chain`` calls written out in one program instead of an XLA while loop,
    whose own per-iteration cost on a GPU is in every call it times (the counter's update and,
    where the carry is not aliased, its copy: 1.5 us a call in bench_decode's trace on an H100,
    4.2 us in bench_prep_append's)."""
    @jax.jit
    def run(x, *args):
        return jax.lax.fori_loop(0, chain, lambda _, y: fn(y, *args), x, unroll=unroll)
    return run


def slope_seconds(time_chain, chain: int, factor: int = 4, tries: int = 3) -> float:
    """Seconds one call adds to a chain of calls: ``(time_chain(factor * chain) -
    time_chain(chain)) / ((factor - 1) * chain)``, where ``time_chain(n)`` is the wall time of
    a program of ``n`` chained calls. That time is n calls plus what the program costs once
    (its dispatch, its CUDA graph's launch, the wait for its end: ~0.3 ms on an H100, 15 us a
    call in a chain of 20); the difference leaves the once-a-program part out, as a long loop
    of calls amortises it.

    Where the calls are short beside that cost's noise, the difference can come out zero or
    negative (a 256-token step in chains of 1 and 4, on an H100 shared by eight test
    processes); then both are timed again, the longer chain ``factor`` times longer, up to
    ``tries`` lengths, and past them ValueError (a case too small to time so, which ``sparrow
    bench`` reports in one line), never a time that is not one."""
    if factor < 2:
        raise ValueError(f"factor={factor}: the longer chain must be at least twice the shorter")
    longer = chain
    for _ in range(tries):
        longer *= factor
        extra = time_chain(longer) - time_chain(chain)
        if extra > 0:
            return extra / (longer - chain)
    raise ValueError(f"chains of {chain} to {longer} calls took no longer than one of {chain}: "
                     "the calls are too short to time against the program's own cost (time a "
                     "larger case, or longer chains)")


def marginal_seconds(fn, args, chain: int, repeats: int, factor: int = 4,
                     runs: dict | None = None) -> float:
    """:func:`slope_seconds` of ``fn``'s calls chained as :func:`chained` chains them, unrolled
    (an XLA while loop would add its own per-iteration cost), each chain's time the median of
    ``repeats`` runs. ``runs``: unrolled chains of ``fn`` by length that the caller built (and
    may have timed), reused, not changed: each length is compiled once, also where the slope
    times a chain again."""
    runs = dict(runs or {})

    def time_chain(n):
        if n not in runs:
            runs[n] = chained(fn, n, unroll=True)
        return median_seconds(runs[n], args, repeats)
    return slope_seconds(time_chain, chain, factor)


def write_record(path: str | None, **fields) -> dict:
    """The raw JSON of a benchmark run: the device, jax's version, the date and the command
    line, then ``fields``; written to ``path`` when given. Returns the record."""
    record = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "argv": sys.argv[1:], **fields}
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
    return record


def median_seconds(run, args, repeats: int) -> float:
    """Median wall time of ``run(*args)`` over ``repeats`` runs, after compile and warm-up."""
    jax.block_until_ready(run(*args))
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def chained_read(reduce, s: jax.Array, x: jax.Array) -> jax.Array:
    """One call of the marginal read ceiling's chain: ``reduce(x + s)`` scaled down, a scalar
    that the next call adds to x, so that XLA neither merges the calls nor skips reading x."""
    return reduce(x + s) * 1e-9


def read_ceiling(repeats: int = 10, small: bool = False, marginal: bool = False) -> float:
    """GB/s of the faster of a sum and a max over a 4 GiB float32 array (4 MiB if ``small``,
    for CPU smoke runs): the device's read bandwidth as XLA reaches it. ``marginal``: timed as
    :func:`marginal_seconds` times a call (each a reduction of ``x + s``, s the last result
    scaled down, so that the calls chain while XLA still reads x once a call), for rates set
    beside kernel times taken that way."""
    x = jax.random.normal(jax.random.key(0), (1 << (20 if small else 30),), jnp.float32)
    best = 0.0
    for reduce in (jnp.sum, jnp.max):
        if marginal:
            seconds = marginal_seconds(functools.partial(chained_read, reduce),
                                       (jnp.float32(0), x), 4, repeats)
        else:
            seconds = median_seconds(jax.jit(reduce), (x,), repeats)
        best = max(best, x.nbytes / seconds / 1e9)
    del x
    return best


def free_bytes(device=None) -> int | None:
    """Bytes free on ``device`` (default the first) by its allocator: its limit less what is in
    use; None where the backend does not say (CPU)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def peak_bytes() -> int | None:
    """The first device's peak memory in use (None where the backend does not say)."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    return None if not stats else stats.get("peak_bytes_in_use")


def contiguous_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                         lengths: jax.Array) -> jax.Array:
    """The dense baseline on a contiguous cache: q ``[B, Hq, D]``, k/v ``[B, H, S, D]``,
    lengths ``[B]`` -> ``[B, Hq, D]`` (XLA einsums, float32 softmax)."""
    b, hq, d = q.shape
    h = k.shape[1]
    qg = q.reshape(b, h, hq // h, d)
    s = jnp.einsum("bhrd,bhsd->bhrs", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
    valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
    s = jnp.where(valid[:, None, None, :], s, -1e30)
    w = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhrs,bhsd->bhrd", w.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, hq, d).astype(q.dtype)


def device_timeline(trace_dir: str) -> dict[str, list[tuple[float, float, str]]]:
    """The perfetto trace under ``trace_dir`` -> {trace line: [(start, duration, event name)]
    in order of start, us} for the device's lines (all lines where the trace has no device,
    as on CPU)."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"{trace_dir}: no perfetto_trace.json.gz (did the trace run?)")
    with gzip.open(paths[0]) as f:
        events = json.load(f)["traceEvents"]
    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[e["pid"], e["tid"]] = e["args"]["name"]
    devices = {pid for pid, name in process.items() if name.startswith("/device:")}
    lines: dict[str, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or (devices and e["pid"] not in devices):
            continue
        line = f"{process.get(e['pid'], e['pid'])} {thread.get((e['pid'], e.get('tid')), '')}"
        lines[line.strip()].append((float(e["ts"]), float(e.get("dur", 0.0)), e["name"]))
    return {line: sorted(evs) for line, evs in lines.items()}


def events_by_name(timeline) -> dict[str, dict[str, list[float]]]:
    """A :func:`device_timeline` -> {trace line: {event name: [durations, us]}}."""
    lines = {}
    for line, evs in timeline.items():
        names = lines[line] = collections.defaultdict(list)
        for _, dur, name in evs:
            names[name].append(dur)
    return lines


def device_events(trace_dir: str) -> dict[str, dict[str, list[float]]]:
    """:func:`device_timeline` by event name (:func:`events_by_name`)."""
    return events_by_name(device_timeline(trace_dir))


def launch_gaps(events: list[tuple[float, float, str]], calls: int) -> dict:
    """One line of :func:`device_timeline` -> its span (first start to last end) and busy
    time (durations summed), in us per call, and the gap between each event's end and the
    next one's start, per pair of names: {"a -> b": (median, min, max) us}, and their sum a
    call, {"a -> b": us}. A gap below zero is an overlap in the trace's clock."""
    gaps = collections.defaultdict(list)
    for (t0, d0, a), (t1, _, b) in zip(events, events[1:]):
        gaps[f"{a} -> {b}"].append(t1 - (t0 + d0))
    span = events[-1][0] + events[-1][1] - events[0][0] if events else 0.0
    return dict(span_us=span / calls, busy_us=sum(d for _, d, _ in events) / calls,
                gaps_us={k: (statistics.median(g), min(g), max(g)) for k, g in gaps.items()},
                gap_sum_us={k: sum(g) / calls for k, g in gaps.items()})


def summarize_events(lines, calls: int, top: int) -> dict:
    """Per trace line: its total and its ``top`` events by time, in us per call (``calls``:
    the steps or calls the trace holds)."""
    out = {}
    for line, names in lines.items():
        rows = sorted(((sum(d) / calls, len(d) / calls, name) for name, d in names.items()),
                      reverse=True)
        out[line] = dict(total_us=sum(r[0] for r in rows),
                         top=[dict(name=n, us=us, per_step=c) for us, c, n in rows[:top]])
    return out


def growth_per_row(small: dict[str, float], large: dict[str, float], rows_small: int,
                   rows_large: int) -> list[dict]:
    """One trace line's us a step per event name at two row counts -> each name's us a step at
    both and what each row beyond ``rows_small`` adds (``per_row``), largest first. A name
    missing at one count counts 0 there. What a kernel adds a row, against its bytes a row,
    shows which kernel scales worse than its reads; a fixed cost adds nothing a row."""
    if rows_large <= rows_small:
        raise ValueError(f"rows {rows_small} and {rows_large}: the second must be larger")
    rows = [dict(name=n, us_small=small.get(n, 0.0), us_large=large.get(n, 0.0),
                 per_row=(large.get(n, 0.0) - small.get(n, 0.0)) / (rows_large - rows_small))
            for n in small.keys() | large.keys()]
    return sorted(rows, key=lambda r: (-r["per_row"], r["name"]))


def profile_calls(run, args, calls: int, top: int = 12) -> dict:
    """One ``run(*args)`` (compiled and warm: call it before) traced with ``jax.profiler``,
    summed per device event and divided by ``calls``, the calls of the traced function it
    chains (:func:`summarize_events`). With CUDA graphs on, a graph may show as one event."""
    trace_dir = tempfile.mkdtemp(prefix="profile_calls_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(run(*args))
    return summarize_events(device_events(trace_dir), calls, top)
