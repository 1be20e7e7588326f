#!/usr/bin/env bash
# The sparse decode kernels of an older tree against this one, timed in one call on one GPU,
# alternating old, new, old, new (ratios within one run, not across machines or days):
#   (here)  mkdir -p ab && git archive REV pallas_kernels sparrow_jax scripts | tar -x -C ab
#   (GPU)   bash scripts/kernel_ab.sh ab --batches 32 8 1 --contexts 32768 --budgets 2048 \
#               --kernel-configs b4 --skip composition xla_reference
# The arguments after the folder go to each tree's own scripts/bench_decode.py, or to the script
# named by `--script PATH` right after the folder (scripts/bench_rollout.py: the whole decode
# step; archive configs too). The old tree's
# packages come first on its runs' PYTHONPATH (all three: the kernels live in pallas_kernels/,
# the helpers in sparrow_jax/); each run prints the kernel file it imported. JSON:
# $OUT/ab_{old,new}_{1,2}.json. ab/ is untracked, so the device call carries it: delete it after.
set -euo pipefail
cd "$(dirname "$0")/.."
old=${1:?the folder of the old tree (git archive REV pallas_kernels sparrow_jax scripts)}
shift
script=scripts/bench_decode.py
if [ "${1:-}" = --script ]; then script=$2; shift 2; fi
for part in pallas_kernels sparrow_jax "$script"; do
  [ -e "$old/$part" ] || { echo "$old: no $part (archive pallas_kernels sparrow_jax scripts)" >&2
                          exit 2; }
done
OUT=${OUT:-.out}
mkdir -p "$OUT"
source scripts/gpu_env.sh >/dev/null
new_path=$PYTHONPATH
old_path=$PWD/$old:$PYTHONPATH
for pass in 1 2; do
  for tree in old new; do
    if [ "$tree" = old ]; then path=$old_path root=$old; else path=$new_path root=.; fi
    # -P: no working directory on the path (a script's own run has its folder there instead).
    PYTHONPATH=$path python3 -P -c \
      "import pallas_kernels.sparse_decode_gpu as m; print('$tree tree, pass $pass:', m.__file__)"
    PYTHONPATH=$path python3 "$root/$script" "$@" \
      --out "$OUT/ab_${tree}_$pass.json" | grep -v '^{'
  done
done
