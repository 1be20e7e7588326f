"""The ``sparrow`` command line: parses arguments and dispatches; nothing else.

Each subcommand lives in its own module, registered in :data:`SUBCOMMANDS` as
``name -> (one-line help, module)``. The module defines ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status) and keeps heavy imports (jax) inside ``run`` so that
``sparrow --help`` stays fast. A subcommand whose module is ``None`` is not implemented yet.

Every subcommand takes ``--config FILE.yaml``: its keys are the subcommand's long options
(``max_new_tokens: 64``); options given on the command line override the file. A module that
sets ``CONFIG_IS_RUN_CONFIG = True`` (``train``) reads the file itself, as its run config.
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
    "calibrate": ("measure acceptance rates and search a budget schedule", None),
    "bench": ("benchmark sparse decode and rollouts", None),
}

NOT_IMPLEMENTED_STATUS = 2


class CliError(ValueError):
    """Bad command-line or config-file input."""


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE.yaml",
                        help="YAML file of option values (keys as the long options, with "
                             "underscores); command-line options override it")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each subcommand's parser, by name."""
    parser = argparse.ArgumentParser(
        prog="sparrow", description="sparrow-jax: long-context RL of LLMs with sparse rollouts")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    subs = {}
    for name, (help_text, module) in SUBCOMMANDS.items():
        sub = subs[name] = subparsers.add_parser(name, help=help_text, description=help_text)
        _add_config_option(sub)
        if module is not None:
            importlib.import_module(module).add_arguments(sub)
    return parser, subs


def _config_defaults(sub: argparse.ArgumentParser, path: Path) -> dict:
    import yaml

    if not path.is_file():
        raise CliError(f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise CliError(f"config file {path} must hold a mapping of option names to values")
    known = {a.dest for a in sub._actions} - {"help", "config"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CliError(f"config file {path}: unknown keys {unknown}; known: {sorted(known)}")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subs = build_parser()
    args = parser.parse_args(argv)
    sub = subs[args.command]
    try:
        module = SUBCOMMANDS[args.command][1]
        own_config = module is not None and getattr(importlib.import_module(module),
                                                    "CONFIG_IS_RUN_CONFIG", False)
        if args.config is not None and not own_config:
            # Values from the file become defaults; a second parse lets the command line win.
            sub.set_defaults(**_config_defaults(sub, args.config))
            args = parser.parse_args(argv)
        if module is None:
            print(f"sparrow {args.command}: not yet implemented in this version",
                  file=sys.stderr)
            return NOT_IMPLEMENTED_STATUS
        return importlib.import_module(module).run(args)
    except ValueError as e:  # our config/checkpoint/tokenizer/CLI errors all derive from it
        print(f"sparrow {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
