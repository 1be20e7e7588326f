#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 and installs sparrow-jax (editable) with its dev extra.
# Idempotent: a second run only checks the install.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  py=$(bash scripts/find_python.sh)
  "$py" -m venv .venv
fi
stamp=.venv/.sparrow-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
