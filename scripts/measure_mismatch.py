"""Measures the sparse-to-dense mismatch of a model per page budget and length bin
(docs/design.md, section 5).

Dense rollouts are sampled with the rollout engine; then, for every budget, the same tokens go
through the teacher-forced sparse forward (each response position attends through its own block
top-k selection with that budget, docs/design.md, section 3) and through the dense forward. Per
response token, the acceptance rate ``alpha = sum_x min(p(x), q(x))`` compares p, the dense policy,
with q, the sparse actor, both ``softmax(logits / T)`` at the rollout temperature, with the three
estimators of :mod:`sparrow_jax.mismatch`: ``exact`` (full vocabulary), ``topk_bound`` (q's top-k, p
over the full vocabulary) and ``paper`` (the intersection of both top-k sets). The tail statistic is
the 5th percentile of alpha per length bin, the bins indexed by each token's step ``lengths``.

    .venv/bin/python scripts/measure_mismatch.py --model checkpoints/demo \\
        --budgets 3,4,6,8,12 --bin-tokens 64 --max-new-tokens 320 --out runs/mismatch

Writes ``OUT/mismatch.json`` (per budget: mean alpha per estimator, tail and mean per bin, counts)
and, unless ``--no-plots``, ``OUT/alpha_tail.png`` (5th percentile per bin, one line per budget)
and ``OUT/alpha_hist.png`` (alpha histogram per budget).

``--budgets`` items are fixed page budgets (reserved pages included, e.g. ``8``), paper schedule
names (``qwen3-1.7b``) or schedule YAML files.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from sparrow_jax.attention.teacher_forced import (  # noqa: E402
    TeacherForcedBudgets, make_teacher_forced_attend)
from sparrow_jax.mismatch import (  # noqa: E402
    ESTIMATORS, acceptance_rate, acceptance_rate_paper, acceptance_rate_topk_bound,
    tail_statistic)
from sparrow_jax.models.lm_head import map_positions, scaled_logits  # noqa: E402
from sparrow_jax.plot import TAIL_TARGET  # noqa: E402
from sparrow_jax.rl.recompute import response_rows  # noqa: E402
from sparrow_jax.schedule import PAPER_TABLES, BudgetSchedule  # noqa: E402

QUANTILE = 0.05


# --------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="HF model folder (config.json, safetensors)")
    src.add_argument("--preset", help="randomly initialised model from configs/models (tiny, ...)")
    p.add_argument("--prompt-file", type=Path,
                   help="prompts: .txt (one per line: comma/space-separated token ids, or text "
                        "for the model folder's tokenizer), .jsonl/.json/.parquet (column "
                        "--prompt-column, through the chat template); default: the built-in "
                        "needle task")
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument("--needle-len", default=None,
                   help="needle prompts: MIN,MAX tokens (default: NeedleConfig's, 192,256)")
    p.add_argument("--budgets", default="3,4,6,8,12",
                   help="comma-separated: fixed page budgets (reserved pages included), paper "
                        f"schedule names ({', '.join(sorted(PAPER_TABLES))}) or schedule YAML "
                        "files")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dense-layers", default="0,1",
                   help="comma-separated layers that always attend densely ('' for none)")
    p.add_argument("--scorer", default="centroid", choices=("centroid", "quest"))
    p.add_argument("--bin-tokens", type=int, default=2000, help="length bin width (tokens)")
    p.add_argument("--min-count", type=int, default=100,
                   help="bins with fewer tokens get no tail statistic (null)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stop-at-eos", action="store_true",
                   help="end responses at the model's EOS (default: always max-new-tokens)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="rollout temperature, also that of p and q (0: greedy rollouts, alpha "
                        "at T = 1)")
    p.add_argument("--top-k", type=int, default=20,
                   help="top-k size of the topk_bound and paper estimators")
    p.add_argument("--batch-size", type=int, default=16,
                   help="rows per teacher-forced forward (one compiled shape)")
    p.add_argument("--gen-prompts", type=int, default=64, help="prompts per generate call")
    p.add_argument("--seed", type=int, default=0, help="prompt, sampling (and preset) seed")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute dtype; auto: bfloat16 on an accelerator, float32 on CPU")
    p.add_argument("--out", type=Path, default=Path("runs/mismatch"))
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    for name in ("page_size", "bin_tokens", "min_count", "max_new_tokens", "num_prompts", "n",
                 "top_k", "batch_size", "gen_prompts"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.temperature < 0:
        p.error(f"--temperature must be >= 0, got {a.temperature}")
    return a


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in str(text).replace(" ", ",").split(",") if t.strip())


def parse_budgets(spec: str, page_size: int) -> list[tuple[str, BudgetSchedule]]:
    """``"3,4,qwen3-1.7b"`` -> [(label, schedule)] (:meth:`BudgetSchedule.from_spec`)."""
    try:
        out = [(item, BudgetSchedule.from_spec(item, page_size))
               for item in (s.strip() for s in spec.split(",")) if item]
    except ValueError as e:
        raise SystemExit(f"--budgets: {e}") from None
    if not out:
        raise SystemExit("--budgets is empty")
    return out


# --------------------------------------------------------------------------- model and prompts
def load_model(a):
    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.hf_io import load_generation_config, load_qwen3
    from sparrow_jax.models.qwen3 import init_model

    if a.dtype == "auto":
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    else:
        dtype = jnp.dtype(a.dtype)
    if a.model is not None:
        model, config = load_qwen3(a.model, dtype=dtype)
        eos = tuple(load_generation_config(a.model).get("eos_token_ids", ()))
        eos = eos or tuple(config.eos_token_ids or ())
    else:
        config = ModelConfig.preset(a.preset)
        model = init_model(config, seed=a.seed, dtype=dtype)
        eos = tuple(config.eos_token_ids or ())
    return model, config, eos


def load_prompts(a) -> list[list[int]]:
    from sparrow_jax.data import NeedleConfig, NeedleTask

    if a.prompt_file is None:
        cfg = NeedleConfig()
        if a.needle_len is not None:
            lo, hi = int_list(a.needle_len)
            cfg = NeedleConfig(min_prompt_len=lo, max_prompt_len=hi)
        prompts, _ = NeedleTask(cfg).sample(np.random.default_rng([a.seed, 7]), a.num_prompts)
        return prompts
    path = a.prompt_file
    if path.suffix in (".jsonl", ".json", ".parquet"):
        from sparrow_jax.data import encode_prompt, load_records

        records = load_records(path)[:a.num_prompts]
        return [encode_prompt(r[a.prompt_column], _tokenizer(a)) for r in records]
    prompts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            prompts.append(list(int_list(line)))
        except ValueError:
            prompts.append(list(_tokenizer(a).encode(line)))
        if len(prompts) == a.num_prompts:
            break
    return prompts


def _tokenizer(a):
    from sparrow_jax.models.tokenizer import load_tokenizer

    if a.model is None or not (a.model / "tokenizer.json").is_file():
        raise SystemExit("text prompts need a --model folder with tokenizer.json")
    return load_tokenizer(a.model)


# --------------------------------------------------------------------------- rollouts
def dense_rollouts(model, prompts, a, eos) -> dict[str, np.ndarray]:
    """Dense rollouts of every prompt -> host arrays, rows padded to one width."""
    from sparrow_jax.rollout.engine import RolloutConfig, generate

    cfg = RolloutConfig(n=a.n, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                        eos_ids=eos if a.stop_at_eos else (), logprob_top_k=1,
                        page_size=a.page_size, dense_layers=int_list(a.dense_layers),
                        scorer=a.scorer, progress=not a.no_progress)
    key = jax.random.key(a.seed)
    parts = []
    for start in range(0, len(prompts), a.gen_prompts):
        key, sub = jax.random.split(key)
        ro = generate(model, prompts[start:start + a.gen_prompts], cfg, sub, schedule=None)
        parts.append({"tokens": np.asarray(ro.tokens), "prompt_lengths":
                      np.asarray(ro.prompt_lengths), "response_lengths":
                      np.asarray(ro.response_lengths), "logprobs": np.asarray(ro.logprobs)})
    width = max(p["tokens"].shape[1] for p in parts)
    for p in parts:
        p["tokens"] = np.pad(p["tokens"], ((0, 0), (0, width - p["tokens"].shape[1])))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


# --------------------------------------------------------------------------- alpha per token
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

    def body(hp, hq, ids):
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

    outs = map_positions(body, (flat(hidden_p), flat(hidden_q), flat(response_ids)),
                         chunk_size=chunk, remat=False)
    return tuple(o.reshape(b, r) for o in outs)


# --------------------------------------------------------------------------- summary
def _finite(x) -> list:
    return [None if not np.isfinite(v) else round(float(v), 6) for v in np.asarray(x)]


def summarise(alpha: dict[str, np.ndarray], mask, lengths, sparse, a, num_bins) -> dict:
    bins = np.minimum(lengths // a.bin_tokens, num_bins - 1)
    counts = np.bincount(bins[mask], minlength=num_bins)[:num_bins]
    out = {"tokens": int(mask.sum()),
           "sparse_fraction": round(float(sparse[mask].mean()), 6),
           "mean": {}, "tail": {}, "bin_mean": {}, "counts": counts.tolist(),
           "sparse_counts": np.bincount(bins[mask & sparse], minlength=num_bins)[:num_bins]
           .tolist()}
    for name in ESTIMATORS:
        x = alpha[name]
        out["mean"][name] = round(float(x[mask].mean()), 6)
        tail = tail_statistic(jnp.asarray(x), jnp.asarray(lengths), bin_tokens=a.bin_tokens,
                              quantile=QUANTILE, mask=jnp.asarray(mask), num_bins=num_bins,
                              min_count=a.min_count)
        out["tail"][name] = _finite(tail)
        sums = np.bincount(bins[mask], weights=x[mask], minlength=num_bins)[:num_bins]
        out["bin_mean"][name] = _finite(np.where(counts > 0, sums / np.maximum(counts, 1),
                                                 np.nan))
    out["min_tail"] = {name: min((v for v in out["tail"][name] if v is not None), default=None)
                       for name in ESTIMATORS}
    return out


# --------------------------------------------------------------------------- plots
def plot(result: dict, alphas: dict[str, dict[str, np.ndarray]], mask, out_dir: Path) -> list:
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
            ax.axhline(TAIL_TARGET, color="0.3", linestyle="--", linewidth=1,
                       label=f"{TAIL_TARGET}: stability target")
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


# --------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    a = parse_args(argv)
    from tqdm.auto import tqdm

    budgets = parse_budgets(a.budgets, a.page_size)
    dense_layers = int_list(a.dense_layers)
    model, config, eos = load_model(a)
    prompts = load_prompts(a)
    if not prompts:
        raise SystemExit("no prompts")
    t0 = time.perf_counter()
    ro = dense_rollouts(model, prompts, a, eos)
    t_gen = time.perf_counter() - t0

    s = ro["tokens"].shape[0]
    r = a.max_new_tokens
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
    bsz = min(a.batch_size, s)
    batches = [np.arange(i, min(i + bsz, s)) for i in range(0, s, bsz)]
    num_bins = max(1, -(-int(lengths[mask].max() + 1) // a.bin_tokens))
    temperature = a.temperature if a.temperature > 0 else 1.0
    top_k = min(a.top_k, config.vocab_size)
    chunk = min(1024, bsz * r)

    graphdef, state = nnx.split(model)

    def padded(rows, x):
        x = x[rows]
        return np.concatenate([x, np.repeat(x[:1], bsz - len(rows), axis=0)]) if len(
            rows) < bsz else x

    t0 = time.perf_counter()
    dense_h = [_dense_hidden(graphdef, state, jnp.asarray(padded(rows, tokens)),
                             jnp.asarray(padded(rows, pl)), r=r) for rows in batches]
    alphas: dict[str, dict[str, np.ndarray]] = {}
    results = []
    dense_logp = np.zeros((s, r), np.float32)
    bar = tqdm(total=len(budgets) * len(batches), desc="teacher-forced", unit="batch",
               disable=a.no_progress)
    for label, sched in budgets:
        bp = np.broadcast_to(np.asarray(sched.budget_pages(np.arange(1, t + 1))), (bsz, t))
        bp = jnp.asarray(bp)
        out = {name: np.zeros((s, r), np.float32) for name in ESTIMATORS}
        for rows, hp in zip(batches, dense_h):
            res = _alphas(graphdef, state, jnp.asarray(padded(rows, tokens)),
                          jnp.asarray(padded(rows, pl)), bp, hp,
                          jnp.asarray(padded(rows, response_ids)), r=r, temperature=temperature,
                          top_k=top_k, page_size=a.page_size, dense_layers=dense_layers,
                          scorer=a.scorer, chunk=chunk)
            res = [np.asarray(x)[:len(rows)] for x in res]
            for name, x in zip(ESTIMATORS, res):
                out[name][rows] = x
            dense_logp[rows] = res[3]
            bar.update(1)
        alphas[label] = out
        step_budget = np.asarray(sched.budget_pages(lengths))
        # Token 0 comes from the dense prefill; later tokens ran sparse where the context's pages
        # exceed the budget.
        sparse = (-(-lengths // a.page_size) > step_budget) & (np.arange(r)[None, :] > 0)
        summary = summarise(out, mask, lengths, sparse, a, num_bins)
        results.append({"label": label, "schedule": sched.to_dict(), **summary})
    bar.close()
    t_tf = time.perf_counter() - t0
    # Alignment check: the dense forward's log-prob of each sampled token is what the dense
    # rollout recorded (same model, same temperature).
    check = float(np.abs(dense_logp - ro["logprobs"])[mask].max())

    result = {
        "command": "python scripts/measure_mismatch.py " + " ".join(
            shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv)),
        "model": str(a.model) if a.model is not None else f"preset:{a.preset}",
        "config": {"page_size": a.page_size, "dense_layers": list(dense_layers),
                   "scorer": a.scorer, "bin_tokens": a.bin_tokens, "num_bins": num_bins,
                   "min_count": a.min_count, "quantile": QUANTILE, "top_k": top_k,
                   "temperature": a.temperature, "n": a.n, "num_prompts": len(prompts),
                   "max_new_tokens": r, "stop_at_eos": a.stop_at_eos, "seed": a.seed,
                   "direction": "p = dense policy, q = sparse actor (teacher-forced)"},
        "sequences": int(s),
        "prompt_lengths": {"min": int(pl.min()), "max": int(pl.max())},
        "response_lengths": {"min": int(rl.min()), "mean": round(float(rl.mean()), 2),
                             "max": int(rl.max())},
        "bins": [{"start": i * a.bin_tokens,
                  "end": (i + 1) * a.bin_tokens if i < num_bins - 1 else None}
                 for i in range(num_bins)],
        "dense_logprob_check_max_abs_diff": check,
        "seconds": {"generate": round(t_gen, 2), "teacher_forced": round(t_tf, 2)},
        "budgets": results,
    }
    # The last bin is open-ended; close it at the longest sequence for plotting.
    result["bins"][-1]["end"] = max(int(lengths[mask].max()) + 1,
                                    result["bins"][-1]["start"] + 1)
    result["bins"][-1]["open_ended"] = True
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "mismatch.json").write_text(json.dumps(result, indent=1) + "\n")
    np.savez_compressed(a.out / "alphas.npz", mask=mask, lengths=lengths,
                        **{f"{label}/{name}": x for label, d in alphas.items()
                           for name, x in d.items()})
    if not a.no_plots:
        result["plots"] = [str(p) for p in plot(result, alphas, mask, a.out)]
    print_table(result)
    return result


def print_table(result: dict) -> None:
    bins = result["bins"]
    check = result["dense_logprob_check_max_abs_diff"]
    print(f"{result['sequences']} sequences, prompts {result['prompt_lengths']}, responses "
          f"{result['response_lengths']}; dense log-prob check {check:.1e}")
    w = max(6, *(len(b["label"]) for b in result["budgets"]))
    print(f"{'budget':>{w}}  sparse  mean(exact/bound/paper)   " + " ".join(
        f"{b['start']:>5}" for b in bins))
    for b in result["budgets"]:
        tails = " ".join("    -" if v is None else f"{v:5.3f}" for v in b["tail"]["exact"])
        m = b["mean"]
        print(f"{b['label']:>{w}}  {b['sparse_fraction']:5.0%}   {m['exact']:.3f}/"
              f"{m['topk_bound']:.3f}/{m['paper']:.3f}       {tails}")
    print("(per-bin columns: 5th percentile of exact alpha; bins by step length, tokens)")


if __name__ == "__main__":
    main()
