"""GRPO step benchmark: a few steps of :class:`sparrow_jax.rl.trainer.Trainer` on the GPU with
sparse rollouts and long responses, and the time split rollout / dense recompute / update.

The policy is a preset architecture with random weights (float32 masters, bfloat16 compute, as
the trainer loads it); prompts are the built-in needle task (192-256 tokens); no EOS
(``rollout.eos_ids: []``), so every response runs to ``--max-new`` tokens. The reward
does not matter here (a random policy scores ~0, so advantages are ~0; the update still runs
its full forward and backward). Steps are run through ``Trainer.train_step`` (no checkpoints,
metrics written as JSONL by this script); the first step includes compilation, which the
monitoring events of JAX time separately (``compile_s``).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. python3 scripts/bench_grpo.py \
        --out $OUT/grpo.json

``--no-fuse`` runs the dense recompute as its own pass instead of fusing it into the first
mini-batch's forward (docs/design.md, section 7). CPU smoke test: ``--model tiny --max-new 64
--steps 2``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time

import jax

from sparrow_jax.benchmarking import peak_bytes
from sparrow_jax.data import DataConfig
from sparrow_jax.rl.config import ModelSpec, RolloutSettings, TrainConfig, UpdateConfig
from sparrow_jax.rl.trainer import Trainer

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_seconds = [0.0]


def _on_event(event, duration, **_):
    if event in _COMPILE_EVENTS:
        _compile_seconds[0] += duration


jax.monitoring.register_event_duration_secs_listener(_on_event)

KEYS = ("time_rollout", "time_recompute", "time_update", "tokens_per_s", "response_length_mean",
        "sparse_step_fraction", "alpha_paper_mean", "alpha_topk_bound_mean", "reward_mean")


def schedule_spec(name: str):
    """``paper:<model>``, ``fixed:<pages>`` or ``dense``."""
    if name == "dense":
        return None
    kind, _, value = name.partition(":")
    if kind == "paper":
        return {"paper": value}
    if kind == "fixed":
        return {"kind": "fixed", "pages": int(value)}
    raise SystemExit(f"--schedule: paper:<model>, fixed:<pages> or dense, got {name!r}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-1.7b", help="a preset of configs/models")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--schedule", default="paper:qwen3-1.7b")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=True,
                    help="fuse the dense recompute into the first mini-batch's forward")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype (float32 on CPU)")
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="bench_grpo_")
    config = TrainConfig(
        run_dir=run_dir, steps=args.steps,
        model=ModelSpec(preset=args.model, dtype=args.dtype),
        data=DataConfig(task="needle", prompts_per_step=args.prompts),
        rollout=RolloutSettings(samples_per_prompt=args.samples, max_new_tokens=args.max_new,
                                temperature=1.0, eos_ids=()),
        schedule=schedule_spec(args.schedule),
        update=UpdateConfig(micro_batch_size=args.micro_batch, fuse_recompute=args.fuse),
        checkpoint_every=10 ** 6, tensorboard=False, progress=False)
    dev = jax.devices()[0]
    print(f"device {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}; "
          f"{args.model}, {args.prompts} x {args.samples} rows, {args.max_new} new tokens, "
          f"schedule {args.schedule}, fuse_recompute={args.fuse}", flush=True)
    t0 = time.perf_counter()
    c0 = _compile_seconds[0]
    trainer = Trainer(config)
    setup_s = time.perf_counter() - t0
    out = dict(argv=sys.argv[1:], device=dev.device_kind, backend=jax.default_backend(),
               jax=jax.__version__, date=datetime.date.today().isoformat(), model=args.model,
               rows=args.prompts * args.samples, max_new=args.max_new, schedule=args.schedule,
               fuse_recompute=args.fuse, micro_batch=args.micro_batch, setup_s=setup_s,
               setup_compile_s=_compile_seconds[0] - c0, steps=[])
    try:
        for step in range(args.steps):
            c0 = _compile_seconds[0]
            t0 = time.perf_counter()
            metrics = trainer.train_step()
            wall = time.perf_counter() - t0
            row = {k: metrics.get(k) for k in KEYS}
            row.update(step=step, wall_s=wall, compile_s=_compile_seconds[0] - c0,
                       response_tokens=metrics["response_length_mean"] * out["rows"],
                       peak_bytes=peak_bytes())
            out["steps"].append(row)
            print(f"step {step}: rollout {row['time_rollout']:.2f} s, recompute "
                  f"{row['time_recompute']:.2f} s, update {row['time_update']:.2f} s, wall "
                  f"{wall:.2f} s (compile {row['compile_s']:.1f} s), rollout "
                  f"{row['tokens_per_s']:.0f} tokens/s, sparse steps "
                  f"{row['sparse_step_fraction']:.2f}, alpha(paper) "
                  f"{row['alpha_paper_mean']:.3f}", flush=True)
            with open(f"{run_dir}/bench_metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
    finally:
        timed = [r for r in out["steps"] if r["step"] > 0] or out["steps"]
        if timed:
            mean = {k: statistics.mean(r[k] for r in timed)
                    for k in ("time_rollout", "time_recompute", "time_update", "wall_s",
                              "tokens_per_s", "response_tokens")}
            mean["step_tokens_per_s"] = mean["response_tokens"] / mean["wall_s"]
            out["mean_after_first"] = mean
        out["peak_bytes"] = peak_bytes()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    m = out["mean_after_first"]
    print(f"\n{args.model}, {out['rows']} rows x {args.max_new} tokens, {args.schedule}, "
          f"fuse_recompute={args.fuse}; mean of steps 1..{args.steps - 1}:")
    print("| rollout s | recompute s | update s | step wall s | rollout tokens/s | "
          "step tokens/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| {m['time_rollout']:.2f} | {m['time_recompute']:.2f} | {m['time_update']:.2f} | "
          f"{m['wall_s']:.2f} | {m['tokens_per_s']:.0f} | {m['step_tokens_per_s']:.0f} |")
    if out["peak_bytes"]:
        print(f"peak device memory {out['peak_bytes'] / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
