"""What-ifs on the 32K refill model measured on the H100 at eacbcd3 with tail narrowing
(2026-11-25b_refill_model_32k_{sparse,dense}.json): the same refill chunks (replayed on the host,
as bench_rollout.py --phase refill-model does; checked: the unchanged case equals the JSON)
priced with the sparse per-step term A at each slot count's narrowest table ("width free", what
f0b734d aims at), and with every per-step term lowered by 0.3 ms in both modes (the top-k by
group maxima of b99eda4, whose two-stage predecessor the profile put at ~0.36 ms a step at 48
rows). Estimates, not measurements.

    JAX_PLATFORMS=cpu PYTHONPATH=.:scripts python notes/bench_runs/2026-11-25b_whatif.py
"""
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


def points(rows):
    return [(r["mean_context"], r["table_width"], r["step_ms"]) for r in rows]


seconds = {}
for mode in ("sparse", "dense"):
    with open(os.path.join(HERE, f"2026-11-25b_refill_model_32k_{mode}.json")) as f:
        run = json.load(f)
    entry = run["modes"][mode]
    rc = rollout_config(CAP)
    caps = length_mix(run["length_mix"], run["rows"], CAP, seed=0)
    lengths = np.full(run["rows"], PROMPT)
    width = -(-(prompt_width(lengths, rc) + CAP) // rc.page_size)
    chunks = simulate_refill(lengths, caps, n=1, slots=run["slots"], num_pages=run["num_pages"],
                             page_size=rc.page_size, steps_per_call=rc.steps_per_call,
                             width=width, prefill_rows=PREFILL_ROWS,
                             table_bucket_pages=rc.table_bucket_pages, page_seed=rc.page_seed,
                             tail_slots=8)[0]
    static = SlotStepTimes.from_points(run["batch"], [tuple(x) for x in entry["static"]["short"]],
                                       points(entry["per_row"]), lone=points(entry["lone_row"]))
    shorts = {run["slots"]: entry["refill"]["short"]}
    shorts |= {int(k): v for k, v in entry["refill"]["tail_short"].items()}
    for saving in (0.0, 0.3):
        for width_free in (False, True):
            def term(short):
                short = sorted(tuple(x) for x in short)
                flat = width_free and mode == "sparse"
                return [(w, (short[0][1] if flat else ms) - saving) for w, ms in short]
            times = {k: static.with_slots(k, term(v)) for k, v in shorts.items()}
            seconds[mode, saving, width_free] = predict_seconds(chunks, times)
    assert abs(seconds[mode, 0.0, False] / entry["refill"]["seconds"] - 1) < 1e-6

for saving in (0.0, 0.3):
    for width_free in (False, True):
        s, d = seconds["sparse", saving, width_free], seconds["dense", saving, width_free]
        print(f"per-step saving {saving} ms, sparse width cost flat {width_free}: sparse refill "
              f"{s:.1f} s, dense {d:.1f} s, sparse/dense {d / s:.2f}x")
