"""The CUDA sparse step's timeline, block by block (a diagnostics build; GPU only).

Built with ``SPARROW_CUDA_DEFINES=SPARROW_TRACE`` in the environment before the first CUDA
call (a library of its own in the build cache), ``sparse_attend_cuda.cu``'s kernels record,
from thread 0 of each block, marks of what the block is doing (:data:`EVENTS`), each with the
GPU's global clock (ns), the SM's cycle counter, the SM and the block: :func:`read` copies
out what was recorded since the last read, :func:`summarize` turns one call's marks into
where its time went (the scoring's blocks, when each list was chosen, the attention's
blocks waiting, streaming, merging and idle at the end). Without the macro the marks are
empty: the default build is the kernels measured. ``scripts/trace_step.py`` drives it.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

# In the order of the kernel's TraceEvent.
EVENTS = ("score_start", "score_done", "list_chosen", "select_start", "select_done",
          "attend_start", "attend_go", "part_ready", "part_streamed", "part_done", "attend_end")
RECORD = np.dtype([("ns", "<u8"), ("cycles", "<u8"), ("sm", "<i4"), ("block", "<i4"),
                   ("event", "<i4"), ("list", "<i4")])
CAPACITY = 1 << 20    # the kernel's TRACE_CAPACITY
_E = {name: i for i, name in enumerate(EVENTS)}


@functools.cache
def _reader():
    """The library's ``SparrowTraceRead``, typed: the library the kernels' first call built
    and registered (its key, the build's flags among it, is fixed from then on)."""
    from pallas_kernels.cuda_build import build_library, find_nvcc
    from pallas_kernels.sparse_attend_cuda import SOURCE
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("cuda_trace.read: no nvcc found (set NVCC or CUDA_HOME)")
    lib = ctypes.CDLL(str(build_library(SOURCE, nvcc)))
    fn = getattr(lib, "SparrowTraceRead", None)
    if fn is None:
        raise RuntimeError("cuda_trace.read: the CUDA kernels were built without the trace; "
                           "set SPARROW_CUDA_DEFINES=SPARROW_TRACE before the first CUDA call")
    fn.restype, fn.argtypes = ctypes.c_longlong, [ctypes.c_void_p, ctypes.c_longlong]
    return fn


def read(capacity: int = CAPACITY) -> np.ndarray:
    """The marks recorded since the last read (the device synchronised first), as records of
    :data:`RECORD`, and the device's buffer emptied. Raises one line where the library was
    built without the macro or the buffer overflowed."""
    fn = _reader()
    out = np.zeros(capacity, RECORD)
    n = fn(out.ctypes.data, capacity)
    if n < 0:
        raise RuntimeError("cuda_trace.read: a CUDA error while copying the trace")
    if n > min(capacity, CAPACITY):
        raise RuntimeError(f"cuda_trace.read: {n} marks recorded, {min(capacity, CAPACITY)} "
                           f"kept; read after fewer calls")
    return out[:n]


def _pct(x, q) -> float | None:
    return float(np.percentile(x, q)) if len(x) else None


def _by_block(rec: np.ndarray, names) -> dict[int, np.ndarray]:
    """The records of these events, block by block, each block's in time order."""
    sel = rec[np.isin(rec["event"], [_E[n] for n in names])]
    sel = sel[np.argsort(sel["ns"], kind="stable")]
    return {int(b): sel[sel["block"] == b] for b in np.unique(sel["block"])}


def summarize(rec: np.ndarray, bin_us: float = 1.0) -> dict:
    """One call's marks -> where its time went, in us from its first mark (``span``):
    ``score`` (its blocks' first start, last end, each block's time; ``choice``: the last
    block of a list's own choosing time, ``chosen``: when the first, median and last list
    were ready), ``select`` (the selection kernel's blocks, where it ran), and ``attend``:
    its blocks' first start, ``go`` (each block's wait before its first list), the summed
    block time ``waiting`` (for a list to be ready, after the block's previous one),
    ``streaming`` (its pages), ``finishing`` (its warps' and parts' merge) and ``idle`` (after
    the block's last part until the attention's last block ends), as shares of blocks x the
    attention's span; ``tail_us``: its last end less the time 90% of blocks had ended, and
    ``after_last_choice_us``: its end less the last list's choice. ``busy``: blocks scoring
    and blocks streaming in each ``bin_us`` bin, the ramp and the tail at a glance."""
    if len(rec) == 0:
        return {}
    t0 = int(rec["ns"].min())
    # In integers first: the clock counts from the epoch, past float64's exact range.
    us = lambda ns: (np.asarray(ns, np.uint64).astype(np.int64) - t0) / 1e3
    out = dict(span=float(us(rec["ns"].max())), marks=int(len(rec)))
    ev = rec["event"]
    chosen = us(np.sort(rec["ns"][ev == _E["list_chosen"]]))
    score = _by_block(rec, ("score_start", "score_done", "list_chosen"))
    if score:
        starts = us([r["ns"][0] for r in score.values()])
        dones = [r for r in score.values() if len(r) >= 2]
        took = np.array([(int(r["ns"][1]) - int(r["ns"][0])) / 1e3 for r in dones])
        choice = np.array([(int(r["ns"][2]) - int(r["ns"][1])) / 1e3 for r in dones
                           if len(r) == 3])
        out["score"] = dict(
            blocks=len(score), first_start=float(starts.min()), last_start=float(starts.max()),
            last_done=float(us([r["ns"][1] for r in dones]).max()) if dones else None,
            block_us=dict(p50=_pct(took, 50), p90=_pct(took, 90), max=_pct(took, 100)),
            choice_us=dict(p50=_pct(choice, 50), max=_pct(choice, 100)),
            chosen=dict(first=_pct(chosen, 0), p50=_pct(chosen, 50), last=_pct(chosen, 100),
                        lists=int(len(chosen))))
    select = _by_block(rec, ("select_start", "select_done"))
    if select:
        took = np.array([(int(r["ns"][-1]) - int(r["ns"][0])) / 1e3 for r in select.values()])
        out["select"] = dict(blocks=len(select),
                             first_start=float(us([r["ns"][0] for r in select.values()]).min()),
                             last_done=float(us([r["ns"][-1] for r in select.values()]).max()),
                             block_us=dict(p50=_pct(took, 50), max=_pct(took, 100)))
    attend = _by_block(rec, ("attend_start", "attend_go", "part_ready", "part_streamed",
                             "part_done", "attend_end"))
    if attend:
        out["attend"] = _attend_shares(attend, us, chosen)
    out["busy"] = _busy(score, attend, us, out["span"], bin_us)
    return out


def _attend_shares(attend: dict, us, chosen: np.ndarray) -> dict:
    """Each block's time from the attention's first start to its last end, split: before
    its start and after its last part ``idle``, up to each list ready ``waiting`` (its own
    choice included where the block chooses), then ``streaming`` and ``finishing``."""
    start = float(min(us(r["ns"][0]) for r in attend.values()))
    last = float(max(us(r["ns"][-1]) for r in attend.values()))
    spent = dict(waiting=0.0, streaming=0.0, finishing=0.0, idle=0.0)
    go, ends, parts = [], [], 0
    for r in attend.values():
        t, e = us(r["ns"]), r["event"]
        spent["idle"] += t[0] - start
        prev = t[0]
        for j in range(1, len(r)):
            if e[j] in (_E["attend_go"], _E["part_ready"]):
                spent["waiting"] += t[j] - prev
                if e[j] == _E["attend_go"]:
                    go.append(t[j] - t[0])
            elif e[j] == _E["part_streamed"]:
                spent["streaming"] += t[j] - prev
                parts += 1
            elif e[j] == _E["part_done"]:
                spent["finishing"] += t[j] - prev
            else:
                continue
            prev = t[j]
        spent["idle"] += last - prev
        ends.append(prev)
    total = len(attend) * (last - start)
    return dict(
        blocks=len(attend), parts=parts, first_start=start, last_end=last,
        go_us=dict(p50=_pct(go, 50), max=_pct(go, 100)),
        **{k: v / total if total > 0 else None for k, v in spent.items()},
        tail_us=last - _pct(ends, 90),
        after_last_choice_us=last - float(chosen[-1]) if len(chosen) else None)


def _busy(score: dict, attend: dict, us, span: float, bin_us: float) -> dict:
    bins = np.arange(0.0, span + bin_us, bin_us)
    scoring = np.zeros(len(bins) - 1, np.int64)
    streaming = np.zeros(len(bins) - 1, np.int64)

    def add(counts, lo, hi):
        counts[(bins[:-1] < hi) & (bins[1:] > lo)] += 1

    for r in score.values():
        if len(r) >= 2:
            add(scoring, us(r["ns"][0]), us(r["ns"][1]))
    for r in attend.values():
        t, e = us(r["ns"]), r["event"]
        for j in np.flatnonzero(e == _E["part_streamed"]):
            add(streaming, t[j - 1], t[j])
    return dict(bin_us=bin_us, scoring=scoring.tolist(), streaming=streaming.tolist())
