#!/usr/bin/env bash
# The test suite on a GPU machine (the device image: JAX with CUDA, no venv): every test but the
# `hf` ones (slow included), in parts that each finish within 10 minutes there.
#   bash scripts/test_gpu.sh PART [PYTEST ARGS]   PART: kernels | models | train | rest | tpu | all
# With pytest-xdist's `-n N` the workers share the GPU: memory is allocated on demand, not
# preallocated by the first worker.
# (tpu: the TPU kernels in interpret mode and their exports, which run on the host's CPU)
# Wheels the image lacks come from .whl/ (scripts/gpu_wheels.sh fetches them; carry .whl).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
shift || true
case " $* " in *" -n "*) export XLA_PYTHON_CLIENT_PREALLOCATE=false ;; esac
source scripts/gpu_env.sh   # wheels from .whl/, PYTHONPATH, the pins and the GPU checked
# Each part's files: the GPU kernels (the sparse step's, dense decode's and the cache write's);
# the model, decode, rollout and CLI; training; the TPU kernels; the rest.
kernels="tests/test_sparse_kernel.py tests/test_sparse_kernel_triton.py tests/test_sparse_decode.py
  tests/test_selection.py tests/test_teacher_forced_kernel.py tests/test_sparse_attend_mgpu.py
  tests/test_sparse_attend_balanced.py tests/test_sparse_attend_cuda.py
  tests/test_cuda_build.py tests/test_cuda_trace.py
  tests/test_paged_cache.py tests/test_qk_prep.py tests/test_decode_mlp.py tests/test_decode_gemm.py"
models="tests/test_engine.py tests/test_engine_buckets.py tests/test_engine_topk.py
  tests/test_decode.py tests/test_model.py tests/test_lm_head.py
  tests/test_teacher_forced.py tests/test_hf_parity.py tests/test_hf_io.py tests/test_cli.py"
train=$(ls tests/test_{trainer,safe_runs,update,grpo_loss,checkpoint,sharding,distill,demo}*.py \
  tests/test_multiprocess*.py 2>/dev/null || true)
tpu=$(ls tests/test_*tpu*.py)
case $part in
  kernels) files=$kernels ;;
  models) files=$models ;;
  train) files=$train ;;
  # The TPU kernels in interpret mode and their TPU exports are host work: on the CPU backend,
  # as in CI (`impl="auto"` traced on a GPU backend holds the GPU kernels, which cannot lower
  # for TPU; export for TPU from a CPU host).
  tpu) files=$tpu; export JAX_PLATFORMS=cpu ;;
  rest) files=$(ls tests/test_*.py | grep -v -x -F -f <(printf '%s\n' $kernels $models $train $tpu)) ;;
  all) files="" ;;
  *) echo "unknown part $part: kernels, models, train, rest, tpu or all" >&2; exit 2 ;;
esac
exec python3 -m pytest -q -m "not hf" -p no:cacheprovider --durations=10 "$@" $files
