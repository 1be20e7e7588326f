#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then the CPU test suite (slow tests excluded).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec .venv/bin/python -m pytest -q "$@"
