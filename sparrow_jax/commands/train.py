"""``sparrow train --config RUN.yaml [--resume | --overwrite]``: GRPO with sparse rollouts
(:mod:`sparrow_jax.rl`).

Here ``--config`` is the run's :class:`~sparrow_jax.rl.config.TrainConfig` (see
``configs/demo.yaml``); ``--run-dir``, ``--steps`` and ``--no-progress`` override it.
``--dry-run [--devices N] [--chip NAME]`` validates the config and prints its memory per device
without weights or devices (:mod:`sparrow_jax.dry_run`; the presets in ``configs/presets``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from sparrow_jax.commands import give_jax_the_device_memory

CONFIG_IS_RUN_CONFIG = True
CONFIG_HELP = "the run's TrainConfig as YAML (e.g. configs/demo.yaml); required"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sparrow_jax.cli import positive_int

    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in the run folder")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the run folder's previous run (checkpoints, metrics, plots) "
                        "and start from step 0")
    p.add_argument("--run-dir", help="override the config's run_dir")
    p.add_argument("--steps", type=positive_int, help="override the config's number of steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config and print the memory per device on its mesh, "
                        "without loading weights or touching devices; exit status 2 if it "
                        "does not fit the chip")
    p.add_argument("--devices", type=positive_int,
                   help="with --dry-run: the device count (default: the config's "
                        "target.devices)")
    p.add_argument("--chip", help="with --dry-run: v5e, v5p, h100 or h200 (default: the "
                                  "config's target.chip)")


def run(args: argparse.Namespace) -> int:
    from sparrow_jax.cli import CliError

    if args.config is None:
        raise CliError("sparrow train needs --config RUN.yaml (a TrainConfig; e.g. "
                       "configs/demo.yaml)")
    if args.dry_run:
        return _dry_run(args)
    if args.devices is not None or args.chip is not None:
        raise CliError("--devices and --chip go with --dry-run")

    give_jax_the_device_memory()
    from sparrow_jax.dry_run import load_run_file
    from sparrow_jax.rl.interrupt import TrainingInterrupted
    from sparrow_jax.rl.trainer import train

    config = load_run_file(args.config).config     # a `target` key is the dry run's alone
    overrides = {k: v for k, v in (("run_dir", args.run_dir), ("steps", args.steps))
                 if v is not None}
    if args.no_progress:
        overrides["progress"] = False
    try:
        config = dataclasses.replace(config, **overrides)
    except ValueError as e:
        raise CliError(f"--steps: {e}") from None
    try:
        result = train(config, resume=args.resume, overwrite=args.overwrite)
    except TrainingInterrupted as e:
        again = f"sparrow train --config {args.config} --resume" + "".join(
            f" --{k.replace('_', '-')} {v}" for k, v in overrides.items() if k != "progress")
        print(f"sparrow train: {e}; resume with: {again}", file=sys.stderr)
        return e.exit_status
    last = result.history[-1] if result.history else {}
    print(f"done: {config.steps} steps in {config.run_dir}; last reward_mean "
          f"{last.get('reward_mean', float('nan')):.4f}")
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    from sparrow_jax.cli import CliError
    from sparrow_jax.dry_run import dry_run, format_report, load_run_file

    if args.resume or args.overwrite:
        raise CliError("--dry-run touches no run folder: drop --resume/--overwrite")
    report = dry_run(load_run_file(args.config), devices=args.devices, chip=args.chip)
    print(format_report(report))
    report.check_fits()
    return 0
