"""``sparrow plot RUN_DIR``: PNG curves of a training run's metrics (into RUN_DIR/plots)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="a run folder holding metrics.jsonl")


def run(args: argparse.Namespace) -> int:
    from sparrow_jax.cli import CliError
    from sparrow_jax.plot import plot_run

    if not (args.run_dir / "metrics.jsonl").is_file():
        raise CliError(f"{args.run_dir} holds no metrics.jsonl (not a training run folder?)")
    for path in plot_run(args.run_dir):
        print(path)
    return 0
