"""The engine's decode step with its Pallas kernels launched by XLA, or by our own launcher as
chains (pallas_kernels/cubin_chain.py), without and with programmatic dependent launch: step
time at fixed contexts, CUDA graphs on (as the engine runs). GPU only.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=. python3 scripts/bench_step_chain.py \
        --rows 19 --contexts 2048 16384 --out $OUT/step_chain.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import cubin_chain
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rollout import decode_loop
from sparrow_jax.rollout.engine import RolloutConfig
from sparrow_jax.rollout.profile import fixed_context_batch, time_context
from sparrow_jax.schedule import BudgetSchedule

ORIGINAL = decode_loop.decode_step


def chained_step(pdl: bool):
    """decode_step with its kernels as chains (the model's params traced as arguments)."""
    def step(model, cache, tokens, *, budget_pages=None, active=None, **kw):
        graphdef, params = nnx.split(model)

        def f(params, cache, tokens, budget_pages, active):
            return ORIGINAL(nnx.merge(graphdef, params), cache, tokens,
                            budget_pages=budget_pages, active=active, **kw)

        return cubin_chain.as_chain(f, pdl=pdl)(params, cache, tokens, budget_pages, active)
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--rows", type=int, default=19)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--modes", nargs="+", default=["sparse", "dense"])
    ap.add_argument("--variants", nargs="+", default=["xla", "chain", "chain_pdl"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", help="float32 for CPU smoke runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = ModelConfig.preset(args.model)
    dtype = jnp.dtype(args.dtype)
    model = init_model(cfg, dtype=dtype, param_dtype=dtype)
    steps = 64
    rc = RolloutConfig(n=1, max_new_tokens=32768, temperature=1.0, eos_ids=(),
                       table_bucket_pages=256, steps_per_call=steps, cache_dtype=dtype.name)
    rows = []
    for mode in args.modes:
        schedule = BudgetSchedule.paper("qwen3-1.7b") if mode == "sparse" else None
        span = steps * (args.repeats + 3)
        batch, graphdef, params, state = fixed_context_batch(
            model, rc, rows=args.rows, prompt_len=32, key=jax.random.key(0), schedule=schedule,
            max_context=max(args.contexts) + span)
        for variant in args.variants:
            decode_loop.decode_step = (ORIGINAL if variant == "xla" else
                                       chained_step(pdl=variant == "chain_pdl"))
            jax.clear_caches()
            for ctx in args.contexts:
                t0 = time.perf_counter()
                try:
                    state, _ = time_context(batch, graphdef, params, state, ctx,
                                            repeats=args.repeats)
                    state, timed = time_context(batch, graphdef, params, state, ctx,
                                                repeats=args.repeats)
                except Exception as e:  # a variant that fails is a result too
                    print(f"{mode} {variant} ctx {ctx}: FAILED {type(e).__name__}: "
                          f"{str(e)[:1500]}", flush=True)
                    continue
                row = dict(mode=mode, variant=variant, context=timed.mean_context,
                           rows=args.rows, step_us=[1e6 * t for t in timed.step_seconds],
                           best_us=1e6 * min(timed.step_seconds),
                           wall_s=time.perf_counter() - t0)
                rows.append(row)
                print(json.dumps(row), flush=True)
        decode_loop.decode_step = ORIGINAL
        del batch, params, state
    print(f"\n{jax.devices()[0].device_kind}, {args.model}, {args.rows} rows, graphs on")
    print("| mode | context | " + " | ".join(f"{v} us a step" for v in args.variants) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in args.variants) + " |")
    for mode in args.modes:
        for ctx in sorted({r["context"] for r in rows if r["mode"] == mode}):
            here = {r["variant"]: r["best_us"] for r in rows
                    if r["mode"] == mode and r["context"] == ctx}
            print(f"| {mode} | {ctx:.0f} | "
                  + " | ".join(f"{here.get(v, float('nan')):.0f}" for v in args.variants) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, argv=sys.argv[1:], rows=rows),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
