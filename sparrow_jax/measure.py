"""The sparse-to-dense mismatch of given rollouts per page budget and length bin (docs/design.md,
section 5): what ``sparrow calibrate`` and ``scripts/measure_mismatch.py`` measure.

Rollouts are sampled with the rollout engine; then, for every budget, the same tokens go through
the teacher-forced sparse forward (each response position attends through its own block top-k
selection with that budget, as the decode step did) and through the dense forward. Per response
token, ``alpha = sum_x min(p(x), q(x))`` compares p, the dense policy, with q, the sparse actor,
both ``softmax(logits / T)``, with the three estimators of :mod:`sparrow_jax.mismatch`. The tail
statistic is the 5th percentile of alpha per length bin, bins indexed by each token's ``lengths``.

Shapes: S rollout rows, R = max_new_tokens response slots, T padded sequence length.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.attention.teacher_forced import TeacherForcedBudgets, make_teacher_forced_attend
from sparrow_jax.mismatch import (ESTIMATORS, acceptance_rate, acceptance_rate_paper,
                                  acceptance_rate_topk_bound, tail_statistic)
from sparrow_jax.models.lm_head import map_positions, scaled_logits
from sparrow_jax.rl.recompute import response_rows

QUANTILE = 0.05


# --------------------------------------------------------------------------- rollouts
def sample_rollouts(model, prompts: Sequence[Sequence[int]], config, seed: int,
                    schedule=None, chunk_prompts: int = 64) -> list:
    """``generate`` over ``prompts`` in chunks of ``chunk_prompts`` -> the chunks' Rollouts
    (``config``: a RolloutConfig; ``schedule``: None for dense rollouts)."""
    from sparrow_jax.rollout.engine import generate

    key = jax.random.key(seed)
    out = []
    for start in range(0, len(prompts), chunk_prompts):
        key, sub = jax.random.split(key)
        out.append(generate(model, prompts[start:start + chunk_prompts], config, sub,
                            schedule=schedule))
    return out


def host_rollouts(rollouts: list) -> dict[str, np.ndarray]:
    """Rollouts -> one dict of host arrays (tokens, prompt_lengths, response_lengths, logprobs),
    token rows padded to one width."""
    parts = [{"tokens": np.asarray(ro.tokens), "prompt_lengths": np.asarray(ro.prompt_lengths),
              "response_lengths": np.asarray(ro.response_lengths),
              "logprobs": np.asarray(ro.logprobs)} for ro in rollouts]
    width = max(p["tokens"].shape[1] for p in parts)
    for p in parts:
        p["tokens"] = np.pad(p["tokens"], ((0, 0), (0, width - p["tokens"].shape[1])))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


# --------------------------------------------------------------------------- alpha per token
class Measurement(NamedTuple):
    """Per schedule label: alpha per estimator ``[S, R]`` and which steps ran sparse
    ``[S, R]``; shared: the response mask, each token's ``lengths`` and the dense log-prob of
    each sampled token (all ``[S, R]``)."""

    alphas: dict[str, dict[str, np.ndarray]]
    sparse: dict[str, np.ndarray]
    mask: np.ndarray
    lengths: np.ndarray
    dense_logprobs: np.ndarray


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("r",))
def _dense_hidden(graphdef, state, tokens, prompt_lengths, *, r):
    model = nnx.merge(graphdef, state)
    hidden, _ = model.forward(tokens)
    return response_rows(hidden, prompt_lengths, r)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=(
    "r", "temperature", "top_k", "page_size", "dense_layers", "scorer", "chunk"))
def _alphas(graphdef, state, tokens, prompt_lengths, budget_pages, hidden_p, response_ids, *, r,
            temperature, top_k, page_size, dense_layers, scorer, chunk):
    """Teacher-forced sparse forward with ``budget_pages [B, T]``, then per response slot the
    three estimators of alpha (p: dense ``hidden_p``, q: sparse) and the dense log-prob of the
    response token; the LM head runs in chunks of positions, never ``[B, T, V]``."""
    model = nnx.merge(graphdef, state)
    attend = make_teacher_forced_attend(page_size=page_size, scorer=scorer,
                                        dense_layers=dense_layers)
    hidden_q, _ = model.forward(tokens, attend=attend,
                                state=TeacherForcedBudgets(budget_pages, prompt_lengths))
    hidden_q = response_rows(hidden_q, prompt_lengths, r)
    b = hidden_q.shape[0]
    w = model.head_weight()

    def flat(x):
        return x.reshape(b * r, *x.shape[2:])

    def body(w, hp, hq, ids):
        logits_p = scaled_logits(hp, w, temperature)
        logits_q = scaled_logits(hq, w, temperature)
        exact = acceptance_rate(logits_p, logits_q)      # already divided by the temperature
        lp = jax.nn.log_softmax(logits_p, axis=-1)
        lq = jax.nn.log_softmax(logits_q, axis=-1)
        q_top, q_ids = jax.lax.top_k(lq, top_k)
        p_top, p_ids = jax.lax.top_k(lp, top_k)
        bound = acceptance_rate_topk_bound(jnp.take_along_axis(lp, q_ids, axis=-1), q_top)
        paper = acceptance_rate_paper(p_ids, p_top, q_ids, q_top)
        logp_token = jnp.take_along_axis(lp, ids[:, None], axis=-1)[:, 0]
        return exact, bound, paper, logp_token

    outs = map_positions(body, (flat(hidden_p), flat(hidden_q), flat(response_ids)), w,
                         chunk_size=chunk, remat=False)
    return tuple(o.reshape(b, r) for o in outs)


def measure_alphas(model, ro: dict[str, np.ndarray], schedules, *, max_new_tokens: int,
                   temperature: float, top_k: int = 20, page_size: int = 16,
                   dense_layers=(0, 1), scorer: str = "centroid", batch_size: int = 16,
                   progress: bool = False) -> Measurement:
    """alpha of every response token of ``ro`` (:func:`host_rollouts`) at each
    ``(label, BudgetSchedule)`` of ``schedules``, position i at the schedule's budget for
    ``lengths = i + 1``. ``temperature`` > 0 is that of p and q."""
    from tqdm.auto import tqdm

    s, r = ro["tokens"].shape[0], max_new_tokens
    pl, rl = ro["prompt_lengths"], ro["response_lengths"]
    mask = np.arange(r)[None, :] < rl[:, None]
    lengths = pl[:, None] + np.arange(r)[None, :]          # each response token's step lengths
    response_ids = np.take_along_axis(ro["tokens"],
                                      np.minimum(lengths, ro["tokens"].shape[1] - 1), axis=1)
    # One padded shape for every teacher-forced call: T a multiple of 64, rows of batch_size.
    t = -(-int((pl + rl).max()) // 64) * 64
    tokens = np.zeros((s, t), np.int32)
    width = min(t, ro["tokens"].shape[1])
    tokens[:, :width] = ro["tokens"][:, :width]
    bsz = min(batch_size, s)
    batches = [np.arange(i, min(i + bsz, s)) for i in range(0, s, bsz)]
    top_k = min(top_k, model.config.vocab_size)
    chunk = min(1024, bsz * r)
    dense_layers = tuple(int(x) for x in dense_layers)
    graphdef, state = nnx.split(model)

    def padded(rows, x):
        x = x[rows]
        return np.concatenate([x, np.repeat(x[:1], bsz - len(rows), axis=0)]) if len(
            rows) < bsz else x

    dense_h = [_dense_hidden(graphdef, state, jnp.asarray(padded(rows, tokens)),
                             jnp.asarray(padded(rows, pl)), r=r) for rows in batches]
    alphas, sparse = {}, {}
    dense_logp = np.zeros((s, r), np.float32)
    bar = tqdm(total=len(schedules) * len(batches), desc="teacher-forced", unit="batch",
               disable=not progress)
    for label, sched in schedules:
        bp = np.broadcast_to(np.asarray(sched.budget_pages(np.arange(1, t + 1))), (bsz, t))
        bp = jnp.asarray(bp)
        out = {name: np.zeros((s, r), np.float32) for name in ESTIMATORS}
        for rows, hp in zip(batches, dense_h):
            res = _alphas(graphdef, state, jnp.asarray(padded(rows, tokens)),
                          jnp.asarray(padded(rows, pl)), bp, hp,
                          jnp.asarray(padded(rows, response_ids)), r=r, temperature=temperature,
                          top_k=top_k, page_size=page_size, dense_layers=dense_layers,
                          scorer=scorer, chunk=chunk)
            res = [np.asarray(x)[:len(rows)] for x in res]
            for name, x in zip(ESTIMATORS, res):
                out[name][rows] = x
            dense_logp[rows] = res[3]
            bar.update(1)
        alphas[label] = out
        # Token 0 comes from the dense prefill; later tokens ran sparse where the context's pages
        # exceed the budget.
        step_budget = np.asarray(sched.budget_pages(lengths))
        sparse[label] = (-(-lengths // page_size) > step_budget) & (np.arange(r)[None, :] > 0)
    bar.close()
    return Measurement(alphas, sparse, mask, lengths, dense_logp)


def recorded_alphas(model, rollout, temperature: float, top_k: int = 20) -> dict[str, np.ndarray]:
    """The ``topk_bound`` and ``paper`` alphas ``[S, R]`` of a sparse rollout, from its recorded
    top-k against the dense recompute (no sparse forward), as training measures them."""
    from sparrow_jax.rl.recompute import recompute

    dense = recompute(model, rollout, temperature, top_k=min(top_k, model.config.vocab_size))
    return {"topk_bound": np.asarray(acceptance_rate_topk_bound(dense.actor_topk_logprobs,
                                                                rollout.topk_logprobs)),
            "paper": np.asarray(acceptance_rate_paper(dense.topk_ids, dense.topk_logprobs,
                                                      rollout.topk_ids, rollout.topk_logprobs))}


# --------------------------------------------------------------------------- summary
def num_bins_for(lengths: np.ndarray, mask: np.ndarray, bin_tokens: int) -> int:
    """Bins of ``bin_tokens`` up to the longest masked-in ``lengths`` (at least 1)."""
    return max(1, -(-int(lengths[mask].max() + 1) // bin_tokens))


def bin_tails(alpha, mask, lengths, *, bin_tokens: int, num_bins: int,
              min_count: int) -> np.ndarray:
    """The tail statistic ``[num_bins]`` (NaN: fewer than ``min_count`` tokens)."""
    return np.asarray(tail_statistic(jnp.asarray(alpha), jnp.asarray(lengths),
                                     bin_tokens=bin_tokens, quantile=QUANTILE,
                                     mask=jnp.asarray(mask), num_bins=num_bins,
                                     min_count=min_count), np.float64)


def finite_list(x) -> list:
    """NaN and inf -> None (JSON null), others rounded to 6 digits."""
    return [None if not np.isfinite(v) else round(float(v), 6) for v in np.asarray(x)]


def summarise(alpha: dict[str, np.ndarray], mask, lengths, sparse, *, bin_tokens: int,
              num_bins: int, min_count: int) -> dict:
    """Per estimator: mean, tail and mean per bin; token counts per bin; the sparse fraction."""
    bins = np.minimum(lengths // bin_tokens, num_bins - 1)
    counts = np.bincount(bins[mask], minlength=num_bins)[:num_bins]
    out = {"tokens": int(mask.sum()),
           "sparse_fraction": round(float(sparse[mask].mean()), 6),
           "mean": {}, "tail": {}, "bin_mean": {}, "counts": counts.tolist(),
           "sparse_counts": np.bincount(bins[mask & sparse], minlength=num_bins)[:num_bins]
           .tolist()}
    for name, x in alpha.items():
        out["mean"][name] = round(float(x[mask].mean()), 6)
        out["tail"][name] = finite_list(bin_tails(x, mask, lengths, bin_tokens=bin_tokens,
                                                  num_bins=num_bins, min_count=min_count))
        sums = np.bincount(bins[mask], weights=x[mask], minlength=num_bins)[:num_bins]
        out["bin_mean"][name] = finite_list(np.where(counts > 0, sums / np.maximum(counts, 1),
                                                     np.nan))
    out["min_tail"] = {name: min((v for v in out["tail"][name] if v is not None), default=None)
                       for name in alpha}
    return out


def bin_edges(num_bins: int, bin_tokens: int, longest: int) -> list[dict]:
    """``[{start, end}]`` per bin; the last, open-ended, closed at ``longest + 1`` for plots."""
    edges = [{"start": i * bin_tokens, "end": (i + 1) * bin_tokens} for i in range(num_bins)]
    edges[-1]["end"] = max(longest + 1, edges[-1]["start"] + 1)
    edges[-1]["open_ended"] = True
    return edges


# --------------------------------------------------------------------------- plots
def plot_alphas(result: dict, alphas: dict[str, dict[str, np.ndarray]], mask,
                out_dir: Path, target: float) -> list[Path]:
    """``alpha_tail.png`` (tail per bin, one line per budget, one panel per estimator) and
    ``alpha_hist.png`` (alpha histogram per budget); ``result`` as measure_mismatch's JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = result["bins"]
    labels = [b["label"] for b in result["budgets"]]
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(labels)))
    paths = []

    fig, axes = plt.subplots(1, len(ESTIMATORS), figsize=(12, 3.6), sharey=True)
    for ax, name in zip(axes, ESTIMATORS):
        for color, b in zip(colors, result["budgets"]):
            xs = [0.5 * (e["start"] + e["end"]) for e, v in zip(edges, b["tail"][name])
                  if v is not None]
            ys = [v for v in b["tail"][name] if v is not None]
            ax.plot(xs, ys, marker="o", ms=3, color=color, label=b["label"])
        if name == "paper":
            ax.axhline(target, color="0.3", linestyle="--", linewidth=1,
                       label=f"{target}: stability target")
        ax.set_title(f"{name}", fontsize=10)
        ax.set_xlabel("sequence length (bin centre, tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("5th percentile of alpha")
    handles, names = axes[-1].get_legend_handles_labels()
    fig.legend(handles, names, loc="center right", title="budget\n(pages)", fontsize=8,
               title_fontsize=8)
    fig.suptitle(f"tail acceptance rate per {result['config']['bin_tokens']}-token bin, "
                 f"page {result['config']['page_size']}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.85, 1))
    paths.append(out_dir / "alpha_tail.png")
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)

    cols = min(len(labels), 3)
    rows = -(-len(labels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    # One range for every panel, from the lowest alpha of any estimator (in steps of 0.05) to 1.
    low = min(float(x[mask].min()) for d in alphas.values() for x in d.values())
    hist_bins = np.linspace(max(0.0, math.floor(low * 20) / 20), 1.0, 51)
    for ax, b in zip(axes.ravel(), result["budgets"]):
        for name in ESTIMATORS:
            filled = name == "exact"
            ax.hist(alphas[b["label"]][name][mask], bins=hist_bins,
                    histtype="stepfilled" if filled else "step", alpha=0.6 if filled else 1.0,
                    label=name)
        ax.set_yscale("log")
        ax.set_title(f"budget {b['label']}: mean {b['mean']['exact']:.3f}, "
                     f"sparse {b['sparse_fraction']:.0%}", fontsize=9)
        ax.set_xlabel("alpha")
        ax.set_ylabel("response tokens")
        ax.legend(fontsize=7, loc="upper left")
    for ax in axes.ravel()[len(labels):]:
        ax.axis("off")
    fig.tight_layout()
    paths.append(out_dir / "alpha_hist.png")
    fig.savefig(paths[-1], dpi=80)
    plt.close(fig)
    return paths
