#!/usr/bin/env bash
# scripts/multi_gpu.py on a machine of several GPUs (issue 21): NVLink multicast off, the
# carried wheels installed and the pins checked (scripts/gpu_env.sh), then every item within the
# budget (on two GPUs the whole run fits 9 minutes); the JSON report and logs go to $OUT.
#   bash scripts/multi_gpu.sh --commit <sha> [scripts/multi_gpu.py options]
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}   # the machine requires NVLink multicast off
[ "$NCCL_NVLS_ENABLE" = 0 ] || { echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE: must be 0" >&2; exit 2; }
# The rollout profile sizes its pool to the GPU: JAX's default cap (75% of the memory) leaves a
# quarter unused and ran it out of memory; every item's process gets 95% (recorded in the JSON's
# env; the shared items do not preallocate, so this is a cap, not a reservation).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
source scripts/gpu_env.sh
exec python3 scripts/multi_gpu.py "$@"
