"""``sparrow plot RUN_DIR``: PNG curves of a run's metrics.jsonl (matplotlib, lazy)."""

from __future__ import annotations

from pathlib import Path

from sparrow_jax.metrics import read_metrics

# Figures: (file stem, title, metric names drawn together).
FIGURES = (
    ("reward", "reward", ("reward_mean", "eval_mean_at_k")),
    ("response_length", "response length (tokens)", ("response_length_mean",)),
    ("alpha", "acceptance rate alpha", ("alpha_topk_bound_mean", "alpha_paper_mean",
                                        "alpha_topk_bound_p5", "alpha_paper_p5")),
    ("sparse_fraction", "fraction of decode steps that ran sparse", ("sparse_step_fraction",)),
    ("clipping", "fractions of tokens", ("clip_fraction", "dual_clip_fraction",
                                         "is_corrected_fraction")),
    ("entropy", "entropy (nats)", ("entropy",)),
    ("grad_norm", "gradient norm", ("grad_norm",)),
    ("time", "seconds per step", ("time_rollout", "time_recompute", "time_update")),
)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Writes one PNG per figure of :data:`FIGURES` that has data into ``RUN_DIR/plots`` and
    returns their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from None
    records = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, title, names in FIGURES:
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
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{stem}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
