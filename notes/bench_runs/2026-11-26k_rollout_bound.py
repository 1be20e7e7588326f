"""Issue 18's rollout target (0-32K at batch 19, sparse/dense >= 2.8x) against the read floor,
from the H100 profile at 1374ccb (2026-11-26i_rollout_profile.json, rollout run K): each mode's
0-32K generation integrated as bench_rollout.py does (step times interpolated between the
measured contexts), split into the step without attention (the profile's `split`, measured at
context 128) and the rest, each beside its floor (bytes at the run's read ceiling).

    python3 notes/bench_runs/2026-11-26k_rollout_bound.py [CEILING_GB_S]

CEILING_GB_S (2026-11-28): the floors at another read ceiling than the run's own (a single
reduction timed alone, which reads 14-19% low; 3140 is the ceiling timed as calls in a chain,
sparse decode kernel run W).
"""
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "2026-11-26i_rollout_profile.json")) as f:
    run = json.load(f)
ceiling = float(sys.argv[1]) if len(sys.argv) > 1 else run["read_ceiling_gb_s"]
scale = run["read_ceiling_gb_s"] / ceiling       # the floors, bytes over the ceiling
steps = np.arange(1, run["max_new"] + 1)
weights_ms = run["weight_bytes"] / (ceiling * 1e9) * 1e3
fixed_ms = run["split"]["no_attention"]
total, floor = {}, {}
for mode in ("dense", "sparse"):
    rows = run["modes"][mode]["rows"]
    ctx = [r["mean_context"] for r in rows]
    total[mode] = np.interp(steps, ctx, [r["step_ms"] for r in rows]).sum() / 1e3
    floor[mode] = np.interp(steps, ctx, [r["floor_ms"] * scale for r in rows]).sum() / 1e3
n = len(steps) / 1e3
print(f"read ceiling {ceiling:.0f} GB/s; the step without attention "
      f"{fixed_ms:.3f} ms, its weights' floor {weights_ms:.3f} ms")
for mode in total:
    att, att_floor = total[mode] - n * fixed_ms, floor[mode] - n * weights_ms
    print(f"{mode}: {total[mode]:.1f} s (floor {floor[mode]:.1f} s, {floor[mode] / total[mode]:.0%});"
          f" attention part {att:.1f} s (floor {att_floor:.1f} s, {att_floor / att:.0%})")
d, s = total["dense"], total["sparse"]
print(f"sparse/dense {d / s:.3f}x; sparse at its floor {d / floor['sparse']:.3f}x")
s_att_floor = s - (total["sparse"] - n * fixed_ms) + (floor["sparse"] - n * weights_ms)
print(f"sparse attention at its floor, the rest as measured: {d / s_att_floor:.3f}x")
need = 2.8
# Savings c a step common to both modes: (d - n c) / (s - n c) = need.
c = (need * s - d) / (n * (need - 1))
print(f"{need}x from a saving common to both modes needs {c:.3f} ms a step "
      f"(the step without attention is {fixed_ms - weights_ms:.3f} ms over its weights' floor)")
c2 = (need * s_att_floor - d) / (n * (need - 1))
print(f"with the sparse attention at its floor, {need}x needs {c2:.3f} ms a step more, common")
