"""The ``sparrow`` command line: parses arguments and dispatches; nothing else.

Each subcommand lives in its own module, registered in :data:`SUBCOMMANDS` as
``name -> (one-line help, module)``. The module defines ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status) and keeps heavy imports (jax) inside ``run`` so that
``sparrow --help`` stays fast.

Every subcommand takes ``--config FILE.yaml``: its keys are the subcommand's long options
(``max_new_tokens: 64``); options given on the command line override the file. A module that
sets ``CONFIG_IS_RUN_CONFIG = True`` (``train``, ``calibrate``) reads the file itself, as its
run config.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Sequence

SUBCOMMANDS: dict[str, tuple[str, str | None]] = {
    "generate": ("sample text from an HF model folder or a randomly initialised preset",
                 "sparrow_jax.commands.generate"),
    "train": ("GRPO training with sparse rollouts and dense recomputation",
              "sparrow_jax.commands.train"),
    "plot": ("PNG curves of a training run's metrics", "sparrow_jax.commands.plot"),
    "calibrate": ("a budget schedule measured for a model and prompts (measure, search, "
                  "validate)", "sparrow_jax.commands.calibrate"),
    "bench": ("the sparse decode step and the rollout, each against dense, on this machine",
              "sparrow_jax.commands.bench"),
}


class CliError(ValueError):
    """Bad command-line or config-file input."""


def _add_config_option(parser: argparse.ArgumentParser, help_text: str | None) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE.yaml",
                        help=help_text or "YAML file of option values (keys as the long "
                                          "options, with underscores); command-line options "
                                          "override it")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each subcommand's parser, by name."""
    parser = argparse.ArgumentParser(
        prog="sparrow", description="sparrow-jax: long-context RL of LLMs with sparse rollouts")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    subs = {}
    for name, (help_text, module) in SUBCOMMANDS.items():
        sub = subs[name] = subparsers.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        _add_config_option(sub, getattr(mod, "CONFIG_HELP", None))
        mod.add_arguments(sub)
    return parser, subs


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def _config_defaults(sub: argparse.ArgumentParser, path: Path) -> dict:
    """A YAML file of option values, each checked as its command-line option would be."""
    import yaml

    if not path.is_file():
        raise CliError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise CliError(f"config file {path}: not valid YAML ({' '.join(str(e).split())})") \
            from None
    if not isinstance(data, dict):
        raise CliError(f"config file {path} must hold a mapping of option names to values")
    actions = {a.dest: a for a in sub._actions if a.dest not in ("help", "config")}
    for key in data:
        if key not in actions:
            from sparrow_jax.config import unknown_name

            raise CliError(f"config file {path}: {unknown_name('key', key, actions)}")
    out = {}
    for key, value in data.items():
        action = actions[key]
        if action.nargs == 0:  # a flag
            if not isinstance(value, bool):
                raise CliError(f"config file {path}: {key}: expected true or false, got {value!r}")
            out[key] = value
        elif action.type is not None and value is not None:
            values = value if isinstance(action.default, list) else [value]
            try:
                converted = [action.type(str(v)) for v in values]
            except (argparse.ArgumentTypeError, ValueError) as e:
                raise CliError(f"config file {path}: {key}: {e}") from None
            out[key] = converted if isinstance(action.default, list) else converted[0]
        else:
            out[key] = value
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subs = build_parser()
    args = parser.parse_args(argv)
    sub = subs[args.command]
    module = importlib.import_module(SUBCOMMANDS[args.command][1])
    try:
        if args.config is not None and not getattr(module, "CONFIG_IS_RUN_CONFIG", False):
            # Values from the file become defaults; a second parse lets the command line win.
            sub.set_defaults(**_config_defaults(sub, args.config))
            args = parser.parse_args(argv)
        return module.run(args)
    # Bad input of every kind (configs, checkpoints, tokenizers, files) derives from these: one
    # line, no traceback. Anything else is a bug and keeps its traceback.
    except (ValueError, OSError) as e:
        print(f"sparrow {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sparrow {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
