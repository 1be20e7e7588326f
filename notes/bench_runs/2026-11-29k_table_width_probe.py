"""Probe (session 50): does the decode step's cost follow the page table's width, and would
widths in multiples of the bucket (instead of powers of two) pay?

The engine shows each decode chunk the first ``w`` page-table columns, ``w`` the smallest power
of two >= ``table_bucket_pages`` that holds every row (``decode_loop.table_width``): the
profile's rows at 8K / 16K / 32K tokens (515 / 1027 / 2051 pages) run in 1024 / 2048 / 4096
columns, half of them past the rows. ``mult`` is the smallest multiple of the bucket instead
(768 / 1280 / 2304). ``--score xla`` also scores pages by ``score_keys_xla`` (kernel run AT),
which gathers every column, so it gains most from narrower tables.

    for w in pow2 mult; do XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
      python3 notes/bench_runs/2026-11-29k_table_width_probe.py --widths $w -- --phase profile \
        --batch 19 --repeats 1 --modes sparse --contexts 8192 16384 32768 --no-split \
        --no-emit-breakdown; done

``--script profile_step``: ``scripts/profile_step.py ARGS`` instead (where the step's time goes,
by kernel), e.g. with ``--score xla`` and ``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text``;
``--gathers DIR`` then prints the optimized modules' fusions that gather (and what calls them).
"""

from __future__ import annotations

import argparse
import re
import functools
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import pallas_kernels.sparse_decode_gpu as gpu  # noqa: E402
from pallas_kernels.sparse_decode_gpu import GpuDecodeTuning  # noqa: E402
from sparrow_jax.attention import sparse  # noqa: E402
from sparrow_jax.rollout import (chunk_time, decode_loop, engine, profile,  # noqa: E402
                                 refill_schedule)


def multiple_width(tokens: int, page_size: int, width: int, bucket: int | None) -> int:
    if bucket is None:
        return width
    need = max(-(-tokens // page_size), bucket)
    return min(-(-need // bucket) * bucket, width)


def gather_fusions(dump: Path, pattern: str) -> None:
    for path in sorted(dump.glob(pattern)):
        text = re.sub(r", metadata=\{[^}]*\}", "", path.read_text())
        blocks = re.split(r"\n(?=\S)", text)
        names = [b.split(" ", 1)[0].lstrip("%") for b in blocks if " gather(" in b]
        print(f"== {path.name}: {len(names)} computations with a gather")
        for b in blocks:
            head = b.split(" ", 1)[0].lstrip("%")
            if head in names:
                print(b[:6000])
        for line in text.splitlines():
            if any(f"calls=%{n}" in line or f"calls={n}" in line for n in names):
                print("CALL", line.strip()[:1500])


def main():
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", choices=("pow2", "mult"), default="pow2")
    ap.add_argument("--score", choices=("pallas", "xla"), default="pallas")
    ap.add_argument("--script", choices=("bench_rollout", "profile_step"), default="bench_rollout")
    ap.add_argument("--gathers", type=Path, default=None)
    ap.add_argument("--glob", default="*run_chunk*after_optimizations.txt")
    args = ap.parse_args(argv[:split])
    if args.gathers is not None:
        return gather_fusions(args.gathers, args.glob)
    if args.widths == "mult":
        for module in (decode_loop, engine, profile, chunk_time, refill_schedule):
            module.table_width = multiple_width
    if args.score == "xla":
        sparse.sparse_decode_pallas_checked = functools.partial(
            gpu.sparse_decode_pallas_checked, tuning=GpuDecodeTuning(score="xla"))
    print(f"widths {args.widths}, score {args.score}", flush=True)
    sys.argv = [str(ROOT / "scripts" / f"{args.script}.py"), *argv[split + 1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
