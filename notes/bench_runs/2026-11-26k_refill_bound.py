"""What bounds issue 17's 32K sparse/dense target, from the H100 runs at 8f80e11
(2026-11-26k_refill_model-32k-{sparse,dense}.json; docs/design.md, section 11: a step costs
A(width) + g(longest row) + sum h(other rows)).

1. The rows' own cost h against its read floor: a sparse row reads, a step, K and V of every
   token in the two dense layers, and in each of the 26 sparse layers its budget's pages of K
   and V plus the centroid of every page; a dense row K and V of every token in all 28 layers
   (bf16, 8 KV heads of 128). The floor is those bytes at the run's measured read ceiling.
2. The 32K model re-priced with the per-step term A shifted by the same amount in both modes
   and every slot count (the rows' costs g and h as measured): refill/static and sparse/dense
   as A moves.

    JAX_PLATFORMS=cpu PYTHONPATH=.:scripts python notes/bench_runs/2026-11-26k_refill_bound.py
"""
import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np

from bench_rollout import rollout_config
from sparrow_jax.rollout.chunk_time import SlotStepTimes, predict_seconds, static_chunks
from sparrow_jax.rollout.engine import prompt_width
from sparrow_jax.rollout.length_mix import length_mix
from sparrow_jax.rollout.refill_schedule import simulate_refill
from sparrow_jax.schedule import BudgetSchedule

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT, PREFILL_ROWS, CAP = 32, 16, 32768
TRAINING_S = 131.9      # recompute + update at 69.5 us a token (2026-11-25b_grpo_32k.json)
LAYERS, DENSE_LAYERS, KV_HEADS, HEAD_DIM, PAGE = 28, 2, 8, 128, 16
KV_BYTES = KV_HEADS * HEAD_DIM * 2 * 2          # K and V of one token, one layer, bf16
CENTROID_BYTES = KV_HEADS * HEAD_DIM * 2        # one page's centroids, one layer


def points(rows):
    return [(r["mean_context"], r["table_width"], r["step_ms"]) for r in rows]


def load(mode):
    with open(os.path.join(HERE, f"2026-11-26k_refill_model-32k-{mode}.json")) as f:
        run = json.load(f)
    e = run["modes"][mode]
    static = SlotStepTimes.from_points(run["batch"], [tuple(x) for x in e["static"]["short"]],
                                       points(e["per_row"]), lone=points(e["lone_row"]))
    shorts = {run["slots"]: e["refill"]["short"]}
    shorts |= {int(k): v for k, v in e["refill"]["tail_short"].items()}
    return run, static, shorts


def runs_chunks(run):
    rc = rollout_config(CAP)
    caps = length_mix(run["length_mix"], run["rows"], CAP, seed=0)
    lengths = np.full(run["rows"], PROMPT)
    width = -(-(prompt_width(lengths, rc) + CAP) // rc.page_size)
    refill = simulate_refill(lengths, caps, n=1, slots=run["slots"], num_pages=run["num_pages"],
                             page_size=rc.page_size, steps_per_call=rc.steps_per_call,
                             width=width, prefill_rows=PREFILL_ROWS,
                             table_bucket_pages=rc.table_bucket_pages, page_seed=rc.page_seed,
                             tail_slots=8)[0]
    static = static_chunks(lengths, caps, batch=run["batch"], page_size=rc.page_size,
                           steps_per_call=rc.steps_per_call, width=width,
                           table_bucket_pages=rc.table_bucket_pages)
    return refill, static


def priced(mode, shift_ms):
    """(refill s, static s) with A shifted by ``shift_ms`` a step."""
    run, static, shorts = load(mode)
    moved = lambda t: dataclasses.replace(t, width_ms=t.width_ms + shift_ms)
    times = {k: moved(static.with_slots(k, [tuple(x) for x in v])) for k, v in shorts.items()}
    refill, static_run = runs_chunks(run)
    return predict_seconds(refill, times), predict_seconds(static_run, moved(static))


def row_floor_ms(contexts, mode, ceiling_gb_s):
    pages = np.ceil(contexts / PAGE)
    if mode == "dense":
        nbytes = LAYERS * contexts * KV_BYTES
    else:
        budget = np.asarray(BudgetSchedule.paper("qwen3-1.7b").budget_pages(
            jnp.asarray(contexts.astype(np.int32))))
        chosen = np.minimum(budget, pages)
        nbytes = (DENSE_LAYERS * contexts * KV_BYTES
                  + (LAYERS - DENSE_LAYERS) * (chosen * PAGE * KV_BYTES + pages * CENTROID_BYTES))
    return nbytes / (ceiling_gb_s * 1e9) * 1e3


for mode in ("sparse", "dense"):
    run, static, _ = load(mode)
    floor = row_floor_ms(static.contexts, mode, run["read_ceiling_gb_s"])
    print(f"{mode}: h, the rows' own cost a step (ms), against its read floor at "
          f"{run['read_ceiling_gb_s']:.0f} GB/s")
    for c, h, f in zip(static.contexts, static.row_ms, floor):
        print(f"  context {int(c):5d}: h {h:.4f}, floor {f:.4f} ({f / h:.0%} of h)")

base = {mode: priced(mode, 0.0) for mode in ("sparse", "dense")}
for mode in base:
    want = load(mode)[0]["modes"][mode]
    assert abs(base[mode][0] / want["refill"]["seconds"] - 1) < 1e-6
    assert abs(base[mode][1] / want["static"]["seconds"] - 1) < 1e-6
print("\nThe 32K model with A shifted in both modes (the rows' costs as measured):")
print("| A shift ms | sparse refill / static | dense refill / static | sparse / dense refill "
      "| GRPO step |")
print("| --- | --- | --- | --- | --- |")
for shift in (-1.0, -0.9, -0.6, -0.3, 0.0, 0.1, 0.3):
    (sr, ss), (dr, ds) = priced("sparse", shift), priced("dense", shift)
    print(f"| {shift:+.1f} | {ss / sr:.3f} | {ds / dr:.3f} | {dr / sr:.3f} | "
          f"{(dr + TRAINING_S) / (sr + TRAINING_S):.3f} |")


def crossing(fn, lo, hi, target):
    """The shift where fn (monotone) crosses target, by bisection."""
    up = fn(hi) > fn(lo)
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (fn(mid) < target) == up else (lo, mid)
    return (lo + hi) / 2


def sparse_ratio(s):
    return (lambda r, t: t / r)(*priced("sparse", s))


def speedup(s):
    return priced("dense", s)[0] / priced("sparse", s)[0]


need_refill = crossing(sparse_ratio, -1.5, 1.0, 2.0)
need_speedup = crossing(speedup, -1.5, 1.0, 2.5)
print(f"\nsparse refill/static >= 2.0 needs A shifted by >= {need_refill:+.3f} ms; "
      f"sparse/dense refill >= 2.5 needs A shifted by <= {need_speedup:+.3f} ms "
      f"(there, sparse refill/static is {sparse_ratio(need_speedup):.3f}).")

# The sparse step's A alone (its scoring, selection and merge launches are in A: a step of
# short rows runs them too), the dense run as measured.
dense_refill = base["dense"][0]
need_sparse_only = crossing(lambda s: dense_refill / priced("sparse", s)[0], -1.5, 1.0, 2.5)
print(f"sparse A alone: sparse/dense refill >= 2.5 needs it shifted by <= {need_sparse_only:+.3f} "
      f"ms (there, sparse refill/static is {sparse_ratio(need_sparse_only):.3f}).")
