"""``sparrow calibrate --config CAL.yaml``: a budget schedule measured for a model and prompt set
(:mod:`sparrow_jax.calibrate`): dense rollouts, the tail per (bin, budget), the search, validation
by sparse rollouts on held-out prompts, the cost model's speedup and, given ``step_times``, the
measured one.

Here ``--config`` is a :class:`~sparrow_jax.calibrate.CalibrateConfig` as YAML; ``--out-dir`` and
``--no-progress`` override it.
"""

from __future__ import annotations

import argparse

from sparrow_jax.commands import give_jax_the_device_memory

CONFIG_IS_RUN_CONFIG = True
CONFIG_HELP = ("a CalibrateConfig as YAML (model or preset, prompts, n, max_new_tokens, "
               "budgets, bin_tokens, target, estimator, ...); required")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", help="override the config's out_dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from sparrow_jax.cli import CliError

    if args.config is None:
        raise CliError("sparrow calibrate needs --config CAL.yaml (a CalibrateConfig)")
    give_jax_the_device_memory()
    from sparrow_jax.calibrate import calibrate, format_report, load_calibrate_config

    overrides = {"out_dir": args.out_dir} if args.out_dir is not None else {}
    if args.no_progress:
        overrides["progress"] = False
    config = load_calibrate_config(args.config, **overrides)
    result = calibrate(config)
    print(format_report(result))
    print(f"wrote {config.out_dir}/schedule.yaml and calibration.json")
    return 0
