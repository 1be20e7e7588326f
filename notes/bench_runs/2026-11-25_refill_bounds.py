"""What bounds issue 17's missed refill targets, from the H100 step times measured on
2026-11-25 (scripts/refill_gpu.sh model-8k, model-32k-sparse, model-32k-dense; their JSON
beside this file). The chunks of both runs are replayed on the host exactly as
bench_rollout.py --phase refill-model replays them (checked: the predictions below equal the
JSON's), then priced with the measured step times (sparrow_jax.rollout.chunk_time) under
three what-ifs:

- any admission order: the rows' own cost (their K/V reads and per-row work, `rows_only`) is
  paid whatever the slots and order (static / rows_only bounds refill/static for any slot
  count); with the run's slot count, each step also costs at least the per-step term A at
  the narrowest table it uses, and there are at least as many steps as the longest cap. So
  refill takes at least rows_only + max(caps) x min A, and static / that bounds refill/static
  for these slots in any order.
- free sparse attention: the sparse run with every row priced at the shortest measured
  context (its attention at ~128 tokens), which bounds sparse/dense for any sparse kernel.
- the table's width free: the sparse run with the per-step term A at the narrowest table
  (what a step of short rows costs in a 256-page table) whatever the chunk's width. Where a
  long row widens a chunk's table, every row's scoring and selection cover that width today.
- slot buckets: each refill chunk's per-step term at the smallest of 8, 16, 32 slots that
  holds its running rows (as if the running rows were moved into a narrower batch once the
  queue is empty), with A at S slots interpolated linearly in S between the two slot counts
  measured (the static batch's and refill's), an extrapolation below the static batch.
- both: slot buckets with each bucket's A at the narrowest table.
- other slot counts (8K): the replay at 48 .. 128 slots in the same pool, each chunk's
  per-step term linear in the slot count as above.
- the GRPO step: the refill rollouts plus training (dense recompute + update) at the seconds
  per response token measured at 32K (scripts/refill_gpu.sh grpo-32k, step 1 of the sparse
  schedule; that call ran out of time in the dense schedule, see its log). Training does not
  depend on the rollout's schedule: both recompute the same dense log-probs and run the same
  update. Priced at 32K per token (attention grows with length), so the training share is an
  over-estimate for the mix, whose mean response is shorter: the ratio is a lower bound.

    JAX_PLATFORMS=cpu PYTHONPATH=.:scripts python notes/bench_runs/2026-11-25_refill_bounds.py
"""
import dataclasses
import json
import os

import numpy as np

from bench_rollout import rollout_config
from sparrow_jax.rollout.chunk_time import SlotStepTimes, predict_seconds, static_chunks
from sparrow_jax.rollout.engine import prompt_width
from sparrow_jax.rollout.length_mix import length_mix
from sparrow_jax.rollout.refill_schedule import simulate_refill

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = {8192: {"sparse": "2026-11-25_refill_model_8k_160.json",
               "dense": "2026-11-25_refill_model_8k_160.json"},
        32768: {"sparse": "2026-11-25_refill_model_32k_sparse.json",
                "dense": "2026-11-25_refill_model_32k_dense.json"}}
PROMPT, PREFILL_ROWS = 32, 16
# grpo-32k, sparse schedule, step 1 (2 rows x 32768 tokens): recompute 0.02 s (fused into the
# update's first forward), update 4.47 s (2026-11-25_grpo_32k_partial.log).
TRAIN_S_PER_TOKEN = (0.02 + 4.47) / (2 * 32768)


def points(rows):
    return [(r["mean_context"], r["table_width"], r["step_ms"]) for r in rows]


def times_of(entry, batch, slots):
    static = SlotStepTimes.from_points(batch, [tuple(x) for x in entry["static"]["short"]],
                                       points(entry["per_row"]), lone=points(entry["lone_row"]))
    return static, static.with_slots(slots, [tuple(x) for x in entry["refill"]["short"]])


def free_attention(t: SlotStepTimes) -> SlotStepTimes:
    """``t`` with every context's per-row and lone-row cost at the shortest measured one."""
    return SlotStepTimes(t.slots, t.widths, t.width_ms, t.contexts,
                         np.full_like(t.row_ms, t.row_ms[0]),
                         np.full_like(t.lone_ms, t.lone_ms[0]))


def own_cost(chunks, times: SlotStepTimes) -> float:
    """The rows' own seconds in ``chunks`` (no per-step term)."""
    return predict_seconds(chunks, times.rows_only())


def slot_term(entry, batch, slots, chunk, size=None, narrow=False) -> float:
    """A (ms) for ``chunk`` run on ``size`` slots (default: the smallest bucket of 8, 16, 32
    slots holding its rows, the full slot count otherwise), linear in the slot count between
    the measured two (``batch`` and ``slots``); ``narrow``: at the narrowest table's."""
    running = len(chunk["contexts"])
    size = size or next((b for b in (8, 16, 32) if running <= b < slots), slots)
    at = {}
    for name in ("static", "refill"):
        widths, ms = zip(*sorted(tuple(x) for x in entry[name]["short"]))
        at[name] = ms[0] if narrow else np.interp(chunk["width"], widths, ms)
    return at["static"] + (at["refill"] - at["static"]) * (size - batch) / (slots - batch)


for cap, files in RUNS.items():
    runs = {m: json.load(open(os.path.join(HERE, f))) for m, f in files.items()}
    meta = runs["sparse"]
    rows, batch, slots, pool = meta["rows"], meta["batch"], meta["slots"], meta["num_pages"]
    rc = rollout_config(cap)
    p, c = rc.page_size, rc.steps_per_call
    caps = length_mix(meta["length_mix"], rows, cap, seed=0)
    lengths = np.full(rows, PROMPT)
    width = -(-(prompt_width(lengths, rc) + cap) // p)
    refill, stats = simulate_refill(lengths, caps, n=1, slots=slots, num_pages=pool, page_size=p,
                                    steps_per_call=c, width=width, prefill_rows=PREFILL_ROWS,
                                    table_bucket_pages=rc.table_bucket_pages,
                                    page_seed=rc.page_seed)
    static = static_chunks(lengths, caps, batch=batch, page_size=p, steps_per_call=c,
                           width=width, table_bucket_pages=rc.table_bucket_pages)
    steps = sum(ch["steps"] for ch in refill)
    print(f"cap {cap}: {rows} rows, {caps.sum()} tokens, static batches of {batch}, refill "
          f"{slots} slots, pool {pool} pages; refill {steps} steps ({max(caps)} at least), "
          f"{stats.preemptions} preemptions")
    seconds = {}
    for mode, run in runs.items():
        entry = run["modes"][mode]
        t_static, t_refill = times_of(entry, batch, slots)
        st, rf = predict_seconds(static, t_static), predict_seconds(refill, t_refill)
        for name, got in (("static", st), ("refill", rf)):
            assert abs(got / entry[name]["seconds"] - 1) < 1e-6, (mode, name, got)
        own = own_cost(refill, t_refill)
        floor = own + max(caps) * t_refill.width_ms.min() / 1e3
        measured = {k: f"{entry[k]['measured_s']:.1f}" if "measured_s" in entry[k] else "-"
                    for k in ("static", "refill")}
        seconds[mode] = rf
        print(f"  {mode}: static {st:.1f} s, refill {rf:.1f} s (measured "
              f"{measured['static']} / {measured['refill']}): {st / rf:.2f}x; "
              f"rows' own cost {own:.1f} s (at most {st / own:.2f}x, any slots), + "
              f"{max(caps)} steps at A {floor - own:.1f} s -> at most {st / floor:.2f}x with "
              f"{slots} slots, any order")
        bucketed = own + sum(ch["steps"] * slot_term(entry, batch, slots, ch)
                             for ch in refill if ch["steps"]) / 1e3
        both = own + sum(ch["steps"] * slot_term(entry, batch, slots, ch, narrow=True)
                         for ch in refill if ch["steps"]) / 1e3
        print(f"  {mode}: with slot buckets refill {bucketed:.1f} s, {st / bucketed:.2f}x; "
              f"and the table's width free as well {both:.1f} s, {st / both:.2f}x")
        seconds[mode + "_buckets"], seconds[mode + "_both"] = bucketed, both
        if cap == 8192:
            sweep = []
            for alt in (48, 64, 80, 96, 128):
                chunks = simulate_refill(lengths, caps, n=1, slots=alt, num_pages=pool,
                                         page_size=p, steps_per_call=c, width=width,
                                         prefill_rows=PREFILL_ROWS,
                                         table_bucket_pages=rc.table_bucket_pages,
                                         page_seed=rc.page_seed)[0]
                alt_s = own_cost(chunks, t_refill) + sum(
                    ch["steps"] * slot_term(entry, batch, slots, ch, size=alt)
                    for ch in chunks if ch["steps"]) / 1e3
                sweep.append(f"{alt}: {st / alt_s:.2f}x")
            print(f"  {mode}: refill/static by slot count, same pool: {', '.join(sweep)}")
        if mode == "sparse":
            seconds["sparse_free"] = predict_seconds(refill, free_attention(t_refill))
            narrow = dataclasses.replace(t_refill, width_ms=np.full_like(
                t_refill.width_ms, t_refill.width_ms.min()))
            seconds["sparse_narrow"] = predict_seconds(refill, narrow)
            print(f"  sparse per-step term A by table width {dict(zip(t_refill.widths.astype(int).tolist(), t_refill.width_ms.round(2).tolist()))} ms")
    d, s, f, n = (seconds[k] for k in ("dense", "sparse", "sparse_free", "sparse_narrow"))
    print(f"  sparse/dense refill {d / s:.2f}x; with sparse attention free {d / f:.2f}x "
          f"(sparse {f:.1f} s); with the table's width free (A at its narrowest) "
          f"{d / n:.2f}x (sparse {n:.1f} s)")
    print(f"  sparse/dense refill with slot buckets "
          f"{seconds['dense_buckets'] / seconds['sparse_buckets']:.2f}x; and the table's width "
          f"free as well {seconds['dense_both'] / seconds['sparse_both']:.2f}x")
    if cap == 32768:
        train = TRAIN_S_PER_TOKEN * caps.sum()
        print(f"  GRPO step: training {train:.1f} s ({TRAIN_S_PER_TOKEN * 1e6:.1f} us a token); "
              f"sparse {s + train:.1f} s, dense {d + train:.1f} s: {(d + train) / (s + train):.2f}x"
              f"; with sparse attention free {(d + train) / (f + train):.2f}x")
