#!/usr/bin/env bash
# Fetches, into .whl/, the wheels that scripts/test_gpu.sh installs on a GPU machine whose image
# lacks them or holds other versions: the pinned JAX libraries, the test suite's extras and
# jax-triton (impl="triton"; pure Python, it uses the image's triton 3.6). Run
# here (with network), then carry .whl to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/find_python.sh)
rm -rf .whl && mkdir .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl flax==0.12.10 optax==0.2.8 orbax-checkpoint==0.12.4 chex==0.1.92 \
  tensorboardX==2.6.5 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 \
  jax-triton==0.3.1 absl-py==2.3.1
ls .whl
