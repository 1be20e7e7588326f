"""The CUDA kernels' timeline trace (pallas_kernels/cuda_trace.py) without a GPU: one call's
marks summarised as worked out by hand, the build's macros checked, and (where nvcc is) the
traced library built with its reader and no spills."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from conftest import load_script
from pallas_kernels import cuda_build, cuda_trace, sparse_attend_cuda

E = {name: i for i, name in enumerate(cuda_trace.EVENTS)}
BASE = 1_764_000_000 * 10 ** 9     # the global clock counts ns from the epoch


def marks(rows):
    """(us, block, event, list) -> records of cuda_trace.RECORD."""
    rec = np.zeros(len(rows), cuda_trace.RECORD)
    for r, (us, block, event, lst) in zip(rec, rows):
        r["ns"], r["block"], r["event"], r["list"] = BASE + round(us * 1000), block, E[event], lst
    return rec


# Two lists of two scoring blocks each, the second block of each choosing it; two attention
# blocks, one list each, each waiting for its list.
CALL = marks([
    (0.0, 0, "score_start", 0), (4.0, 0, "score_done", 0),
    (0.0, 1, "score_start", 0), (5.0, 1, "score_done", 0), (7.0, 1, "list_chosen", 0),
    (1.0, 2, "score_start", 1), (6.0, 2, "score_done", 1),
    (1.0, 3, "score_start", 1), (6.5, 3, "score_done", 1), (9.0, 3, "list_chosen", 1),
    (2.0, 0, "attend_start", -1), (7.5, 0, "attend_go", 0), (7.5, 0, "part_ready", 0),
    (17.5, 0, "part_streamed", 0), (19.5, 0, "part_done", 0), (19.6, 0, "attend_end", -1),
    (3.0, 1, "attend_start", -1), (9.5, 1, "attend_go", 1), (9.5, 1, "part_ready", 1),
    (21.5, 1, "part_streamed", 1), (23.5, 1, "part_done", 1), (23.6, 1, "attend_end", -1),
])


def test_one_call_summarised_as_worked_by_hand():
    s = cuda_trace.summarize(CALL[::-1])     # the buffer's order is the atomics', not time's
    assert s["span"] == pytest.approx(23.6) and s["marks"] == len(CALL)
    sc = s["score"]
    assert (sc["blocks"], sc["first_start"], sc["last_start"], sc["last_done"]) == (4, 0, 1, 6.5)
    assert sc["block_us"] == pytest.approx(dict(p50=5.0, p90=5.35, max=5.5))
    assert sc["choice_us"] == pytest.approx(dict(p50=2.25, max=2.5))
    assert sc["chosen"] == pytest.approx(dict(first=7.0, p50=8.0, last=9.0, lists=2))
    assert "select" not in s
    at = s["attend"]
    # 2 blocks x 21.6 us: waiting 5.5 + 6.5, streaming 10 + 12, finishing 2 + 2, idle 0 + 4.1
    # (after the first block's part) and 1 + 0.1.
    total = 2 * 21.6
    assert at["waiting"] == pytest.approx(12 / total)
    assert at["streaming"] == pytest.approx(22 / total)
    assert at["finishing"] == pytest.approx(4 / total)
    assert at["idle"] == pytest.approx(5.2 / total)
    assert at["go_us"] == pytest.approx(dict(p50=6.0, max=6.5))
    assert (at["blocks"], at["parts"]) == (2, 2)
    assert at["tail_us"] == pytest.approx(23.6 - (19.5 + 0.9 * 4.0))
    assert at["after_last_choice_us"] == pytest.approx(23.6 - 9.0)
    busy = s["busy"]
    assert busy["scoring"][:8] == [2, 4, 4, 4, 3, 2, 1, 0]
    assert busy["streaming"] == [0] * 7 + [1, 1] + [2] * 9 + [1] * 4 + [0, 0]


def test_the_script_prints_medians_over_calls():
    trace_step = load_script("trace_step")
    one = cuda_trace.summarize(CALL)
    later = cuda_trace.summarize(marks([(0.0, 0, "attend_start", -1),
                                        (1.0, 0, "attend_go", 0), (1.0, 0, "part_ready", 0),
                                        (3.0, 0, "part_streamed", 0),
                                        (4.0, 0, "part_done", 0)]))
    text = trace_step.line([one, later])
    assert text.startswith("span 13.8 | score 6.5 | block 5.0 | choice 2.2 | chosen 9.0")
    assert "select" not in text and "after-choice 14.6" in text


def test_macros_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPARROW_CUDA_DEFINES", " SPARROW_TRACE  OTHER ")
    assert cuda_build.defines() == ["-DSPARROW_TRACE", "-DOTHER"]
    monkeypatch.setenv("SPARROW_CUDA_DEFINES", "SPARROW_TRACE -O0")
    with pytest.raises(RuntimeError, match="^SPARROW_CUDA_DEFINES: '-O0' is not a macro name$"):
        cuda_build.defines()
    monkeypatch.delenv("SPARROW_CUDA_DEFINES")
    assert cuda_build.defines() == []


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="no nvcc here to build the kernels")
def test_traced_library_builds_apart_with_its_reader(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path))
    monkeypatch.setenv("SPARROW_CUDA_DEFINES", "SPARROW_TRACE")
    lib = cuda_build.build_library(sparse_attend_cuda.SOURCE, cuda_build.find_nvcc())
    log = lib.with_suffix(".log").read_text()
    assert "-DSPARROW_TRACE" in log.splitlines()[0]
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", log)
    assert spills and all(n == "0" for n in spills)
    assert hasattr(ctypes.CDLL(str(lib)), "SparrowTraceRead")
    # The record's layout is the kernel's TraceRecord's.
    assert cuda_trace.RECORD.itemsize == 32


def test_the_script_refuses_a_machine_without_the_kernels_in_one_line(monkeypatch):
    monkeypatch.setenv("SPARROW_CUDA_DEFINES", "")     # restored after: main() adds the trace
    if sparse_attend_cuda.unavailable() is None:
        pytest.skip("the CUDA kernels run here")
    with pytest.raises(SystemExit, match="^trace_step: the CUDA kernels cannot run here: "):
        load_script("trace_step").main(["--batches", "1"])


TRACED_CALL = """
import functools, json, os
os.environ["SPARROW_CUDA_DEFINES"] = "SPARROW_TRACE"
import jax, jax.numpy as jnp
from pallas_kernels import cuda_trace
from pallas_kernels.paged_attend_gpu import sm_count
from pallas_kernels.sparse_decode_gpu import GpuDecodeTuning, sparse_decode_pallas
from sparrow_jax.decode_bench import DecodeShape, random_case
q, k, v, c, t, n = random_case(DecodeShape(), 19, 4096)
step = jax.jit(functools.partial(
    sparse_decode_pallas, page_size=16, centroids=c, max_budget_pages=32,
    tuning=GpuDecodeTuning(score="cuda", balanced=False, splits=1)))
budgets = jnp.full((19,), 32, jnp.int32)
step(q, k, v, t, n, budgets).block_until_ready()
cuda_trace.read()
step(q, k, v, t, n, budgets).block_until_ready()
rec = cuda_trace.read()
chosen = rec["list"][rec["event"] == cuda_trace.EVENTS.index("list_chosen")]
print(json.dumps(dict(
    sms=sm_count(), chosen=sorted(chosen.tolist()),
    counts={e: int((rec["event"] == i).sum()) for i, e in enumerate(cuda_trace.EVENTS)},
    summary=cuda_trace.summarize(rec))))
"""


@pytest.mark.skipif(sparse_attend_cuda.unavailable() is not None,
                    reason=f"the CUDA kernels {sparse_attend_cuda.unavailable()}")
def test_a_traced_call_marks_every_block_and_list():
    """19 rows of 8 KV heads, 256-slot tables: 152 lists, one scoring block each (512 slots a
    block), each list chosen once and attended as one part, on one attention block an SM.
    In a process of its own: the macro must be set before the library is first built."""
    import json
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", TRACED_CALL], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    lists, sms = 152, got["sms"]
    assert got["chosen"] == list(range(lists))
    assert got["counts"] == dict(
        score_start=lists, score_done=lists, list_chosen=lists, select_start=0, select_done=0,
        attend_start=sms, attend_go=sms, part_ready=lists, part_streamed=lists,
        part_done=lists, attend_end=sms)
    at = got["summary"]["attend"]
    assert sum(at[k] for k in ("waiting", "streaming", "finishing", "idle")) == pytest.approx(1)
    assert got["summary"]["score"]["chosen"]["last"] <= got["summary"]["span"]
