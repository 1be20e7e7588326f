"""The benchmarks' clock sampler against hand-written nvidia-smi output, and against a stand-in
``nvidia-smi`` on the PATH (the CPU machine has none)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from conftest import REPO
from sparrow_jax.clock_sampler import ClockSampler, parse_samples, summarize

QUERY = "--query-gpu=clocks.sm,clocks.mem,power.draw"
ORIGINAL_PATH = os.environ["PATH"]


def test_parse_and_summarize_by_hand():
    """Two good lines of three; the [N/A] line and the error text are left out. Medians of two
    are their means: SM (1980 + 1755) / 2 = 1867.5, power (351.2 + 402.6) / 2 = 376.9."""
    text = "1980, 2619, 351.20\n[N/A], 2619, 300\nNo devices were found\n1755, 2619, 402.60\n"
    samples = parse_samples(text)
    assert samples == [(1980.0, 2619.0, 351.2), (1755.0, 2619.0, 402.6)]
    got = summarize(samples)
    assert got == dict(sm_mhz=1867.5, sm_mhz_min=1755.0, mem_mhz=2619.0,
                       watts=pytest.approx(376.9), samples=2)
    assert summarize([]) is None


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """An ``nvidia-smi`` that logs its arguments and answers one line, SM 1500 MHz on its first
    call and 1200 after, first on the PATH."""
    bin_dir, log = tmp_path / "bin", tmp_path / "args.log"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-smi"
    exe.write_text(f"""#!/bin/sh
echo "$@" >> {log}
if [ -s {tmp_path / "seen"} ]; then echo "1200, 2600, 250.0"; else echo "1500, 2600, 300.0"; fi
echo x > {tmp_path / "seen"}
""")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + "/usr/bin" + os.pathsep + "/bin")
    return log


def test_samples_while_the_block_runs(fake_smi):
    with ClockSampler(interval_s=0.01, gpu="3") as clocks:
        time.sleep(0.3)
    got = clocks.summary
    assert got["samples"] >= 3          # one at the start, then about every 10 ms
    assert got["sm_mhz_min"] == 1200.0 and got["sm_mhz"] == 1200.0   # 1500 once, then 1200s
    assert got["mem_mhz"] == 2600.0
    calls = fake_smi.read_text().splitlines()
    assert len(calls) == got["samples"]
    assert calls[0].split() == [QUERY, "--format=csv,noheader,nounits", "-i", "3"]


def test_gpu_index_from_cuda_visible_devices(fake_smi, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,2")
    with ClockSampler(interval_s=0.01) as clocks:
        pass
    assert clocks.summary["samples"] >= 1
    assert fake_smi.read_text().split()[-2:] == ["-i", "5"]


def test_nothing_without_nvidia_smi_or_when_off(fake_smi, tmp_path, monkeypatch):
    with ClockSampler(enabled=False) as clocks:
        pass
    assert clocks.summary is None and not fake_smi.exists()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with ClockSampler() as clocks:
        pass
    assert clocks.summary is None


def test_bench_decode_records_the_clocks_of_each_row(fake_smi, tmp_path):
    """``bench_decode.py --clocks`` (a CPU dry run in interpret mode): every timed row carries
    the clocks sampled while it was timed, the stand-in's 1500 then 1200 MHz."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               PATH=os.environ["PATH"] + os.pathsep + ORIGINAL_PATH)
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_decode.py"), "--interpret",
         "--contexts", "128", "--batches", "1", "--budgets", "64", "--main-budget", "64",
         "--skip", "composition", "xla_reference", "dense_pallas_jax", "dense_pallas_paged",
         "dense_cuda_lists", "--kernel-configs", "b4", "--loops", "fori", "--repeats", "1",
         "--chain", "2", "--clocks", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows} == {"dense_xla_contiguous", "kernel_b4"}
    for r in rows:
        assert r["clocks"]["samples"] >= 1 and r["clocks"]["mem_mhz"] == 2600.0
        assert r["clocks"]["sm_mhz_min"] in (1200.0, 1500.0)
