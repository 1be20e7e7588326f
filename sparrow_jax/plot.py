"""``sparrow plot RUN_DIR``: PNG curves of a run's metrics.jsonl (matplotlib, lazy)."""

from __future__ import annotations

import json
from pathlib import Path

from sparrow_jax.metrics import read_metrics

# Figures: (file stem, title, y-axis label, metric names drawn together).
FIGURES = (
    ("reward", "reward", "reward (mean over rows)", ("reward_mean", "eval_mean_at_k")),
    ("response_length", "response length", "tokens", ("response_length_mean",)),
    ("alpha", "acceptance rate alpha", "alpha (1 - total variation)",
     ("alpha_topk_bound_mean", "alpha_paper_mean", "alpha_topk_bound_p5", "alpha_paper_p5")),
    ("sparse_fraction", "decode steps that ran sparse", "fraction of response tokens",
     ("sparse_step_fraction",)),
    ("clipping", "clipped and corrected tokens", "fraction of response tokens",
     ("clip_fraction", "dual_clip_fraction", "is_corrected_fraction")),
    ("entropy", "policy entropy", "nats per token", ("entropy",)),
    ("kl", "KL to the reference policy (update.loss.kl_coef)", "k3 estimate, nats per token",
     ("kl",)),
    ("grad_norm", "gradient norm", "global L2 norm", ("grad_norm",)),
    ("time", "time per step", "seconds",
     ("time_rollout", "time_recompute", "time_reference", "time_update")),
)

# The stability threshold of the tail statistic (paper estimator): training is stable while
# the 5th percentile of alpha stays above it in every length bin.
TAIL_TARGET = 0.86


def plot_run(run_dir: str | Path, references: dict[str, list[tuple[float, str]]] | None = None
             ) -> list[Path]:
    """Writes one PNG per figure of :data:`FIGURES` that has data into ``RUN_DIR/plots`` and
    returns their paths.

    ``references``: figure stem -> horizontal reference lines ``(y, label)``, drawn dashed.
    The alpha figure always gets the tail target; the reward figure gets the context-free
    ceiling when the run folder's ``summary.json`` holds one (the demo writes it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from None
    records = read_metrics(run_dir)
    lines = {"alpha": [(TAIL_TARGET, f"tail target {TAIL_TARGET} (p5, paper estimator)")]}
    summary = Path(run_dir) / "summary.json"
    if summary.is_file():
        ceiling = json.loads(summary.read_text()).get("context_free_ceiling")
        if ceiling is not None:
            lines["reward"] = [(ceiling, f"context-free ceiling {ceiling:.4g}")]
    for stem, extra in (references or {}).items():
        lines[stem] = lines.get(stem, []) + list(extra)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, title, ylabel, names in FIGURES:
        series = {}
        for name in names:
            pts = [(r["step"], r[name]) for r in records if r.get(name) is not None]
            if pts:
                series[name] = pts
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, pts in series.items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=name)
        for y, label in lines.get(stem, ()):
            ax.axhline(y, color="0.3", linestyle="--", linewidth=1, label=label)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{stem}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
