#!/usr/bin/env bash
# Creates .venv-hf, the reference venv that regenerates tests/fixtures/hf (Python 3.11, CPU torch,
# transformers), then optionally regenerates the fixtures:
#   bash scripts/make_hf_venv.sh && .venv-hf/bin/python scripts/make_hf_fixtures.py
# Kept apart from .venv: the library itself must not depend on torch or transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON311:-python3.11}
if ! command -v "$py" >/dev/null 2>&1; then
  echo "python3.11 not found: install it, or set PYTHON311=/path/to/python3.11" >&2
  exit 1
fi
if [ ! -x .venv-hf/bin/python ]; then
  "$py" -m venv .venv-hf
fi
.venv-hf/bin/python -m pip install -q --upgrade pip
.venv-hf/bin/python -m pip install -q --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
  || .venv-hf/bin/python -m pip install -q torch==2.13.0
.venv-hf/bin/python -m pip install -q transformers numpy safetensors tokenizers jinja2
.venv-hf/bin/python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
