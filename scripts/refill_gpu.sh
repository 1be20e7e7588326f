#!/usr/bin/env bash
# Continuous refill on one GPU (issue 17's figures), in parts that each fit a 10-minute call;
# each writes its JSON under $OUT (default .out/) and prints its table.
#   bash scripts/refill_gpu.sh PART [bench_rollout.py args, appended]
#   PART: test          the refill tests on the GPU (refill, its replay, the chunk model)
#         8k-sparse     end to end at the 8K cap, static vs refill, the paper schedule
#         8k-dense      the same, dense
#         model-8k      the chunk model at the 8K cap, checked against the 8k-* runs (10%)
#         model-32k-sparse, model-32k-dense   the chunk model at the 32K cap
#         grpo-32k      the GRPO step at 32K: training measured on a few rows (or read from
#                       TRAINING=, an earlier run's JSON), the model's rollouts added
# Inputs of model-8k and grpo-32k (JSON of earlier parts, carried in the tree) are read from $IN
# (default $OUT), each under the name its part writes (refill_8k-sparse.json, ..), or from the
# files SPARSE_8K=, DENSE_8K= (model-8k), SPARSE_32K=, DENSE_32K= (grpo-32k) name. The 8K runs
# use 160 prompts of 32 tokens with caps from the log-normal mix, static batches of 32 (the pool
# they need at full length), refill with 128 slots in the same pool and its tail narrowed down
# to 8 (with 64 slots the last admission comes later and dense refill/static measured 1.79x,
# with 128 2.05x; 2026-11-26). (With 96 prompts the last row at the cap bounds refill at 8192
# steps against the static engine's 3 x 8192: 1.70x measured, sparse, 2026-11-25.) The 32K model prices 152 prompts (19 x 8
# samples, 8 static batches of 19, the most whose 32K cache fits) on 48 refill slots in the same
# pool. CUDA graphs on (XLA's default; GRAPHS=0 turns them off): without them a step launches
# each of its kernels from the host, which at a few ms a step is most of the step and varies
# from chunk to chunk (measured: BENCHMARKS.md, continuous refill).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:?PART: test, 8k-sparse, 8k-dense, model-8k, model-32k-sparse, model-32k-dense, grpo-32k}
shift
OUT=${OUT:-.out}
IN=${IN:-$OUT}
mkdir -p "$OUT"
source scripts/gpu_env.sh >/dev/null
# 0.9: room for the refill chunk's CUDA graph (at 0.95 it could not be instantiated); the 32K
# profile's pool (19 rows at 32K, 71 GB) needs 0.95.
case $part in *32k*) frac=0.95 ;; *) frac=0.9 ;; esac
export XLA_PYTHON_CLIENT_MEM_FRACTION=$frac
[ "${GRAPHS:-1}" = 1 ] || export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
mix8k=(--max-new 8192 --batch 32 --rows 160 --slots 128 --tail-slots 8 --prefill-rows 16
  --length-mix lognormal)
model=(--repeats 4)
# The 32K runs recorded in BENCHMARKS.md narrow the tail to 8 slots as well (they passed
# --tail-slots 8 by hand; a call without it predicted 461 s for sparse refill where the same
# tree with it gave 446 s, 2026-11-26).
mix32k=(--max-new 32768 --batch 19 --rows 152 --slots 48 --tail-slots 8 --prefill-rows 16
  --length-mix lognormal --contexts 128 2048 4096 8192 12288 16384 24576 32768)
extra=("$@")
rollout() { python3 scripts/bench_rollout.py "$@" "${extra[@]}"; }
# merge OUT SPARSE DENSE: one JSON holding the sparse run of the one file and the dense of the
# other (what --refill-json reads).
merge() {
  python3 - "$@" <<'PY'
import json, sys
out, *paths = sys.argv[1:]
runs = [json.load(open(path)) for path in paths]
for run, mode, path in zip(runs, ("sparse", "dense"), paths):
    if mode not in run.get("modes", {}):
        sys.exit(f"{path}: no {mode!r} run under 'modes'")
for key in ("max_new", "rows", "batch", "slots", "num_pages", "length_mix"):
    if runs[0].get(key) != runs[1].get(key):
        sys.exit(f"{paths[1]}: {key} {runs[1].get(key)!r}, but {runs[0].get(key)!r} in "
                 f"{paths[0]}")
json.dump(dict(runs[0], modes={m: r["modes"][m] for r, m in zip(runs, ("sparse", "dense"))}),
          open(out, "w"))
PY
}
case $part in
  test) exec python3 -m pytest -q -p no:cacheprovider tests/test_refill.py \
          tests/test_refill_schedule.py tests/test_chunk_time.py tests/test_engine_profile.py \
          tests/test_trainer_refill.py "${extra[@]}" ;;
  8k-sparse|8k-dense)
    rollout --phase refill "${mix8k[@]}" --modes "${part#8k-}" --out "$OUT/refill_$part.json" ;;
  model-8k)
    merge "$OUT/refill_8k.json" "${SPARSE_8K:-$IN/refill_8k-sparse.json}" \
      "${DENSE_8K:-$IN/refill_8k-dense.json}"
    rollout --phase refill-model "${mix8k[@]}" "${model[@]}" --refill-json "$OUT/refill_8k.json" \
      --out "$OUT/refill_model_8k.json" ;;
  model-32k-sparse|model-32k-dense)
    rollout --phase refill-model "${mix32k[@]}" "${model[@]}" --modes "${part#model-32k-}" \
      --out "$OUT/refill_$part.json" ;;
  grpo-32k)
    # One schedule: training is the same dense work after either rollout, and each 32K
    # rollout of the few rows takes minutes (dense and sparse did not fit one call).
    # TRAINING=<an earlier grpo_32k.json>: composed from its training, no trainer run (off a
    # GPU, call bench_grpo.py with these arguments and --training-json directly).
    python3 scripts/bench_grpo.py --prompts 1 --samples 2 --max-new 32768 --steps 2 \
      --schedules paper:qwen3-1.7b --micro-batch 2 \
      ${TRAINING:+--training-json "$TRAINING"} \
      --rollout-model "${SPARSE_32K:-$IN/refill_model-32k-sparse.json}" \
      "${DENSE_32K:-$IN/refill_model-32k-dense.json}" --out "$OUT/grpo_32k.json" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
