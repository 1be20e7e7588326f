"""The 32K refill model's seconds split by term (docs/design.md, section 11: t = A + g(c_1) +
sum h(c_i)), from the H100 runs at 74d42e7 (2026-11-26e_refill_model-32k-{sparse,dense}.json),
and one what-if: the sparse refill priced with the lone-row term g of the balanced-splits run
(2026-11-26e_balanced_refill_model-32k-sparse.json), A and h kept from 74d42e7's. An estimate,
not a measurement: the balanced splits as measured also raised A (BENCHMARKS.md, run N).

    JAX_PLATFORMS=cpu PYTHONPATH=.:scripts python notes/bench_runs/2026-11-26e_refill_terms.py
"""
import dataclasses
import json
import os

import numpy as np

from bench_rollout import rollout_config
from sparrow_jax.rollout.chunk_time import SlotStepTimes, predict_seconds
from sparrow_jax.rollout.engine import prompt_width
from sparrow_jax.rollout.length_mix import length_mix
from sparrow_jax.rollout.refill_schedule import simulate_refill

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT, PREFILL_ROWS, CAP = 32, 16, 32768
TRAINING_S = 131.9      # recompute + update at 69.5 us a token (2026-11-25b_grpo_32k.json)


def points(rows):
    return [(r["mean_context"], r["table_width"], r["step_ms"]) for r in rows]


def load(name, mode):
    with open(os.path.join(HERE, name)) as f:
        run = json.load(f)
    e = run["modes"][mode]
    static = SlotStepTimes.from_points(run["batch"], [tuple(x) for x in e["static"]["short"]],
                                       points(e["per_row"]), lone=points(e["lone_row"]))
    shorts = {run["slots"]: e["refill"]["short"]}
    shorts |= {int(k): v for k, v in e["refill"]["tail_short"].items()}
    return run, static, shorts


def refill_chunks(run):
    rc = rollout_config(CAP)
    caps = length_mix(run["length_mix"], run["rows"], CAP, seed=0)
    lengths = np.full(run["rows"], PROMPT)
    width = -(-(prompt_width(lengths, rc) + CAP) // rc.page_size)
    return simulate_refill(lengths, caps, n=1, slots=run["slots"], num_pages=run["num_pages"],
                           page_size=rc.page_size, steps_per_call=rc.steps_per_call,
                           width=width, prefill_rows=PREFILL_ROWS,
                           table_bucket_pages=rc.table_bucket_pages, page_seed=rc.page_seed,
                           tail_slots=8)[0]


def terms(chunks, static, shorts):
    times = {k: static.with_slots(k, [tuple(x) for x in v]) for k, v in shorts.items()}
    live = [c for c in chunks if c["steps"]]
    a = sum(c["steps"] * np.interp(c["width"], times[c["slots"]].widths,
                                   times[c["slots"]].width_ms) for c in live) / 1e3
    g = sum(c["steps"] * np.interp(max(np.asarray(c["contexts"]) + c["steps"] / 2),
                                   static.contexts, static.lone_ms)
            for c in live if len(c["contexts"])) / 1e3
    total = predict_seconds(chunks, times)
    return total, a, g, total - a - g


seconds = {}
for mode in ("sparse", "dense"):
    run, static, shorts = load(f"2026-11-26e_refill_model-32k-{mode}.json", mode)
    chunks = refill_chunks(run)
    total, a, g, h = terms(chunks, static, shorts)
    assert abs(total / run["modes"][mode]["refill"]["seconds"] - 1) < 1e-6
    seconds[mode] = total
    print(f"{mode} refill {total:.1f} s: A {a:.1f} s, g {g:.1f} s, h {h:.1f} s "
          f"({sum(c['steps'] for c in chunks)} steps)")
    print(f"  contexts {static.contexts.astype(int).tolist()}")
    print(f"  g ms {np.round(static.lone_ms, 3).tolist()}")
    print(f"  h ms {np.round(static.row_ms, 3).tolist()}")

run, static, shorts = load("2026-11-26e_refill_model-32k-sparse.json", "sparse")
_, balanced, _ = load("2026-11-26e_balanced_refill_model-32k-sparse.json", "sparse")
print(f"  g ms, balanced splits {np.round(balanced.lone_ms, 3).tolist()}")
total, a, g, h = terms(refill_chunks(run), dataclasses.replace(static, lone_ms=balanced.lone_ms),
                       shorts)
d = seconds["dense"]
print(f"what-if, sparse with the balanced run's g: refill {total:.1f} s (g {g:.1f} s), "
      f"sparse/dense {d / total:.2f}x, GRPO step {(d + TRAINING_S) / (total + TRAINING_S):.2f}x "
      f"(measured: {d / seconds['sparse']:.2f}x, "
      f"{(d + TRAINING_S) / (seconds['sparse'] + TRAINING_S):.2f}x)")
