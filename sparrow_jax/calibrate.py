"""``sparrow calibrate``: a budget schedule for a model and prompt set (docs/design.md, section 6).

Measure: dense rollouts of the prompts (n samples each), then alpha per token at every candidate
budget through the teacher-forced sparse forward (:mod:`sparrow_jax.measure`). Search: the tail
statistic per (length bin, budget) of the configured estimator into
:func:`~sparrow_jax.schedule.search_schedule`. Validate: sparse rollouts with the composed
schedule on held-out prompts, alpha from the rollouts' recorded top-k against the dense recompute
(``exact``: the teacher-forced forward at the schedule's budgets, since rollouts keep only the
top-k); a bin whose tail misses the target is raised to the next candidate budget (then a
cumulative max) and the schedule validated again, at most ``validation_rounds`` times in all.
Cost: the per-step cost model's speedup of the schedule over dense decoding, and with
``step_times`` the speedup measured decode-step times predict (:mod:`sparrow_jax.step_times`).

Writes ``OUT/schedule.yaml`` (:meth:`BudgetSchedule.to_yaml`), ``OUT/calibration.json`` and PNG
plots (``calibration.png``, ``alpha_tail.png``, ``alpha_hist.png``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from sparrow_jax.config import ConfigError, from_dict, load_yaml_config, to_dict
from sparrow_jax.data import NeedleConfig

__all__ = ["CalibrateConfig", "load_calibrate_config", "calibrate", "load_model", "load_prompts",
           "raise_missed_bins"]

ESTIMATOR_NAMES = ("exact", "topk_bound", "paper")


@dataclasses.dataclass(frozen=True)
class CalibrateConfig:
    """What ``sparrow calibrate --config FILE.yaml`` reads (every key optional but a model).

    model / preset: an HF model folder, or a random preset of ``configs/models`` (tests); exactly
      one. dtype: ``auto`` (bfloat16 on an accelerator, float32 on CPU), float32 or bfloat16.
    prompt_file: .txt (a prompt per line: token ids, or text for the folder's tokenizer),
      .jsonl/.json/.parquet (column ``prompt_column``, through the chat template); empty: the
      needle task with ``needle``'s layout.
    num_prompts, held_out_prompts: prompts measured, and the next ones validated on.
    n, max_new_tokens, temperature, stop_at_eos: the rollouts (temperature > 0; without
      stop_at_eos every response runs to max_new_tokens, filling the longer bins).
    budgets: candidate top-k page counts (reserved pages excluded, as schedule tables count).
    bin_tokens, min_count: length bins and the fewest tokens a bin's tail needs.
    target, estimator, top_k: the tail's threshold, its estimator, and the top-k of
      ``topk_bound``/``paper`` (and of the rollouts' recorded log-probs).
    validation_rounds: sparse validations at most (each may raise the bins that miss).
    intensity: the cost model's FLOP-equivalents per element moved (590: an H100 in bfloat16).
    step_times: a step-time file measured on the target device (:mod:`sparrow_jax.step_times`:
      dense and sparse decode-step times, e.g. ``scripts/bench_rollout.py --phase profile``'s
      JSON); when given, the schedule's measured speedup is reported beside the cost model's.
      It must come from the same model shape (a demo model's schedule against a 1.7B profile
      says little).
    """

    model: str = ""
    preset: str = ""
    dtype: str = "auto"
    prompt_file: str = ""
    prompt_column: str = "prompt"
    needle: NeedleConfig = NeedleConfig()
    num_prompts: int = 16
    held_out_prompts: int = 8
    n: int = 4
    max_new_tokens: int = 256
    temperature: float = 1.0
    stop_at_eos: bool = False
    budgets: tuple[int, ...] = (13, 29, 61, 125, 253)
    page_size: int = 16
    dense_layers: tuple[int, ...] = (0, 1)
    scorer: str = "centroid"
    bin_tokens: int = 2000
    min_count: int = 100
    target: float = 0.86
    estimator: str = "paper"
    top_k: int = 20
    validation_rounds: int = 3
    intensity: float = 590.0
    step_times: str = ""
    batch_size: int = 16
    gen_prompts: int = 64
    seed: int = 0
    out_dir: str = "runs/calibrate"
    progress: bool = True
    plots: bool = True

    def __post_init__(self):
        if bool(self.model) == bool(self.preset):
            raise ConfigError(f"give exactly one of model and preset, got model={self.model!r}, "
                              f"preset={self.preset!r}")
        for name in ("num_prompts", "held_out_prompts", "n", "max_new_tokens", "page_size",
                     "bin_tokens", "min_count", "top_k", "validation_rounds", "batch_size",
                     "gen_prompts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ConfigError(f"temperature: must be > 0 (alpha compares softmax(logits / T)), "
                              f"got {self.temperature}")
        if not self.budgets or any(b < 0 for b in self.budgets):
            raise ConfigError(f"budgets: must be a non-empty list of top-k page counts >= 0, got "
                              f"{list(self.budgets)}")
        if len(set(self.budgets)) != len(self.budgets):
            raise ConfigError(f"budgets: repeated values in {list(self.budgets)}")
        if not 0.0 < self.target <= 1.0:
            raise ConfigError(f"target: must be in (0, 1], got {self.target}")
        if self.estimator not in ESTIMATOR_NAMES:
            raise ConfigError(f"estimator: must be one of {ESTIMATOR_NAMES}, got "
                              f"{self.estimator!r}")
        if self.scorer not in ("centroid", "quest"):
            raise ConfigError(f"scorer: must be centroid or quest, got {self.scorer!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype: must be auto, float32 or bfloat16, got {self.dtype!r}")
        if any(i < 0 for i in self.dense_layers):
            raise ConfigError(f"dense_layers: layer indices must be >= 0, got "
                              f"{list(self.dense_layers)}")
        if not self.intensity >= 0:
            raise ConfigError(f"intensity: must be >= 0, got {self.intensity}")
        if not self.out_dir:
            raise ConfigError("out_dir: must name a folder, got ''")
        if self.step_times:   # read now: a bad file fails before any model work
            from sparrow_jax.step_times import load_step_times
            try:
                load_step_times(self.step_times).sparse_fit(self.page_size)
            except ValueError as e:
                raise ConfigError(f"step_times: {e}") from None


def load_calibrate_config(path: str | Path, **overrides) -> CalibrateConfig:
    """A YAML file (keys of :class:`CalibrateConfig`), then ``overrides`` -> the config; a bad
    key or value is a one-line :class:`ConfigError` naming the file and the key."""
    return load_yaml_config(path, lambda data: from_dict(CalibrateConfig, {**data, **overrides}))


# --------------------------------------------------------------------------- model and prompts
def load_model(model: str | Path | None, preset: str | None, dtype: str = "auto", seed: int = 0):
    """An HF folder or a random preset -> (model, ModelConfig, EOS ids)."""
    import jax
    import jax.numpy as jnp

    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.hf_io import load_generation_config, load_qwen3
    from sparrow_jax.models.qwen3 import init_model

    if dtype == "auto":
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    else:
        dtype = jnp.dtype(dtype)
    if model:
        net, config = load_qwen3(Path(model), dtype=dtype)
        eos = tuple(load_generation_config(Path(model)).get("eos_token_ids", ()))
        return net, config, eos or tuple(config.eos_token_ids or ())
    config = ModelConfig.preset(preset)
    return init_model(config, seed=seed, dtype=dtype), config, tuple(config.eos_token_ids or ())


def load_prompts(count: int, *, prompt_file: str | Path | None = None,
                 prompt_column: str = "prompt", needle: NeedleConfig | None = None,
                 seed: int = 0, model: str | Path | None = None) -> list[list[int]]:
    """``count`` prompts (token id lists): the first of a prompt file, or needle prompts drawn
    with ``seed`` (the same seed gives the same prompts, a longer count extends them)."""
    from sparrow_jax.data import NeedleTask

    if not prompt_file:
        prompts, _ = NeedleTask(needle or NeedleConfig()).sample(
            np.random.default_rng([seed, 7]), count)
        return prompts
    path = Path(prompt_file)
    if path.suffix in (".jsonl", ".json", ".parquet"):
        from sparrow_jax.data import encode_prompt, load_records

        records = load_records(path)[:count]
        for r in records:
            if prompt_column not in r:
                raise ConfigError(f"{path}: no column {prompt_column!r} (prompt_column); "
                                  f"columns: {sorted(r)}")
        return [encode_prompt(r[prompt_column], _tokenizer(model)) for r in records]
    if not path.is_file():
        raise ConfigError(f"prompt_file: no file {path}")
    prompts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            prompts.append([int(t) for t in line.replace(",", " ").split()])
        except ValueError:
            prompts.append(list(_tokenizer(model).encode(line)))
        if len(prompts) == count:
            break
    return prompts


def _tokenizer(model):
    from sparrow_jax.models.tokenizer import load_tokenizer

    if not model or not (Path(model) / "tokenizer.json").is_file():
        raise ConfigError("text prompts need a model folder with tokenizer.json")
    return load_tokenizer(Path(model))


# --------------------------------------------------------------------------- validation
def raise_missed_bins(schedule, missed, budgets):
    """Each bin of ``missed`` raised to the next candidate of ``budgets`` above its entry, then a
    cumulative max -> the new schedule, or None when no missed bin can be raised."""
    table = list(schedule.table)
    raised = False
    for i in missed:
        bigger = [b for b in sorted(budgets) if b > table[i]]
        if bigger:
            table[i], raised = bigger[0], True
    if not raised:
        return None
    return dataclasses.replace(schedule, table=tuple(int(v) for v in np.maximum.accumulate(table)))


def _validate(model, prompts, schedule, c: CalibrateConfig, rollout_config, num_bins) -> dict:
    """Sparse rollouts of ``prompts`` at ``schedule`` -> the tail per bin of c.estimator."""
    from sparrow_jax.measure import (bin_tails, finite_list, host_rollouts, measure_alphas,
                                     recorded_alphas, sample_rollouts)

    rollouts = sample_rollouts(model, prompts, rollout_config, c.seed + 1, schedule,
                               c.gen_prompts)
    r = c.max_new_tokens
    if c.estimator == "exact":
        m = measure_alphas(model, host_rollouts(rollouts), [("schedule", schedule)],
                           max_new_tokens=r, temperature=c.temperature, top_k=c.top_k,
                           page_size=c.page_size, dense_layers=c.dense_layers, scorer=c.scorer,
                           batch_size=c.batch_size, progress=c.progress)
        alpha, mask, lengths = m.alphas["schedule"]["exact"], m.mask, m.lengths
    else:
        alpha = np.concatenate([recorded_alphas(model, ro, c.temperature, c.top_k)[c.estimator]
                                for ro in rollouts])
        mask = np.concatenate([np.asarray(ro.response_mask) for ro in rollouts])
        lengths = np.concatenate([np.asarray(ro.prompt_lengths) for ro in rollouts])[:, None] \
            + np.arange(r)[None, :]
    tails = bin_tails(alpha, mask, lengths, bin_tokens=c.bin_tokens, num_bins=num_bins,
                      min_count=c.min_count)
    bins = np.minimum(lengths // c.bin_tokens, num_bins - 1)
    missed = [int(i) for i in np.flatnonzero(np.isfinite(tails) & (tails < c.target))]
    return {"table": list(schedule.table), "tail": finite_list(tails),
            "counts": np.bincount(bins[mask], minlength=num_bins)[:num_bins].tolist(),
            "mean": round(float(alpha[mask].mean()), 6), "missed_bins": missed,
            "met": not missed}


# --------------------------------------------------------------------------- the calibration
def calibrate(c: CalibrateConfig) -> dict:
    """Measure, search, validate, cost; writes the outputs to ``c.out_dir`` and returns the
    JSON table as a dict (its ``schedule`` entry is the final :class:`BudgetSchedule`'s
    ``to_dict``)."""
    from tqdm.auto import tqdm

    from sparrow_jax.cost_model import DecodeCost
    from sparrow_jax.measure import (bin_edges, bin_tails, finite_list, host_rollouts,
                                     measure_alphas, num_bins_for, sample_rollouts, summarise)
    from sparrow_jax.rollout.engine import RolloutConfig
    from sparrow_jax.schedule import BudgetSchedule, search_schedule

    stages = tqdm(total=3 + c.validation_rounds, desc="calibrate", unit="stage",
                  disable=not c.progress)
    t0 = time.perf_counter()
    model, model_config, eos = load_model(c.model, c.preset, c.dtype, c.seed)
    if max(c.dense_layers, default=0) >= model_config.num_hidden_layers:
        raise ConfigError(f"dense_layers: {list(c.dense_layers)} names a layer the model's "
                          f"{model_config.num_hidden_layers} do not have")
    prompts = load_prompts(c.num_prompts + c.held_out_prompts, prompt_file=c.prompt_file,
                           prompt_column=c.prompt_column, needle=c.needle, seed=c.seed,
                           model=c.model)
    if len(prompts) < c.num_prompts + c.held_out_prompts:
        raise ConfigError(f"prompt_file: {c.prompt_file} holds {len(prompts)} prompts, fewer "
                          f"than num_prompts + held_out_prompts = "
                          f"{c.num_prompts + c.held_out_prompts}")
    measured, held_out = prompts[:c.num_prompts], prompts[c.num_prompts:]
    top_k = min(c.top_k, model_config.vocab_size)
    rollout_config = RolloutConfig(
        n=c.n, max_new_tokens=c.max_new_tokens, temperature=c.temperature,
        eos_ids=eos if c.stop_at_eos else (), logprob_top_k=top_k, page_size=c.page_size,
        dense_layers=c.dense_layers, scorer=c.scorer, progress=c.progress)

    # Measure: dense rollouts, then alpha at every candidate budget.
    stages.set_postfix_str("dense rollouts")
    ro = host_rollouts(sample_rollouts(model, measured, rollout_config, c.seed, None,
                                       c.gen_prompts))
    stages.update(1)
    budgets = sorted(c.budgets)
    candidates = [(str(b), BudgetSchedule.fixed(b + 3, page_size=c.page_size)) for b in budgets]
    stages.set_postfix_str("teacher-forced alphas")
    m = measure_alphas(model, ro, candidates, max_new_tokens=c.max_new_tokens,
                       temperature=c.temperature, top_k=top_k, page_size=c.page_size,
                       dense_layers=c.dense_layers, scorer=c.scorer, batch_size=c.batch_size,
                       progress=c.progress)
    stages.update(1)
    num_bins = num_bins_for(m.lengths, m.mask, c.bin_tokens)
    per_budget = [{"label": label, "top_k_pages": b, "schedule": sched.to_dict(),
                   **summarise(m.alphas[label], m.mask, m.lengths, m.sparse[label],
                               bin_tokens=c.bin_tokens, num_bins=num_bins,
                               min_count=c.min_count)}
                  for b, (label, sched) in zip(budgets, candidates)]
    tails = np.stack([bin_tails(m.alphas[label][c.estimator], m.mask, m.lengths,
                                bin_tokens=c.bin_tokens, num_bins=num_bins,
                                min_count=c.min_count) for label, _ in candidates], axis=1)

    # Search, then validate on held-out prompts, raising the bins that miss.
    searched = dataclasses.replace(
        search_schedule(tails, budgets, c.target, c.bin_tokens, name="calibrated"),
        page_size=c.page_size)
    stages.update(1)
    schedule, rounds = searched, []
    for i in range(c.validation_rounds):
        stages.set_postfix_str(f"validation {i + 1}")
        rounds.append(_validate(model, held_out, schedule, c, rollout_config, num_bins))
        stages.update(1)
        if rounds[-1]["met"] or i == c.validation_rounds - 1:
            break
        raised = raise_missed_bins(schedule, rounds[-1]["missed_bins"], budgets)
        if raised is None:          # every missed bin is at the largest candidate already
            break
        schedule = raised
    stages.close()

    # Cost: the schedule against dense decoding, n samples of the mean prompt.
    cost = DecodeCost.from_model_config(model_config, c.intensity, dense_layers=c.dense_layers,
                                        page_size=c.page_size,
                                        summary_vectors=2 if c.scorer == "quest" else 1)
    prompt_len = int(round(float(np.mean([len(p) for p in measured]))))
    gen_len = int(round(float(ro["response_lengths"].mean())))
    dense_cost = cost.rollout_cost(prompt_len, gen_len, c.n)
    sparse_cost = cost.rollout_cost(prompt_len, gen_len, c.n, schedule)

    timed = None
    if c.step_times:
        from sparrow_jax.step_times import load_step_times, measured_speedup

        timed = measured_speedup(load_step_times(c.step_times), schedule, prompt_len, gen_len,
                                 page_size=c.page_size)
    pl = ro["prompt_lengths"]
    result = {
        "command": "sparrow calibrate",
        "config": to_dict(c) | {"num_bins": num_bins, "quantile": 0.05, "top_k": top_k,
                                "direction": "p = dense policy, q = sparse actor"},
        "model": c.model or f"preset:{c.preset}",
        "sequences": int(pl.shape[0]),
        "prompt_lengths": {"min": int(pl.min()), "max": int(pl.max())},
        "response_lengths": {"min": int(ro["response_lengths"].min()),
                             "mean": round(float(ro["response_lengths"].mean()), 2),
                             "max": int(ro["response_lengths"].max())},
        "bins": bin_edges(num_bins, c.bin_tokens, int(m.lengths[m.mask].max())),
        "dense_logprob_check_max_abs_diff": float(
            np.abs(m.dense_logprobs - ro["logprobs"])[m.mask].max()),
        "budgets": per_budget,
        "tail_table": {"estimator": c.estimator, "budgets": budgets,
                       "rows": [finite_list(row) for row in tails]},
        "searched_table": list(searched.table),
        "validation": rounds,
        "met": bool(rounds[-1]["met"]),
        "schedule": schedule.to_dict(),
        "cost": {"prompt_tokens": prompt_len, "response_tokens": gen_len, "samples": c.n,
                 "intensity": c.intensity, "dense": dense_cost, "schedule": sparse_cost,
                 "speedup": round(dense_cost / sparse_cost, 4), "measured": timed},
        "seconds": round(time.perf_counter() - t0, 2),
    }
    out = Path(c.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "schedule.yaml").write_text(schedule.to_yaml())
    np.savez_compressed(out / "alphas.npz", mask=m.mask, lengths=m.lengths,
                        **{f"{label}/{name}": x for label, d in m.alphas.items()
                           for name, x in d.items()})
    if c.plots:
        from sparrow_jax.measure import plot_alphas

        result["plots"] = [str(p) for p in plot_alphas(result, m.alphas, m.mask, out, c.target)]
        result["plots"].append(str(plot_calibration(result, out / "calibration.png")))
    (out / "calibration.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


# --------------------------------------------------------------------------- report
def format_report(result: dict) -> str:
    """Per bin: tokens, the measured tail at each candidate, the chosen budget, the held-out
    tail of every validation round; then the verdict and the cost model's speedup."""
    c = result["config"]
    budgets = result["tail_table"]["budgets"]
    lines = [f"{result['sequences']} dense rollouts, prompts {result['prompt_lengths']}, "
             f"responses {result['response_lengths']}; estimator {c['estimator']}, target "
             f"{c['target']}, bins of {c['bin_tokens']} tokens",
             f"{'bin':>6} {'tokens':>7}  " + " ".join(f"{'k=' + str(b):>7}" for b in budgets)
             + "   table  " + "  ".join(f"held-out {i + 1}" for i in range(
                 len(result["validation"])))]
    first = result["budgets"][0]["counts"]
    for i, (edge, row) in enumerate(zip(result["bins"], result["tail_table"]["rows"])):
        if not first[i]:
            continue
        vals = " ".join("      -" if v is None else f"{v:7.3f}" for v in row)
        held = "  ".join(f"{v['table'][i]:>4}:" + ("    -" if v["tail"][i] is None else
                                                   f"{v['tail'][i]:5.3f}")
                         for v in result["validation"])
        chosen = result["schedule"]["table"][i]
        lines.append(f"{edge['start']:>6} {first[i]:>7}  {vals}   {chosen:>5}  {held}")
    last = result["validation"][-1]
    verdict = ("meets the target in every measured bin" if result["met"] else
               f"misses the target in bins {last['missed_bins']}")
    lines.append(f"schedule {result['schedule']['table']} (top-k pages per bin; searched "
                 f"{result['searched_table']}): held-out {verdict} after "
                 f"{len(result['validation'])} validation round(s)")
    lines.append(f"cost model: {result['cost']['speedup']:.3f}x cheaper than dense "
                 f"({result['cost']['prompt_tokens']} + {result['cost']['response_tokens']} "
                 f"tokens, n = {result['cost']['samples']}, I = {result['cost']['intensity']})")
    measured = result["cost"].get("measured")
    if measured:
        lines.append(f"measured: {measured['speedup']:.3f}x faster than dense (step times from "
                     f"{measured['file']}, batch {measured['batch']}; sparse fit within "
                     f"{100 * measured['fit_residual']:.1f}%"
                     + ("; lengths outside the measured contexts" if measured["extrapolated"]
                        else "") + ")")
    return "\n".join(lines)


def plot_calibration(result: dict, path: Path) -> Path:
    """Left: measured tail per bin at each candidate and the held-out tail of each validation
    round, with the target. Right: the searched and final tables."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    centres = [0.5 * (e["start"] + e["end"]) for e in result["bins"]]
    target = result["config"]["target"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(result["tail_table"]["budgets"])))
    for j, (b, color) in enumerate(zip(result["tail_table"]["budgets"], colors)):
        pts = [(x, row[j]) for x, row in zip(centres, result["tail_table"]["rows"])
               if row[j] is not None]
        if pts:
            left.plot(*zip(*pts), marker="o", ms=3, color=color, label=f"dense rollouts, k={b}")
    for i, v in enumerate(result["validation"]):
        pts = [(x, t) for x, t in zip(centres, v["tail"]) if t is not None]
        if pts:
            left.plot(*zip(*pts), marker="s", ms=4, color="black", linewidth=2,
                      alpha=0.4 + 0.6 * (i + 1) / len(result["validation"]),
                      label=f"held-out, round {i + 1}")
    left.axhline(target, color="red", linestyle="--", linewidth=1, label=f"target {target}")
    left.set_xlabel("sequence length (bin centre, tokens)")
    left.set_ylabel(f"5th percentile of alpha ({result['tail_table']['estimator']})")
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    right.step(centres, result["searched_table"], where="mid", label="searched", linestyle="--")
    right.step(centres, result["schedule"]["table"], where="mid", label="final")
    right.set_xlabel("sequence length (bin centre, tokens)")
    right.set_ylabel("top-k pages (reserved excluded)")
    measured = result["cost"].get("measured")
    right.set_title(f"cost model: {result['cost']['speedup']:.2f}x vs dense"
                    + (f", measured {measured['speedup']:.2f}x" if measured else ""), fontsize=10)
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
