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
import json
import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from sparrow_jax import calibrate, measure  # noqa: E402
from sparrow_jax.data import NeedleConfig  # noqa: E402
from sparrow_jax.plot import TAIL_TARGET  # noqa: E402
from sparrow_jax.rollout.engine import RolloutConfig  # noqa: E402
from sparrow_jax.schedule import PAPER_TABLES, BudgetSchedule  # noqa: E402


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
    return calibrate.load_model(a.model, a.preset, a.dtype, a.seed)


def load_prompts(a) -> list[list[int]]:
    needle = None
    if a.needle_len is not None:
        lo, hi = int_list(a.needle_len)
        needle = NeedleConfig(min_prompt_len=lo, max_prompt_len=hi)
    try:
        return calibrate.load_prompts(a.num_prompts, prompt_file=a.prompt_file,
                                      prompt_column=a.prompt_column, needle=needle,
                                      seed=a.seed, model=a.model)
    except ValueError as e:
        raise SystemExit(str(e)) from None


# --------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    a = parse_args(argv)
    budgets = parse_budgets(a.budgets, a.page_size)
    dense_layers = int_list(a.dense_layers)
    model, config, eos = load_model(a)
    prompts = load_prompts(a)
    if not prompts:
        raise SystemExit("no prompts")
    t0 = time.perf_counter()
    cfg = RolloutConfig(n=a.n, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                        eos_ids=eos if a.stop_at_eos else (), logprob_top_k=1,
                        page_size=a.page_size, dense_layers=dense_layers, scorer=a.scorer,
                        progress=not a.no_progress)
    ro = measure.host_rollouts(measure.sample_rollouts(model, prompts, cfg, a.seed, None,
                                                       a.gen_prompts))
    t_gen = time.perf_counter() - t0

    s = ro["tokens"].shape[0]
    r = a.max_new_tokens
    pl, rl = ro["prompt_lengths"], ro["response_lengths"]
    temperature = a.temperature if a.temperature > 0 else 1.0
    top_k = min(a.top_k, config.vocab_size)
    t0 = time.perf_counter()
    m = measure.measure_alphas(model, ro, budgets, max_new_tokens=r, temperature=temperature,
                               top_k=top_k, page_size=a.page_size, dense_layers=dense_layers,
                               scorer=a.scorer, batch_size=a.batch_size,
                               progress=not a.no_progress)
    alphas, mask, lengths = m.alphas, m.mask, m.lengths
    num_bins = measure.num_bins_for(lengths, mask, a.bin_tokens)
    results = [{"label": label, "schedule": sched.to_dict(),
                **measure.summarise(alphas[label], mask, lengths, m.sparse[label],
                                    bin_tokens=a.bin_tokens, num_bins=num_bins,
                                    min_count=a.min_count)}
               for label, sched in budgets]
    t_tf = time.perf_counter() - t0
    # Alignment check: the dense forward's log-prob of each sampled token is what the dense
    # rollout recorded (same model, same temperature).
    check = float(np.abs(m.dense_logprobs - ro["logprobs"])[mask].max())

    result = {
        "command": "python scripts/measure_mismatch.py " + " ".join(
            shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv)),
        "model": str(a.model) if a.model is not None else f"preset:{a.preset}",
        "config": {"page_size": a.page_size, "dense_layers": list(dense_layers),
                   "scorer": a.scorer, "bin_tokens": a.bin_tokens, "num_bins": num_bins,
                   "min_count": a.min_count, "quantile": measure.QUANTILE, "top_k": top_k,
                   "temperature": a.temperature, "n": a.n, "num_prompts": len(prompts),
                   "max_new_tokens": r, "stop_at_eos": a.stop_at_eos, "seed": a.seed,
                   "direction": "p = dense policy, q = sparse actor (teacher-forced)"},
        "sequences": int(s),
        "prompt_lengths": {"min": int(pl.min()), "max": int(pl.max())},
        "response_lengths": {"min": int(rl.min()), "mean": round(float(rl.mean()), 2),
                             "max": int(rl.max())},
        "bins": measure.bin_edges(num_bins, a.bin_tokens, int(lengths[mask].max())),
        "dense_logprob_check_max_abs_diff": check,
        "seconds": {"generate": round(t_gen, 2), "teacher_forced": round(t_tf, 2)},
        "budgets": results,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "mismatch.json").write_text(json.dumps(result, indent=1) + "\n")
    np.savez_compressed(a.out / "alphas.npz", mask=mask, lengths=lengths,
                        **{f"{label}/{name}": x for label, d in alphas.items()
                           for name, x in d.items()})
    if not a.no_plots:
        result["plots"] = [str(p) for p in measure.plot_alphas(result, alphas, mask, a.out,
                                                               TAIL_TARGET)]
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
