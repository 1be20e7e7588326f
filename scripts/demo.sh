#!/usr/bin/env bash
# The README's main job: set up .venv if needed, then GRPO with sparse rollouts from the tiny
# pre-trained model in checkpoints/demo on the needle task (configs/demo.yaml, into runs/demo):
# prints the context-free ceiling and the held-out reward before and after, and writes plots to
# runs/demo/plots. About 10 minutes on a 2-core CPU. Extra arguments go to scripts/demo.py
# (--steps N, --run-dir DIR, --resume, --config FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -f checkpoints/demo/model.safetensors ]; then
  echo "checkpoints/demo is missing: making it (a few minutes)" >&2
  .venv/bin/python scripts/make_demo_model.py
fi
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec .venv/bin/python scripts/demo.py --config configs/demo.yaml "$@"
