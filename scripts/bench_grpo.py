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

``--length-mix lognormal`` (or ``uniform``) caps each prompt's responses at a length drawn from
``sparrow_jax.rollout.length_mix`` (per-prompt ``max_new_tokens``, a new draw each step)
instead of running every row to ``--max-new``. ``--schedules A B ..`` runs one trainer per
schedule, one after the other in this process (e.g. ``paper:qwen3-1.7b dense``: the sparse vs
dense GRPO step), and prints them side by side.

``--rollout-model FILE [FILE ..]`` (JSON of ``scripts/bench_rollout.py --phase refill-model``
of one length mix, e.g. its sparse and its dense run at a 32K cap): the GRPO step of that mix
for each of their modes, composed from the model's predicted refill rollout plus this run's
recompute and update seconds per response token (measured on the few rows run here, whatever
their schedule: training is the same dense work after either rollout) times the mix's tokens;
printed with the sparse/dense step ratio. ``--training-json FILE``: the training seconds from
an earlier run of this script (same model, the rollout model's cap) instead of running
trainers, so that new rollout figures compose on any machine, a CPU included.

``--no-fuse`` runs the dense recompute as its own pass instead of fusing it into the first
mini-batch's forward (docs/design.md, section 7). CPU smoke test: ``--tiny`` (the tiny model,
float32, 2 prompts x 4 samples, 64 new tokens, 2 steps).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. python3 scripts/bench_grpo.py \
        --prompts 16 --samples 8 --max-new 8192 --length-mix lognormal \
        --schedules paper:qwen3-1.7b dense --out $OUT/grpo_mix.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
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
from sparrow_jax.rollout.length_mix import KINDS, length_mix

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


def with_length_mix(rollout_fn, kind: str, cap: int, seed: int):
    """``rollout_fn`` with each prompt's responses capped at a length of the ``kind`` mix (a new
    draw per call)."""
    draws = itertools.count(seed)

    def capped(model, prompts, key, n, **extra):
        caps = length_mix(kind, len(prompts), cap, seed=next(draws))
        return rollout_fn(model, prompts, key, n, max_new_tokens=caps, **extra)

    return capped


def run_schedule(args, schedule: str) -> dict:
    """``args.steps`` trainer steps with ``schedule`` -> the figures of every step and their
    mean after the first (compiling) one."""
    # A fresh folder per run (a run folder refuses another run), under --run-dir if given.
    run_dir = tempfile.mkdtemp(prefix=f"bench_grpo_{schedule.replace(':', '-')}_",
                               dir=args.run_dir)
    config = TrainConfig(
        run_dir=run_dir, steps=args.steps,
        model=ModelSpec(preset=args.model, dtype=args.dtype),
        data=DataConfig(task="needle", prompts_per_step=args.prompts),
        rollout=RolloutSettings(samples_per_prompt=args.samples, max_new_tokens=args.max_new,
                                temperature=1.0, eos_ids=()),
        schedule=schedule_spec(schedule),
        update=UpdateConfig(micro_batch_size=args.micro_batch, fuse_recompute=args.fuse),
        checkpoint_every=10 ** 6, tensorboard=False, progress=False)
    print(f"{args.model}, {args.prompts} x {args.samples} rows, {args.max_new} new tokens "
          f"(length mix {args.length_mix}), schedule {schedule}, fuse_recompute={args.fuse}",
          flush=True)
    t0 = time.perf_counter()
    c0 = _compile_seconds[0]
    trainer = Trainer(config)
    if args.length_mix != "none":
        trainer.rollout_fn = with_length_mix(trainer.rollout_fn, args.length_mix, args.max_new,
                                             args.seed)
    out = dict(schedule=schedule, setup_s=time.perf_counter() - t0,
               setup_compile_s=_compile_seconds[0] - c0, steps=[])
    rows = args.prompts * args.samples
    for step in range(args.steps):
        c0 = _compile_seconds[0]
        t0 = time.perf_counter()
        metrics = trainer.train_step()
        wall = time.perf_counter() - t0
        row = {k: metrics.get(k) for k in KEYS}
        row.update(step=step, wall_s=wall, compile_s=_compile_seconds[0] - c0,
                   response_tokens=metrics["response_length_mean"] * rows,
                   peak_bytes=peak_bytes())
        out["steps"].append(row)
        print(f"step {step}: rollout {row['time_rollout']:.2f} s, recompute "
              f"{row['time_recompute']:.2f} s, update {row['time_update']:.2f} s, wall "
              f"{wall:.2f} s (compile {row['compile_s']:.1f} s), rollout "
              f"{row['tokens_per_s']:.0f} tokens/s, mean response "
              f"{row['response_length_mean']:.0f}, sparse steps "
              f"{row['sparse_step_fraction']:.2f}, alpha(paper) "
              f"{row['alpha_paper_mean']:.3f}", flush=True)
        with open(f"{run_dir}/bench_metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    timed = [r for r in out["steps"] if r["step"] > 0] or out["steps"]
    mean = {k: statistics.mean(r[k] for r in timed)
            for k in ("time_rollout", "time_recompute", "time_update", "wall_s", "tokens_per_s",
                      "response_tokens")}
    mean["step_tokens_per_s"] = mean["response_tokens"] / mean["wall_s"]
    out["mean_after_first"] = mean
    out["peak_bytes"] = peak_bytes()
    return out


def read_rollout_models(paths: list[str]) -> dict:
    """Refill-model JSONs of one length mix -> one, holding the modes of all (SystemExit naming
    the file, key and value where they are no such JSON or describe different mixes)."""
    merged = None
    for path in paths:
        try:
            with open(path) as f:
                model = json.load(f)
            missing = [k for k in ("tokens", "max_new", "rows", "slots", "modes") if k not in model]
        except (OSError, ValueError, TypeError) as e:
            raise SystemExit(f"--rollout-model {path}: {e}")
        if missing or not any("refill" in e for e in model["modes"].values()):
            raise SystemExit(f"--rollout-model {path}: not a bench_rollout.py --phase "
                             f"refill-model JSON (missing {missing or 'a refill run'})")
        if merged is None:
            merged, first = dict(model, modes=dict(model["modes"])), path
            continue
        for key in ("model", "tokens", "max_new", "rows", "batch", "slots", "num_pages",
                    "length_mix"):
            if model.get(key) != merged.get(key):
                raise SystemExit(f"--rollout-model {path}: {key} {model.get(key)!r}, but "
                                 f"{merged.get(key)!r} in {first}: not the same mix")
        for mode in model["modes"]:
            if mode in merged["modes"]:
                raise SystemExit(f"--rollout-model {path}: mode {mode!r} is in {first} too")
            merged["modes"][mode] = model["modes"][mode]
    return merged


def read_training(path: str, rollout_model: dict | None) -> dict:
    """An earlier ``--out`` of this script whose training seconds price the rollout model's
    mix (SystemExit naming the file, key and value where it cannot)."""
    if rollout_model is None:
        raise SystemExit(f"--training-json {path}: composes a --rollout-model, none given")
    try:
        with open(path) as f:
            training = json.load(f)
        timed = [r["mean_after_first"] for r in training["runs"]]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise SystemExit(f"--training-json {path}: not a bench_grpo.py --out JSON ({e!r})")
    if not timed:
        raise SystemExit(f"--training-json {path}: runs is empty")
    for key in ("model", "max_new"):
        if training.get(key) != rollout_model.get(key):
            raise SystemExit(f"--training-json {path}: {key} {training.get(key)!r}, but the "
                             f"rollout model's is {rollout_model.get(key)!r}")
    return training


def compose(runs: list[dict], model: dict, source: str) -> dict:
    """The GRPO step of a refill-model run's mix (``model``, read from ``source``) for each of
    its modes: its predicted refill rollout + (recompute + update) seconds per response token
    x the mix's tokens. Training is the same dense work whatever schedule sampled the
    responses, so one run's seconds per token prices every mode (the mean over the runs where
    several ran)."""
    per_token = statistics.mean(
        (r["mean_after_first"]["time_recompute"] + r["mean_after_first"]["time_update"])
        / r["mean_after_first"]["response_tokens"] for r in runs)
    tokens = model["tokens"]
    out = dict(source=f"{source} (cap {model['max_new']}, {model['rows']} rows, "
                      f"{model['slots']} slots)", tokens=tokens,
               training_s_per_token=per_token, training_from=[r["schedule"] for r in runs],
               modes={})
    for mode, entry in model["modes"].items():
        if "refill" in entry:
            rollout = entry["refill"]["seconds"]
            out["modes"][mode] = dict(rollout_s=rollout, training_s=per_token * tokens,
                                      step_s=rollout + per_token * tokens)
    steps = {mode: e["step_s"] for mode, e in out["modes"].items()}
    if {"dense", "sparse"} <= set(steps):
        out["sparse_over_dense"] = steps["dense"] / steps["sparse"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-1.7b", help="a preset of configs/models")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-new", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--schedules", nargs="+", default=["paper:qwen3-1.7b"],
                    help="paper:<model>, fixed:<pages> or dense; one trainer each")
    ap.add_argument("--length-mix", choices=("none",) + KINDS, default="none",
                    help="per-prompt response caps drawn from this mix (none: all --max-new)")
    ap.add_argument("--seed", type=int, default=0, help="the length mix's first seed")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=True,
                    help="fuse the dense recompute into the first mini-batch's forward")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype (float32 on CPU)")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke test: the tiny model, float32, 2 x 4 rows, 64 tokens, 2 steps")
    ap.add_argument("--run-dir", default=None, help="folder for the runs' folders (default: "
                    "the system's temporary folder)")
    ap.add_argument("--rollout-model", nargs="+", default=None,
                    help="bench_rollout --phase refill-model JSON of one mix (their modes "
                         "together): compose the mix's GRPO step")
    ap.add_argument("--training-json", default=None,
                    help="an earlier --out of this script: compose from its training seconds "
                         "instead of running trainers (needs --rollout-model)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.model, args.dtype, args.prompts, args.samples = "tiny", "float32", 2, 4
        args.max_new, args.steps, args.micro_batch = 64, 2, 4

    # Inputs read before any run: a bad file fails now, not after the runs.
    rollout_model = read_rollout_models(args.rollout_model) if args.rollout_model else None
    training = read_training(args.training_json, rollout_model) if args.training_json else None
    dev = jax.devices()[0]
    print(f"device {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}",
          flush=True)
    out = dict(argv=sys.argv[1:], device=dev.device_kind, backend=jax.default_backend(),
               jax=jax.__version__, date=datetime.date.today().isoformat(), model=args.model,
               rows=args.prompts * args.samples, max_new=args.max_new,
               length_mix=args.length_mix, fuse_recompute=args.fuse,
               micro_batch=args.micro_batch, runs=[])
    if training:
        # The figures are the training run's: its machine, model and rows.
        keys = ("device", "backend", "jax", "date", "model", "rows", "max_new", "length_mix",
                "fuse_recompute", "micro_batch", "runs")
        out.update({k: training.get(k) for k in keys}, training_json=args.training_json)
    try:
        for schedule in [] if training else args.schedules:
            out["runs"].append(run_schedule(args, schedule))
            gc.collect()   # the previous trainer's weights and optimizer state
        if rollout_model:
            out["composed"] = compose(out["runs"], rollout_model,
                                      " + ".join(args.rollout_model))
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    print(f"\n{out['model']}, {out['rows']} rows, up to {out['max_new']} tokens (length mix "
          f"{out['length_mix']}), fuse_recompute={out['fuse_recompute']}; mean of the steps "
          f"after the first" + (f" ({args.training_json})" if training else "") + ":")
    print("| schedule | rollout s | recompute s | update s | step wall s | rollout tokens/s | "
          "step tokens/s | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in out["runs"]:
        m = run["mean_after_first"]
        print(f"| {run['schedule']} | {m['time_rollout']:.2f} | {m['time_recompute']:.2f} | "
              f"{m['time_update']:.2f} | {m['wall_s']:.2f} | {m['tokens_per_s']:.0f} | "
              f"{m['step_tokens_per_s']:.0f} | {(run['peak_bytes'] or 0) / 2**30:.2f} |")
    if "composed" in out:
        c = out["composed"]
        print(f"\nGRPO step on {c['source']} ({c['tokens']} response tokens, refill rollout "
              f"predicted, training at {1e6 * c['training_s_per_token']:.1f} us a token as "
              f"measured on {out['device']}):")
        for name, e in c["modes"].items():
            print(f"  {name}: rollout {e['rollout_s']:.1f} s + training {e['training_s']:.1f} s "
                  f"= {e['step_s']:.1f} s")
        if "sparse_over_dense" in c:
            print(f"  sparse/dense GRPO step: {c['sparse_over_dense']:.2f}x")
    walls = {run["schedule"]: run["mean_after_first"]["wall_s"] for run in out["runs"]}
    if "dense" in walls and len(walls) > 1:
        for name, wall in walls.items():
            if name != "dense":
                print(f"{name}: step wall {walls['dense'] / wall:.2f}x faster than dense")


if __name__ == "__main__":
    main()
