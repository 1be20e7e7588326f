"""DistillSparse on the demo (docs/distill.md): GRPO on checkpoints/demo at a small page budget,
with DistillSparse on and off, per seed; every run then scored on held-out rollouts.

    nice .venv/bin/python scripts/distill_experiment.py --steps 80 --pages 4 --seeds 0,1 \\
        --out docs/distill.json --plot docs/distill_curves.png

Each arm is ``configs/demo.yaml`` with its schedule fixed at ``--pages``, ``--steps`` steps,
the run's ``seed`` set, periodic evaluation off, and ``distill`` on or off (``--rank``,
``--lambda-kl``, ``--lr-multiple``, the adapter's settings). After training, the final sparse
actor samples ``--samples`` responses to each of the first ``--num-eval`` held-out prompts
(its own key, the same for both arms of a seed). On those rollouts it reports:

- ``reward``: the mean reward (mean@k) and its standard error over prompts;
- ``alpha_p5`` / ``alpha_mean``: the ``paper`` acceptance rate of the rollout's actor against
  the dense recompute (docs/design.md, section 5), over all response tokens;
- with DistillSparse, ``alpha_p5_nolora`` / ``alpha_mean_nolora``: the same rollouts scored by
  the same dense weights without the LoRA (:mod:`sparrow_jax.rl.distill_eval`), and
  ``gain_p5``, the difference, with a bootstrap standard error over held-out prompts.

Each run's result is kept in ``RUN_ROOT/<arm>_s<seed>/result.json`` and reused by later calls
unless ``--fresh``, so arms may run in separate calls; ``--out`` gathers every result present for
the requested arms and seeds, and ``--plot`` draws the curves (tail alpha with and without LoRA,
reward; moving averages over ``--smooth`` steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT_STREAM = 0x686f6c64   # folded into the seed's key: the held-out rollouts' stream
BOOTSTRAP = 1000


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    p.add_argument("--run-root", default=str(ROOT / "runs" / "distill_experiment"))
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--pages", type=int, default=4, help="fixed page budget of the rollouts")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--arms", default="off,on", help="off: GRPO alone; on: with DistillSparse")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lambda-kl", type=float, default=0.001)
    p.add_argument("--lr-multiple", type=float, default=5.0)
    p.add_argument("--eval-every", type=int, default=2,
                   help="training steps between the without-LoRA scores of the step's rollout")
    p.add_argument("--num-eval", type=int, default=64, help="held-out prompts scored")
    p.add_argument("--samples", type=int, default=8, help="held-out samples per prompt")
    p.add_argument("--fresh", action="store_true", help="rerun arms that have a result")
    p.add_argument("--out", default=None, help="the gathered results (JSON)")
    p.add_argument("--plot", default=None, help="the curves (PNG)")
    p.add_argument("--smooth", type=int, default=10)
    return p.parse_args(argv)


def arm_config(base, a, arm: str, seed: int):
    """``base`` (the demo's TrainConfig) for one arm and seed."""
    from sparrow_jax.rl.config import DistillConfig

    distill = DistillConfig(enabled=arm == "on", rank=a.rank, alpha=float(a.rank),
                            lambda_kl=a.lambda_kl, lr_multiple=a.lr_multiple,
                            eval_every=a.eval_every)
    return dataclasses.replace(
        base, run_dir=str(Path(a.run_root) / f"{arm}_s{seed}"), steps=a.steps, seed=seed,
        schedule={"kind": "fixed", "pages": a.pages}, distill=distill, eval_every=0,
        checkpoint_every=a.steps, progress=False, tensorboard=False)


def held_out(trainer, num_eval: int, samples: int, seed: int) -> dict:
    """The final sparse actor's rollouts on the first ``num_eval`` held-out prompts, scored for
    reward and for alpha with (and, with DistillSparse, without) the LoRA."""
    import jax

    from sparrow_jax.mismatch import acceptance_rate_paper
    from sparrow_jax.rl.distill_eval import alpha_tokens_without_lora
    from sparrow_jax.rl.recompute import recompute
    from sparrow_jax.rl.trainer import responses_of

    cfg, u = trainer.config, trainer.config.update
    temperature = cfg.rollout.temperature
    prompts, answers = (x[:num_eval] for x in (trainer.eval_set.prompts, trainer.eval_set.answers))
    key = jax.random.fold_in(jax.random.key(seed), HELD_OUT_STREAM)
    rewards, alpha, nolora, prompt_of = [], [], [], []
    batch = cfg.data.prompts_per_step
    for start in range(0, len(prompts), batch):
        ps = prompts[start:start + batch]
        key, sub = jax.random.split(key)
        ro = trainer.rollout_fn(trainer.model, ps, sub, samples)
        for i, resp in enumerate(responses_of(ro)):
            rewards.append(trainer.reward_fn(ps[i // samples], resp,
                                             answers[start + i // samples],
                                             **trainer.reward_context))
        dense = recompute(trainer.model, ro, temperature, top_k=cfg.mismatch.top_k,
                          micro_batch_size=u.micro_batch_size, chunk_size=u.chunk_size,
                          length_multiple=u.length_multiple)
        mask = np.asarray(ro.response_mask)
        alpha.append(np.asarray(acceptance_rate_paper(dense.topk_ids, dense.topk_logprobs,
                                                      ro.topk_ids, ro.topk_logprobs))[mask])
        rows = start + np.asarray(ro.prompt_index)
        prompt_of.append(np.broadcast_to(rows[:, None], mask.shape)[mask])
        if trainer.distill is not None:
            nolora.append(alpha_tokens_without_lora(trainer.model, ro, dense, temperature,
                                                    trainer.distill.rule, u)[mask])
    per_prompt = np.asarray(rewards).reshape(len(prompts), samples).mean(1)
    alpha, prompt_of = np.concatenate(alpha), np.concatenate(prompt_of)
    out = {"prompts": len(prompts), "samples": samples, "tokens": int(alpha.size),
           "reward": float(per_prompt.mean()),
           "reward_se": float(per_prompt.std(ddof=1) / np.sqrt(len(prompts))),
           "reward_per_prompt": per_prompt.tolist(),
           "alpha_p5": float(np.percentile(alpha, 5)), "alpha_mean": float(alpha.mean())}
    if nolora:
        nolora = np.concatenate(nolora)
        out.update(alpha_p5_nolora=float(np.percentile(nolora, 5)),
                   alpha_mean_nolora=float(nolora.mean()),
                   gain_p5=out["alpha_p5"] - float(np.percentile(nolora, 5)),
                   gain_p5_se=bootstrap_gain_se(alpha, nolora, prompt_of, seed))
    return out


def bootstrap_gain_se(alpha: np.ndarray, nolora: np.ndarray, prompt_of: np.ndarray,
                      seed: int) -> float:
    """Standard error of ``p5(alpha) - p5(nolora)`` (paired tokens ``[N]``), resampling
    held-out prompts with replacement: a prompt's tokens are not independent."""
    rng = np.random.default_rng(seed)
    ids = np.unique(prompt_of)
    members = [np.flatnonzero(prompt_of == i) for i in ids]
    gains = []
    for _ in range(BOOTSTRAP):
        take = np.concatenate([members[i] for i in rng.integers(0, len(ids), len(ids))])
        gains.append(np.percentile(alpha[take], 5) - np.percentile(nolora[take], 5))
    return float(np.std(gains, ddof=1))


def run_arm(base, a, arm: str, seed: int) -> dict:
    """Trains one arm in its run folder and scores it; -> its result (also written there)."""
    from sparrow_jax.rl.trainer import Trainer, prepare_run

    cfg = arm_config(base, a, arm, seed)
    prepare_run(cfg, overwrite=True)
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    history = trainer.run().history
    train_s = time.perf_counter() - t0
    keep = ("reward_mean", "alpha_paper_p5", "alpha_paper_mean", "alpha_paper_p5_nolora",
            "alpha_paper_mean_nolora", "distill_k3")
    curves = {k: [h.get(k) for h in history] for k in keep if k in history[0]}
    result = {"arm": arm, "seed": seed, "train_s": round(train_s, 1), "curves": curves,
              "held_out": held_out(trainer, a.num_eval, a.samples, seed)}
    result["eval_s"] = round(time.perf_counter() - t0 - train_s, 1)
    (Path(cfg.run_dir) / "result.json").write_text(json.dumps(result))
    return result


def reward_check(on: dict, off: dict) -> dict:
    """DistillSparse's held-out reward minus GRPO alone's, same prompts: the difference and its
    standard error over prompts (paired)."""
    d = np.asarray(on["reward_per_prompt"]) - np.asarray(off["reward_per_prompt"])
    se = float(d.std(ddof=1) / np.sqrt(d.size))
    return {"reward_diff": float(d.mean()), "reward_diff_se": se,
            "within_2se": bool(d.mean() >= -2 * se)}


def summarize(results: list[dict], settings: dict) -> dict:
    by = {(r["arm"], r["seed"]): r for r in results}
    rows = []
    for seed in sorted({r["seed"] for r in results}):
        on, off = by.get(("on", seed)), by.get(("off", seed))
        row = {"seed": seed}
        for name, r in (("on", on), ("off", off)):
            if r is not None:
                h = r["held_out"]
                row.update({f"{name}_{k}": h[k] for k in (
                    "reward", "reward_se", "alpha_p5", "alpha_mean", "alpha_p5_nolora",
                    "alpha_mean_nolora", "gain_p5", "gain_p5_se") if k in h})
        if on is not None and off is not None:
            row.update(reward_check(on["held_out"], off["held_out"]))
        rows.append(row)
    return {"settings": settings, "table": rows,
            "runs": [{k: v for k, v in r.items()} for r in results]}


def _smooth(x, n):
    """Steps and the moving average over ``n`` of the steps that have a value (not None)."""
    steps = np.asarray([i for i, v in enumerate(x) if v is not None])
    x = np.asarray([v for v in x if v is not None], np.float64)
    if n <= 1 or x.size < n:
        return steps, x
    return steps[n - 1:], np.convolve(x, np.ones(n) / n, mode="valid")


def plot(results: list[dict], path: str, smooth: int, threshold: float = 0.86) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_a, ax_r) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {0: "tab:blue", 1: "tab:orange", 2: "tab:green", 3: "tab:red"}
    for r in sorted(results, key=lambda r: (r["seed"], r["arm"])):
        c, curves = colors.get(r["seed"] % 4), r["curves"]
        if r["arm"] == "on":
            # Both on the steps scored without LoRA (every eval_every-th), the window in steps.
            off = curves["alpha_paper_p5_nolora"]
            scored = [i for i, v in enumerate(off) if v is not None]
            n = max(1, smooth // max(1, scored[1] - scored[0])) if len(scored) > 1 else 1
            on = [v if off[i] is not None else None for i, v in enumerate(curves["alpha_paper_p5"])]
            ax_a.plot(*_smooth(on, n), color=c,
                      label=f"seed {r['seed']}: DistillSparse, LoRA on (the actor)")
            ax_a.plot(*_smooth(off, n), color=c, ls="--",
                      label=f"seed {r['seed']}: DistillSparse, same weights, LoRA off")
        else:
            ax_a.plot(*_smooth(curves["alpha_paper_p5"], smooth), color=c, ls=":",
                      label=f"seed {r['seed']}: GRPO alone")
        ax_r.plot(*_smooth(curves["reward_mean"], smooth), color=c,
                  ls="-" if r["arm"] == "on" else ":",
                  label=f"seed {r['seed']}: "
                        f"{'DistillSparse' if r['arm'] == 'on' else 'GRPO alone'}")
    ax_a.axhline(threshold, color="gray", lw=0.8)
    ax_a.set(xlabel="step", ylabel="alpha p5 (paper), training rollouts",
             title=f"tail alpha, {smooth}-step moving average")
    ax_r.set(xlabel="step", ylabel="reward", title=f"training reward, {smooth}-step moving average")
    ax_a.legend(fontsize=7)
    ax_r.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    a = parse_args(argv)
    from sparrow_jax.rl.config import load_train_config

    base = load_train_config(a.config)
    results = []
    for seed in (int(s) for s in a.seeds.split(",")):
        for arm in a.arms.split(","):
            if arm not in ("on", "off"):
                raise SystemExit(f"--arms: 'on' or 'off', got {arm!r}")
            stored = Path(a.run_root) / f"{arm}_s{seed}" / "result.json"
            if stored.exists() and not a.fresh:
                result = json.loads(stored.read_text())
            else:
                result = run_arm(base, a, arm, seed)
            print(json.dumps({k: result[k] for k in ("arm", "seed", "train_s", "held_out")},
                             default=lambda x: None)[:800], flush=True)
            results.append(result)
    settings = {k: getattr(a, k) for k in ("steps", "pages", "rank", "lambda_kl", "lr_multiple",
                                           "eval_every", "num_eval", "samples")}
    settings.update(config=Path(a.config).name, argv=sys.argv[1:])
    summary = summarize(results, settings)
    for row in summary["table"]:
        print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1))
    if a.plot:
        plot(results, a.plot, a.smooth)
    return summary


if __name__ == "__main__":
    main()
