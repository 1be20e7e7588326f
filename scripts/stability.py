"""The stability experiment of docs/stability.md: GRPO from the demo checkpoint (checkpoints/demo)
on the needle task (configs/demo.yaml) under five rollout settings, several seeds each.

    nice -n 10 .venv/bin/python scripts/stability.py --steps 30 --seeds 0 1 --eval-every 10 \\
        --num-eval 16 --out runs/stability --plot docs/stability.png --summary docs/stability.json

1. Calibrates a schedule on the training distribution (``sparrow calibrate``'s
   :func:`~sparrow_jax.calibrate.calibrate`: needle prompts, responses ending at EOS, the demo's
   dense layer 0, bins of ``--bin-tokens``), or reads it back from ``OUT/calibrate``.
2. Trains, per seed (``seed`` and ``data.seed`` both move), under
   ``dense`` (no schedule), ``calibrated`` (that table, TIS), ``tight`` (``--tight`` top-k pages
   in every bin, TIS), ``tight_uncorrected`` (the same, ``correction: none``) and ``controller``
   (starting at the tight table, the closed-loop schedule on; docs/design.md, section 9).
3. Scores each final policy on the held-out prompts with *dense* rollouts (mean@k), so the
   settings compare the policies themselves, not their actors; the in-run evaluation
   (``eval_mean_at_k``) uses each run's own actor.
4. Writes the curves (training reward, held-out reward, tail alpha, the controller's table) and a
   JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONDITIONS = ("dense", "calibrated", "tight", "tight_uncorrected", "controller")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS)
    p.add_argument("--tight", type=int, default=1, help="top-k pages of the too-tight table")
    p.add_argument("--bin-tokens", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--num-eval", type=int, default=16)
    p.add_argument("--out", default="runs/stability")
    p.add_argument("--recalibrate", action="store_true",
                   help="calibrate again even if OUT/calibrate holds a calibration")
    p.add_argument("--plot", default="docs/stability.png")
    p.add_argument("--summary", default="docs/stability.json")
    return p.parse_args(argv)


def calibrated_table(a, base, out: Path) -> dict:
    """The calibration's result on the needle task's own answers (its ``schedule`` entry); an
    earlier one in ``OUT/calibrate`` is read back unless ``--recalibrate``."""
    from sparrow_jax.calibrate import CalibrateConfig, calibrate

    saved = out / "calibrate" / "calibration.json"
    if saved.is_file() and not a.recalibrate:
        return json.loads(saved.read_text())

    c = CalibrateConfig(model=str(ROOT / base.model.path), needle=base.data.needle,
                        num_prompts=64, held_out_prompts=32, n=4,
                        max_new_tokens=base.rollout.max_new_tokens, stop_at_eos=True,
                        temperature=base.rollout.temperature, budgets=(1, 2, 3, 4, 6, 8, 12),
                        page_size=base.rollout.engine.page_size,
                        dense_layers=base.rollout.engine.dense_layers,
                        bin_tokens=a.bin_tokens, min_count=32, target=0.86, estimator="paper",
                        validation_rounds=3, out_dir=str(out / "calibrate"), plots=False,
                        progress=False)
    return calibrate(c)


def condition_config(base, name: str, table, a, seed: int, out: Path):
    """The demo config with ``name``'s schedule, loss and closed loop, for ``seed``."""
    from sparrow_jax.config import from_dict, to_dict
    from sparrow_jax.rl.config import TrainConfig

    d = to_dict(base)
    tight = [a.tight] * len(table)
    table_schedule = {"kind": "table", "bin_tokens": a.bin_tokens,
                      "page_size": base.rollout.engine.page_size}
    d.update(run_dir=str(out / f"{name}_s{seed}"), steps=a.steps, seed=seed,
             eval_every=a.eval_every, progress=False, tensorboard=False,
             checkpoint_every=a.steps)
    d["model"]["path"] = str(ROOT / base.model.path)
    d["data"].update(seed=base.data.seed + seed, num_eval=a.num_eval)
    d["schedule"] = {
        "dense": None, "calibrated": {**table_schedule, "table": list(table)},
        "tight": {**table_schedule, "table": tight},
        "tight_uncorrected": {**table_schedule, "table": tight},
        "controller": {**table_schedule, "table": tight}}[name]
    if name == "tight_uncorrected":
        d["update"]["loss"]["correction"] = "none"
    if name == "controller":
        # Bins hold ~80 answer tokens a step; the ceiling of 12 top-k pages is dense here.
        d["closed_loop"] = {"enabled": True, "min_count": 32, "patience": 5, "margin": 0.03,
                            "ladder": [1, 2, 3, 4, 6, 8, 12], "lower": 1.0, "upper": 12.0,
                            "max_pages": 12}
    return from_dict(TrainConfig, d)


def dense_held_out(trainer, seed: int) -> float:
    """mean@k of the trained policy on the held-out prompts, dense rollouts, a key of its own."""
    import jax

    from sparrow_jax.data import evaluate_mean_at_k
    from sparrow_jax.rl.trainer import engine_rollout_fn, responses_of

    cfg = trainer.config
    rollout_fn = engine_rollout_fn(cfg, None)
    key = jax.random.key(20_000 + seed)

    def sample_fn(prompts, k):
        nonlocal key
        key, sub = jax.random.split(key)
        return responses_of(rollout_fn(trainer.model, prompts, sub, k, schedule=None))

    def reward(p, r, ans):
        return trainer.reward_fn(p, r, ans, **trainer.reward_context)

    return evaluate_mean_at_k(sample_fn, trainer.eval_set, reward, cfg.eval_samples,
                              batch_size=cfg.data.prompts_per_step)["mean_at_k"]


def run_one(cfg) -> dict:
    from sparrow_jax.rl.trainer import Trainer, prepare_run

    prepare_run(cfg, overwrite=True)
    trainer = Trainer(cfg)
    t0 = time.perf_counter()
    history = trainer.run().history
    seconds = time.perf_counter() - t0
    return {"history": history, "dense_held_out_end": dense_held_out(trainer, cfg.seed),
            "train_seconds": round(seconds, 1)}


def plot(results: dict, path: Path, smooth: int = 5) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    colors = dict(zip(CONDITIONS, ("black", "tab:green", "tab:orange", "tab:red", "tab:blue")))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [(axes[0, 0], "reward_mean", f"training reward (mean of {smooth} steps)"),
              (axes[0, 1], "eval_mean_at_k", "held-out reward, mean@4 (the run's own actor)"),
              (axes[1, 0], "alpha_paper_p5", f"tail alpha: p5, paper estimator ({smooth} steps)"),
              (axes[1, 1], "schedule_pages", "controller: top-k pages, mean over measured bins")]
    for name, runs in results.items():
        for i, (seed, res) in enumerate(sorted(runs.items())):
            h = res["history"]
            label = name if i == 0 else None
            style = dict(color=colors[name], alpha=0.85, lw=1.3, ls="-" if i == 0 else "--")
            for ax, key, _ in panels[:3]:
                pts = [(r["step"], r[key]) for r in h if r.get(key) is not None]
                if not pts:
                    continue
                x, y = map(np.asarray, zip(*pts))
                if key != "eval_mean_at_k" and len(y) >= smooth:
                    y = np.convolve(y, np.ones(smooth) / smooth, mode="valid")
                    x = x[smooth - 1:]
                ax.plot(x, y, marker="o" if key == "eval_mean_at_k" else None, label=label,
                        **style)
            if name == "controller":
                pages = [np.mean([v for k, v in r.items() if k.startswith("schedule_pages_bin")
                                  and r.get(k.replace("schedule_pages", "closed_loop_p5"))
                                  is not None] or [np.nan]) for r in h]
                panels[3][0].plot([r["step"] for r in h], pages, label=f"seed {seed}", **style)
    axes[1, 0].axhline(0.86, color="gray", ls=":", label="target 0.86")
    for ax, _, title in panels:
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("reward")
    axes[0, 1].set_ylabel("reward")
    axes[1, 0].set_ylabel("alpha")
    axes[1, 1].set_ylabel("top-k pages")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Sparse-rollout GRPO on the needle task, demo checkpoint "
                 "(solid: first seed, dashed: second)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarise(name: str, res: dict, k: int = 10) -> dict:
    h = res["history"]

    def mean(key, rows):
        xs = [r[key] for r in rows if r.get(key) is not None]
        return round(sum(xs) / len(xs), 4) if xs else None

    out = {"reward_first": mean("reward_mean", h[:k]), "reward_last": mean("reward_mean", h[-k:]),
           "eval_last": next((r["eval_mean_at_k"] for r in reversed(h)
                              if "eval_mean_at_k" in r), None),
           "dense_held_out_end": round(res["dense_held_out_end"], 4),
           "alpha_p5_mean": mean("alpha_paper_p5", h),
           "alpha_p5_min": round(min(r["alpha_paper_p5"] for r in h), 4),
           "sparse_step_fraction": mean("sparse_step_fraction", h),
           "train_seconds": res["train_seconds"]}
    if name == "controller":
        out["schedule_changes"] = int(sum(r.get("schedule_changes", 0) for r in h))
        out["final_table"] = [int(v) for kk, v in sorted(h[-1].items())
                              if kk.startswith("schedule_pages_bin")]
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    from sparrow_jax.rl.config import load_train_config

    base = load_train_config(a.config)
    out = Path(a.out)
    t0 = time.perf_counter()
    cal = calibrated_table(a, base, out)
    table = cal["schedule"]["table"]
    print(f"calibrated table (top-k pages per {a.bin_tokens}-token bin): {table}; "
          f"met: {cal['met']}", flush=True)
    results: dict = {}
    summary = {"command": " ".join(["scripts/stability.py"] + (argv or sys.argv[1:])),
               "calibration": {"table": table, "met": cal["met"],
                               "tail_table": cal["tail_table"],
                               "validation": cal["validation"]},
               "runs": {}}
    for seed in a.seeds:
        for name in a.conditions:
            cfg = condition_config(base, name, table, a, seed, out)
            res = run_one(cfg)
            results.setdefault(name, {})[seed] = res
            summary["runs"][f"{name}_s{seed}"] = summarise(name, res)
            print(f"{name} seed {seed}: {summary['runs'][f'{name}_s{seed}']}", flush=True)
            (out / "results.json").write_text(json.dumps(
                {n: {str(s): r for s, r in v.items()} for n, v in results.items()}))
            plot(results, Path(a.plot))
            summary["wall_seconds"] = round(time.perf_counter() - t0, 1)
            Path(a.summary).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"done in {time.perf_counter() - t0:.0f} s: {a.plot}, {a.summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
