"""The demo's driver (``scripts/demo.sh`` runs it): GRPO with sparse rollouts from the tiny
pre-trained model of ``checkpoints/demo`` on the needle task, then plots.

    .venv/bin/python scripts/demo.py [--config configs/demo.yaml] [--run-dir DIR] [--steps N]
                                     [--resume]

It prints the task's context-free ceiling (the best reward of a policy that ignores the prompt)
and the held-out reward (mean@k over ``data.num_eval`` prompts, the sparse rollout engine at the
training temperature) before and after training, runs :func:`sparrow_jax.rl.trainer.train` in
between (the same loop as ``sparrow train --config``), and writes the run's curves to
``RUN_DIR/plots``. A fresh (not ``--resume``) run replaces an earlier one in the same folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--run-dir", default=None, help="overrides the config's run_dir")
    p.add_argument("--steps", type=int, default=None, help="overrides the config's steps")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in RUN_DIR from its latest checkpoint")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def held_out_reward(trainer, seed: int) -> float:
    """mean@k on the held-out prompts with a key of its own (the run's key is left alone, so the
    training run is exactly that of ``sparrow train``)."""
    import jax

    from sparrow_jax.data import evaluate_mean_at_k

    key = jax.random.key(seed)

    def sample_fn(prompts, k):
        nonlocal key
        key, sub = jax.random.split(key)
        from sparrow_jax.rl.trainer import responses_of

        return responses_of(trainer.rollout_fn(trainer.model, prompts, sub, k))

    def reward(p, r, a):
        return trainer.reward_fn(p, r, a, **trainer.reward_context)

    cfg = trainer.config
    return evaluate_mean_at_k(sample_fn, trainer.eval_set, reward, cfg.eval_samples,
                              batch_size=cfg.data.prompts_per_step)["mean_at_k"]


def main(argv=None) -> int:
    a = parse_args(argv)
    from sparrow_jax.data import synthetic_task
    from sparrow_jax.plot import plot_run
    from sparrow_jax.rl.config import load_train_config
    from sparrow_jax.rl.interrupt import TrainingInterrupted
    from sparrow_jax.rl.run_dir import previous_run
    from sparrow_jax.rl.trainer import Trainer, prepare_run

    cfg = load_train_config(a.config)
    changes = {k: v for k, v in (("run_dir", a.run_dir), ("steps", a.steps)) if v is not None}
    if a.no_progress:
        changes["progress"] = False
    cfg = dataclasses.replace(cfg, **changes)
    run_dir = Path(cfg.run_dir)
    if not a.resume and previous_run(run_dir):
        print(f"replacing the earlier run in {run_dir}", flush=True)
    prepare_run(cfg, resume=a.resume, overwrite=not a.resume)

    ceiling = synthetic_task(cfg.data).context_free_ceiling()
    print(f"needle task: {cfg.data.needle}\ncontext-free ceiling (a policy that ignores the "
          f"prompt): {ceiling:.4f}", flush=True)
    t_start = time.perf_counter()
    trainer = Trainer(cfg)
    eval_seed = 10_000 + cfg.seed
    start = held_out_reward(trainer, eval_seed)
    print(f"held-out reward before GRPO (mean@{cfg.eval_samples}, {len(trainer.eval_set.prompts)} "
          f"prompts, sparse rollouts): {start:.4f}", flush=True)
    t0 = time.perf_counter()
    try:
        history = trainer.run(resume=a.resume).history
    except TrainingInterrupted as e:
        print(f"demo: {e}; resume with: bash scripts/demo.sh --resume", file=sys.stderr)
        return e.exit_status
    t_train = time.perf_counter() - t0
    end = held_out_reward(trainer, eval_seed)
    wall = time.perf_counter() - t_start

    rewards = [h["reward_mean"] for h in history]
    k = max(1, min(5, len(rewards) // 4))

    def mean_of(name):
        xs = [h[name] for h in history if name in h]
        return sum(xs) / len(xs) if xs else float("nan")

    summary = {
        "context_free_ceiling": ceiling, "eval_reward_start": start, "eval_reward_end": end,
        "train_reward_first_steps": sum(rewards[:k]) / k if rewards else None,
        "train_reward_last_steps": sum(rewards[-k:]) / k if rewards else None,
        "alpha_paper_mean": mean_of("alpha_paper_mean"),
        "sparse_step_fraction": mean_of("sparse_step_fraction"),
        "steps": cfg.steps, "train_seconds": round(t_train, 1), "wall_seconds": round(wall, 1),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plots = plot_run(run_dir)
    print(f"\n{cfg.steps} GRPO steps in {t_train:.0f} s ({wall:.0f} s in all)")
    print(f"context-free ceiling        {ceiling:.4f}")
    print(f"held-out reward, start      {start:.4f}")
    print(f"held-out reward, end        {end:.4f}")
    if rewards:
        print(f"training reward, first {k} steps {summary['train_reward_first_steps']:.4f}, "
              f"last {k} steps {summary['train_reward_last_steps']:.4f}")
    print(f"acceptance rate alpha (paper estimator, mean over the run) "
          f"{summary['alpha_paper_mean']:.4f}; decode steps that ran sparse "
          f"{summary['sparse_step_fraction']:.1%} (the first response token comes from the "
          f"dense prefill)")
    print(f"metrics: {run_dir / 'metrics.jsonl'}; summary: {run_dir / 'summary.json'}; "
          f"plots: {', '.join(str(p) for p in plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
