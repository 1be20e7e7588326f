"""``sparrow train --config RUN.yaml [--resume]``: GRPO with sparse rollouts (:mod:`sparrow_jax.rl`).

Here ``--config`` is the run's :class:`~sparrow_jax.rl.config.TrainConfig` (see
``configs/demo.yaml``), not a file of option defaults; ``--run-dir`` and ``--steps`` override it.
"""

from __future__ import annotations

import argparse
import dataclasses

CONFIG_IS_RUN_CONFIG = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in the run folder")
    p.add_argument("--run-dir", help="override the config's run_dir")
    p.add_argument("--steps", type=int, help="override the config's number of steps")


def run(args: argparse.Namespace) -> int:
    from sparrow_jax.cli import CliError
    from sparrow_jax.rl.config import load_train_config
    from sparrow_jax.rl.trainer import train

    if args.config is None:
        raise CliError("sparrow train needs --config RUN.yaml (a TrainConfig; e.g. "
                       "configs/demo.yaml)")
    config = load_train_config(args.config)
    overrides = {k: v for k, v in (("run_dir", args.run_dir), ("steps", args.steps))
                 if v is not None}
    config = dataclasses.replace(config, **overrides)
    result = train(config, resume=args.resume)
    last = result.history[-1] if result.history else {}
    print(f"done: {config.steps} steps in {config.run_dir}; last reward_mean "
          f"{last.get('reward_mean', float('nan')):.4f}")
    return 0
