"""The trace summary of scripts/profile_step.py and bench_decode.py --trace
(``sparrow_jax.benchmarking``) against a hand-built perfetto trace."""

from __future__ import annotations

import gzip
import json
import pathlib

import pytest

from sparrow_jax.benchmarking import (device_events, device_timeline, growth_per_row,
                                      launch_gaps, summarize_events)


def write_trace(folder: pathlib.Path, events) -> None:
    run = folder / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_device_lines_summed_per_step(tmp_path):
    """Two steps traced on stream 7 of GPU 0: gemm 30 + 50 us, add 4 + 6 us -> 40 and 5 us a
    step, one launch each a step; the host's events are left out."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name",
             "args": {"name": "Stream #7"}}]
    x = [dict(ph="X", pid=2, tid=7, ts=t, dur=d, name=n)
         for t, d, n in [(0, 30, "gemm"), (40, 4, "add"), (50, 50, "gemm"), (110, 6, "add")]]
    write_trace(tmp_path, meta + x + [dict(ph="X", pid=1, tid=1, ts=0, dur=999, name="host")])
    out = summarize_events(device_events(str(tmp_path)), calls=2, top=5)
    assert list(out) == ["/device:GPU:0 Stream #7"]
    line = out["/device:GPU:0 Stream #7"]
    assert line["total_us"] == pytest.approx(45.0)
    assert [(r["name"], r["us"], r["per_step"]) for r in line["top"]] == [
        ("gemm", 40.0, 1.0), ("add", 5.0, 1.0)]


def test_no_trace_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no perfetto_trace"):
        device_events(str(tmp_path))


def test_launch_gaps_per_pair_of_kernels(tmp_path):
    """Two calls of score (10 us) then attend (20, then 19 us) on one stream, given out of
    order; attend starting 1 us after score ends and the next score 3 us after attend: span
    (0 .. 64) 32 us a call, busy 29.5, gaps score -> attend 1 (twice), attend -> score 3."""
    meta = [{"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
    x = [dict(ph="X", pid=2, tid=7, ts=t, dur=d, name=n)
         for t, d, n in [(34, 10, "score"), (0, 10, "score"), (11, 20, "attend"),
                         (45, 19, "attend")]]
    write_trace(tmp_path, meta + x)
    (events,) = device_timeline(str(tmp_path)).values()
    assert [n for _, _, n in events] == ["score", "attend", "score", "attend"]
    out = launch_gaps(events, calls=2)
    assert out["span_us"] == pytest.approx(32.0)
    assert out["busy_us"] == pytest.approx(29.5)
    assert out["gaps_us"] == {"score -> attend": (1.0, 1.0, 1.0),
                              "attend -> score": (3.0, 3.0, 3.0)}
    assert out["gap_sum_us"] == {"score -> attend": 1.0, "attend -> score": 1.5}


def test_growth_per_row_by_hand():
    """19 -> 34 rows (15 more): attend 100 -> 250 us a step adds 10 us a row, score 20 -> 35
    adds 1, a fixed gemm 500 -> 500 adds 0, a kernel seen only at 34 rows (6 us) adds 0.4;
    largest first."""
    small = {"attend": 100.0, "score": 20.0, "gemm": 500.0}
    large = {"attend": 250.0, "score": 35.0, "gemm": 500.0, "copy": 6.0}
    rows = growth_per_row(small, large, 19, 34)
    assert [r["name"] for r in rows] == ["attend", "score", "copy", "gemm"]
    assert [r["per_row"] for r in rows] == pytest.approx([10.0, 1.0, 0.4, 0.0])
    assert rows[2]["us_small"] == 0.0 and rows[2]["us_large"] == 6.0
    with pytest.raises(ValueError, match="must be larger"):
        growth_per_row(small, large, 34, 19)
