#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then the CPU test suite (slow tests excluded).
# Several pytest workers, files kept whole on one worker so that a module's fixtures are built
# once: most of the suite's time is XLA compiling and Python, one core each, so CI's 2 cores
# run it in ~60% of the time one process takes. At most 4: each worker holds its own JAX and
# compiled programs. `-n 0` runs it in this process (a later -n wins).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
cores=$(nproc 2>/dev/null || echo 2)
exec .venv/bin/python -m pytest -q -n "$(( cores < 4 ? cores : 4 ))" --dist loadfile "$@"
