"""The GPU's clocks while a benchmark times something, sampled by ``nvidia-smi``.

Latency-bound calls (a sparse decode step at one row) run at the SM clock's pace, bandwidth-bound
ones (a dense step) at the memory's: were the boost clock to differ between processes, their
ratio would move by more than either time. Recorded beside each time, the clocks tell that
from a change of code (BENCHMARKS.md, kernel run BA: one row's step 14.3-20.2 us over seven
processes; the two that sampled clocks held 1980 / 3201 MHz throughout). The GPUs are lent
as they are (no clocks locked), so they are read, not set.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading

FIELDS = ("clocks.sm", "clocks.mem", "power.draw")


def parse_samples(text: str) -> list[tuple[float, float, float]]:
    """``nvidia-smi --format=csv,noheader,nounits`` lines of :data:`FIELDS` as (SM MHz, memory
    MHz, watts); lines that are not three numbers (``[N/A]``, an error's text) are left
    out."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(FIELDS):
            continue
        try:
            samples.append(tuple(float(p) for p in parts))
        except ValueError:
            continue
    return samples


def summarize(samples: list[tuple[float, float, float]]) -> dict | None:
    """Median and minimum SM clock, median memory clock and power, and the sample count; None
    without samples."""
    if not samples:
        return None
    sm, mem, watts = zip(*samples)
    return dict(sm_mhz=statistics.median(sm), sm_mhz_min=min(sm), mem_mhz=statistics.median(mem),
                watts=statistics.median(watts), samples=len(samples))


class ClockSampler:
    """``with ClockSampler() as clocks: ...`` samples the GPU's clocks about every
    ``interval_s`` while the block runs, one ``nvidia-smi`` query at a time from a thread (a
    query's own output, so nothing waits on a pipe's buffer); ``clocks.summary`` is then
    :func:`summarize`'s dict, or None where there is no ``nvidia-smi`` (the CPU machine) or it
    gave no sample, or ``enabled`` is False. ``gpu``: nvidia-smi's index, by default the first
    of ``CUDA_VISIBLE_DEVICES`` (the GPU JAX calls device 0), else 0."""

    def __init__(self, interval_s: float = 0.1, gpu: str | None = None, enabled: bool = True):
        self.interval_s = interval_s
        self.gpu = gpu if gpu is not None else (
            os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0")
        self.summary: dict | None = None
        self._exe = shutil.which("nvidia-smi") if enabled else None
        self._stop = threading.Event()
        self._text: list[str] = []
        self._thread = None

    def _query(self) -> None:
        cmd = [self._exe, f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
               "-i", self.gpu]
        while True:
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=5)
                self._text.append(done.stdout)
            except (OSError, subprocess.SubprocessError):
                return
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> ClockSampler:
        if self._exe is not None:
            self._thread = threading.Thread(target=self._query, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self.summary = summarize(parse_samples("".join(self._text)))
