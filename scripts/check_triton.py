"""The Triton sparse decode path on one GPU, in one run (issue 18): correctness, then timings.

1. ``tests/test_sparse_kernel_triton.py`` (the Triton kernels through jax-triton against the
   float64 reference on the kernel test matrix, every tuning case, the dispatch), pass/fail per
   case;
2. ``scripts/bench_decode.py`` at 32K context, budget 2048 tokens (128 pages), page 16, GQA 32/8,
   head_dim 128, bf16, batches 1, 8, 32, 64: the Triton variants of ``--triton``, the Pallas
   kernel and the dense baselines (XLA on a contiguous cache, the engine's and JAX's Pallas
   paged attention),
   bench_decode's timing (warm-up, chained calls, median of repeats, block_until_ready) and
   read ceiling, each output checked against the XLA reference; the breakdown (each part
   alone) at batches 1 and 32.

Each part runs in its own process with its own time limit inside one overall deadline, so a
crash (an illegal memory access poisons a process) or a hang costs only that part. Output: the
parts' logs and JSON under ``--out`` and ``summary.json`` there.

    bash scripts/gpu_wheels.sh     # here, with network: .whl/ holds jax-triton
    # on the GPU machine (repo root, .whl carried):
    python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 scripts/check_triton.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Triton settings compared: the defaults (histogram threshold, 4-page steps at 4 warps, 2
# stages); the bitwise threshold; Pallas' attention settings (2 warps, no pipelining); 8-page
# steps; a deeper pipeline.
TRITON_CONFIGS = "default,h0,w2g1,b8,g3"


def run_part(name, cmd, out: Path, limit: float, env) -> dict:
    """Runs one part with its output in ``out/<name>.log`` (printed after); never raises."""
    t0 = time.time()
    print(f"== {name} (limit {limit:.0f} s): {' '.join(cmd)}", flush=True)
    log = out / f"{name}.log"
    try:
        with open(log, "w") as f:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=limit).returncode
    except subprocess.TimeoutExpired:   # run() has killed it
        rc = "timeout"
    except Exception as e:   # the part could not even start: a result too
        rc = f"{type(e).__name__}: {e}"
    took = time.time() - t0
    if log.exists():
        print(log.read_text()[-20000:], flush=True)
    print(f"== {name}: rc {rc}, {took:.0f} s", flush=True)
    return dict(name=name, cmd=cmd, rc=rc, seconds=round(took, 1), log=log.name)


def pytest_cases(log: Path) -> dict:
    """{test id: PASSED/FAILED/SKIPPED/ERROR} from a ``pytest -v`` log."""
    cases = {}
    if log.exists():
        for m in re.finditer(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", log.read_text(),
                             re.M):
            cases[m.group(1)] = m.group(2)
    return cases


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "check_triton_out"))
    ap.add_argument("--deadline", type=float, default=450.0,
                    help="seconds for everything (the device call allows 480 s with compile)")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 8, 1, 64],
                    help="one bench process each, in this order (the headline first)")
    ap.add_argument("--triton", default=TRITON_CONFIGS, help="bench_decode --triton-configs")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT))
                                          if p))
    left = lambda: args.deadline - (time.time() - start)
    parts = []

    parts.append(run_part("tests", [sys.executable, "-m", "pytest", "-v", "-p",
                                    "no:cacheprovider", "-m", "slow or not slow",
                                    "tests/test_sparse_kernel_triton.py"],
                          out, min(150.0, left()), env))
    cases = pytest_cases(out / "tests.log")
    for case, verdict in cases.items():
        print(f"{verdict:8s} {case}", flush=True)

    bench = ["--contexts", "32768", "--sweep-contexts", "--main-budget", "2048", "--chain",
             "20", "--repeats", "10", "--kernel-configs", "b4", "--triton-configs",
             args.triton, "--skip", "composition", "xla_reference"]
    for i, b in enumerate(args.batches):
        # What is left, shared by the batches still to run; batch 32 (with the breakdown)
        # takes a larger share.
        budget = min(left(), left() / (len(args.batches) - i) * (1.5 if b == 32 else 1.0))
        if budget < 20:
            parts.append(dict(name=f"bench_b{b}", rc="skipped: no time left"))
            continue
        # The parts alone: at 32 what the bandwidth leaves, at 1 the latency bound.
        extra = ["--breakdown"] if b in (1, 32) else []
        parts.append(run_part(f"bench_b{b}", [sys.executable, "scripts/bench_decode.py",
                                              "--batches", str(b), *bench, *extra, "--out",
                                              str(out / f"bench_b{b}.json")],
                              out, budget, env))

    rows, ceilings = [], {}
    for b in args.batches:
        path = out / f"bench_b{b}.json"
        if path.exists():
            data = json.loads(path.read_text())
            rows += data["rows"]
            ceilings[b] = data["read_ceiling_gb_s"]
    summary = dict(parts=parts, tests=cases,
                   tests_failed=[c for c, v in cases.items() if v in ("FAILED", "ERROR")],
                   read_ceiling_gb_s=ceilings, rows=rows, seconds=round(time.time() - start))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from bench_decode import summarize
        print("\n".join(summarize(rows)))
    except Exception as e:   # the summary table is a convenience; the JSON holds everything
        print(f"summary table failed: {e!r}")
    print(f"tests: {sum(v == 'PASSED' for v in cases.values())} passed, "
          f"{len(summary['tests_failed'])} failed of {len(cases)}; "
          f"{time.time() - start:.0f} s; {out / 'summary.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
