#!/usr/bin/env bash
# scripts/multi_gpu.py on the 2-GPU machine (issue 21): NVLink multicast off, the carried wheels
# installed and the pins checked (scripts/gpu_env.sh), then every item within the budget (the
# whole run fits 9 minutes); the JSON report and logs go to $OUT.
#   bash scripts/multi_gpu.sh --commit <sha> [scripts/multi_gpu.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}   # the machine requires NVLink multicast off
[ "$NCCL_NVLS_ENABLE" = 0 ] || { echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE: must be 0" >&2; exit 2; }
source scripts/gpu_env.sh
exec python3 scripts/multi_gpu.py "$@"
