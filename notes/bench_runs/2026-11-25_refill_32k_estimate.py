"""An estimate, before any 32K measurement, of what issue 17's 32K targets can reach: the refill
replay (simulate_refill) and the static engine's chunks (static_chunks) of the 32K mix priced
with the step times of the 2026-11-22 H100 rollout profile (run D, batch 19, BENCHMARKS.md:
Rollout), not with the refill model's own measurements. The lone-row term g is a guess (dense:
1.3x a batch row's cost; sparse: 0 at 128 tokens to 1.17 ms at 8K, as measured at 8K, and
1.6 ms at 32K); each slot past 19 is guessed to add 0.004 ms to the per-step term.

    JAX_PLATFORMS=cpu PYTHONPATH=.:scripts python notes/bench_runs/2026-11-25_refill_32k_estimate.py
"""
import numpy as np

from bench_rollout import rollout_config
from sparrow_jax.attention.allocator import pages_needed
from sparrow_jax.rollout.chunk_time import SlotStepTimes, predict_seconds, static_chunks
from sparrow_jax.rollout.engine import prompt_width
from sparrow_jax.rollout.length_mix import length_mix
from sparrow_jax.rollout.refill_schedule import simulate_refill

CAP, ROWS, BATCH, PROMPT = 32768, 152, 19, 32          # scripts/refill_gpu.sh, model-32k-*
CONTEXTS = np.array([128, 2048, 4096, 8192, 16384, 32768.])
RUN_D_MS = {"dense": np.array([3.09, 4.99, 6.91, 10.69, 18.22, 32.24]),
            "sparse": np.array([3.06, 4.22, 4.97, 6.05, 8.72, 11.40])}

rc = rollout_config(CAP)
p, c = rc.page_size, rc.steps_per_call
pool = int(pages_needed(np.array([PROMPT]), 1, CAP, p)[0] * BATCH + 1)
caps = length_mix("lognormal", ROWS, CAP, seed=0)
lengths = np.full(ROWS, PROMPT)
width = -(-(prompt_width(lengths, rc) + CAP) // p)
print(f"pool {pool} pages, {caps.sum()} tokens, mean cap {caps.mean():.0f}")
static = static_chunks(lengths, caps, batch=BATCH, page_size=p, steps_per_call=c, width=width,
                       table_bucket_pages=rc.table_bucket_pages)
times = {}
for mode, ms in RUN_D_MS.items():
    full = [(int(x), width, float(t)) for x, t in zip(CONTEXTS, ms)]
    lone = ms[0] + (1.3 * (ms - ms[0]) / BATCH if mode == "dense"
                    else np.interp(CONTEXTS, [128, 8192, 32768], [0.0, 1.17, 1.6]))
    times[mode] = SlotStepTimes.from_points(BATCH, [(width, ms[0])], full,
                                            [(int(x), width, float(t))
                                             for x, t in zip(CONTEXTS, lone)])
for slots in (32, 48, 64):
    chunks, stats = simulate_refill(lengths, caps, n=1, slots=slots, num_pages=pool,
                                    page_size=p, steps_per_call=c, width=width, prefill_rows=16,
                                    table_bucket_pages=rc.table_bucket_pages,
                                    page_seed=rc.page_seed)
    decoded = sum(ch["steps"] * len(ch["contexts"]) for ch in chunks)
    steps = sum(ch["steps"] for ch in chunks)
    refill_s = {}
    for mode, t in times.items():
        tr = t.with_slots(slots, [(width, RUN_D_MS[mode][0] + 0.004 * (slots - BATCH))])
        st, rf = predict_seconds(static, t), predict_seconds(chunks, tr)
        refill_s[mode] = rf
        bound = st / predict_seconds(chunks, tr.rows_only())
        print(f"{slots} slots {mode}: static {st:.0f} s, refill {rf:.0f} s, refill/static "
              f"{st / rf:.2f}x (at most {bound:.2f}x)")
    print(f"{slots} slots: sparse/dense refill {refill_s['dense'] / refill_s['sparse']:.2f}x; "
          f"{steps} steps, {stats.preemptions} preemptions, decoded / needed tokens "
          f"{decoded / caps.sum():.3f}")
