"""``sparrow calibrate`` end to end on a tiny random model, its pieces against independent
references, and the sparse actor's log-probs against what the decode loop recorded."""

from __future__ import annotations

import contextlib
import io
import json

import jax
import numpy as np
import pytest
import yaml

from sparrow_jax.calibrate import raise_missed_bins
from sparrow_jax.cli import main
from sparrow_jax.config import ModelConfig
from sparrow_jax.measure import host_rollouts, measure_alphas, recorded_alphas
from sparrow_jax.mismatch import acceptance_rate
from sparrow_jax.models.hf_io import save_qwen3
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rollout.engine import RolloutConfig, generate
from sparrow_jax.schedule import BudgetSchedule
from sparrow_jax.sparse_actor import sparse_logits, sparse_logprobs

P = 4
MAX_NEW = 24
BUDGETS = (0, 2, 9, 13)   # top-k pages: 9 + 3 pages of 4 hold lengths < 48, 13 + 3 all (< 64)
TARGET = 0.999
MIN_COUNT = 4
BIN = 16
TINY = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_ids=(0,))


@pytest.fixture(scope="module")
def model():
    return init_model(TINY, seed=1)


def _config(tmp, **edits) -> dict:
    return {"model": str(tmp / "model"), "needle": {"min_prompt_len": 28, "max_prompt_len": 40},
            "num_prompts": 3, "held_out_prompts": 2, "n": 2, "max_new_tokens": MAX_NEW,
            "budgets": list(BUDGETS), "page_size": P, "dense_layers": [0], "bin_tokens": BIN,
            "min_count": MIN_COUNT, "target": TARGET, "estimator": "exact", "top_k": 8,
            "batch_size": 4, "validation_rounds": 2, "out_dir": str(tmp / "out"), **edits}


# Step times in ms that follow known laws (dense 2 + 0.05 * context; sparse 2 + 0.01 * context
# + 0.04 * read), so the measured speedup can be summed by hand.
STEP_TIMES = {"batch": 8,
              "dense": [{"context": c, "step_ms": 2 + 0.05 * c} for c in (8, 64, 128)],
              "sparse": [{"context": c, "budget_pages": b, "step_ms": 2 + 0.01 * c + 0.04 * min(
                  c, b * P)} for c, b in ((16, 3), (64, 5), (128, 12), (96, 16))]}


@pytest.fixture(scope="module")
def run(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("calibrate")
    save_qwen3(model, tmp / "model")
    path = tmp / "cal.yaml"
    steps = tmp / "steps.json"
    steps.write_text(json.dumps(STEP_TIMES))
    path.write_text(yaml.safe_dump(_config(tmp, step_times=str(steps))))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):        # capsys is per test; this fixture is not
        rc = main(["calibrate", "--config", str(path), "--no-progress"])
    return rc, out.getvalue(), tmp / "out"


def _reference_tails(saved, estimator: str) -> np.ndarray:
    """``[num_bins, num_budgets]`` 5th percentiles per bin with np.percentile (NaN below
    MIN_COUNT tokens), from the saved per-token alphas."""
    mask, lengths = saved["mask"], saved["lengths"]
    num_bins = -(-int(lengths[mask].max() + 1) // BIN)
    bins = np.minimum(lengths // BIN, num_bins - 1)
    out = np.full((num_bins, len(BUDGETS)), np.nan)
    for j, b in enumerate(BUDGETS):
        x = saved[f"{b}/{estimator}"]
        for i in range(num_bins):
            sel = x[mask & (bins == i)]
            if sel.size >= MIN_COUNT:
                out[i, j] = np.percentile(sel, 5)
    return out


def test_each_bin_gets_the_smallest_budget_that_meets_the_target(run):
    rc, stdout, out = run
    assert rc == 0
    result = json.loads((out / "calibration.json").read_text())
    tails = _reference_tails(np.load(out / "alphas.npz"), "exact")
    np.testing.assert_allclose(np.array(result["tail_table"]["rows"], dtype=float), tails,
                               atol=1e-5)
    measured = np.flatnonzero(~np.isnan(tails).all(axis=1))
    assert len(measured) >= 2
    # Where the budget holds every page of a bin, sparse == dense and alpha == 1: every bin has
    # a candidate that meets the target, and the largest always does.
    choice = {i: min(b for b, t in zip(BUDGETS, tails[i]) if t >= TARGET) for i in measured}
    table = result["searched_table"]
    for i in measured:
        assert table[i] == max(choice[k] for k in measured if k <= i), (i, table, choice)
    assert table[:measured[0]] == [table[measured[0]]] * measured[0]
    assert len(set(choice.values())) > 1, choice           # the staircase is not trivial
    final = result["schedule"]["table"]
    assert final == sorted(final) and all(f >= s for f, s in zip(final, table))
    assert BudgetSchedule.from_yaml(out / "schedule.yaml").to_dict() == result["schedule"]
    assert result["schedule"]["page_size"] == P
    for name in ("calibration.png", "alpha_tail.png", "alpha_hist.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_validation_is_recorded_and_printed(run):
    rc, stdout, out = run
    result = json.loads((out / "calibration.json").read_text())
    rounds = result["validation"]
    assert 1 <= len(rounds) <= 2 and rounds[0]["table"] == result["searched_table"]
    last = rounds[-1]
    assert last["table"] == result["schedule"]["table"]
    assert result["met"] == last["met"] == (not last["missed_bins"])
    # The schedule gives each measured bin a budget holding its pages or alpha >= target on the
    # measured rollouts; on held-out ones, every finite tail is compared with the target.
    for i, t in enumerate(last["tail"]):
        assert (t is not None and t < TARGET) == (i in last["missed_bins"])
    assert "held-out" in stdout and ("meets the target" in stdout or "misses" in stdout)
    assert result["cost"]["speedup"] > 0 and "cheaper than dense" in stdout


def test_measured_speedup_from_the_step_time_file(run):
    """The schedule's decode steps summed under the file's laws, by hand."""
    rc, stdout, out = run
    result = json.loads((out / "calibration.json").read_text())
    cost, schedule = result["cost"], BudgetSchedule.from_yaml(out / "schedule.yaml")
    lengths = np.arange(cost["prompt_tokens"] + 1,
                        cost["prompt_tokens"] + cost["response_tokens"] + 1)
    budget = np.asarray(schedule.budget_pages(lengths))
    dense = 2 + 0.05 * lengths
    sparse = np.where(-(-lengths // P) <= budget, dense,
                      2 + 0.01 * lengths + 0.04 * np.minimum(lengths, budget * P))
    measured = cost["measured"]
    assert measured["speedup"] == pytest.approx(dense.sum() / sparse.sum(), abs=1e-4)
    assert measured["fit_residual"] < 1e-9   # (the hand-worked sparse sums: test_step_times.py)
    assert f"measured: {measured['speedup']:.3f}x faster than dense" in stdout


def test_raise_missed_bins_steps_one_candidate():
    s = BudgetSchedule.from_table([1, 2, 2, 4], bin_tokens=16)
    assert raise_missed_bins(s, [1], [1, 2, 4, 8]).table == (1, 4, 4, 4)
    assert raise_missed_bins(s, [0, 3], [1, 2, 4, 8]).table == (2, 2, 2, 8)
    assert raise_missed_bins(BudgetSchedule.from_table([1, 8]), [1], [1, 8]) is None


@pytest.fixture(scope="module")
def sparse_rollout(model):
    """A sparse rollout of two prompts at a table schedule (budgets of 3, 4 and 5 pages)."""
    schedule = BudgetSchedule.from_table([0, 1, 2], bin_tokens=BIN, page_size=P)
    cfg = RolloutConfig(n=2, max_new_tokens=12, temperature=0.7, page_size=P, dense_layers=(0,),
                        logprob_top_k=8)
    rng = np.random.default_rng(3)
    return schedule, generate(model, [list(rng.integers(1, 40, size=k)) for k in (21, 30)], cfg,
                              jax.random.key(0), schedule=schedule)


def test_recorded_topk_alphas_equal_the_teacher_forced_ones(model, sparse_rollout):
    """Validation's alphas (the rollout's recorded top-k against the dense recompute) equal the
    measurement's (the teacher-forced sparse forward at the schedule's budgets)."""
    schedule, ro = sparse_rollout
    got = recorded_alphas(model, ro, 0.7, top_k=8)
    want = measure_alphas(model, host_rollouts([ro]), [("s", schedule)], max_new_tokens=12,
                          temperature=0.7, top_k=8, page_size=P, dense_layers=(0,))
    mask = np.asarray(ro.response_mask)
    for name in ("topk_bound", "paper"):
        np.testing.assert_allclose(got[name][mask], want.alphas["s"][name][mask], atol=2e-5)
    assert want.alphas["s"]["paper"][mask].min() < 0.99    # sparse somewhere


def test_sparse_logprobs_equal_the_decode_loop(model, sparse_rollout):
    """On a rollout's tokens at its recorded budgets, the sparse actor's log-probs are what the
    decode loop recorded; sparse_logits agree with them and differ from the dense logits."""
    schedule, ro = sparse_rollout
    tokens, pl = np.asarray(ro.tokens), np.asarray(ro.prompt_lengths)
    # Response token j was sampled by the query at position p + j - 1 with the budget recorded
    # in slot j (slot 0 is prefill's, dense: position p - 1 < p attends densely anyway).
    slots = pl[:, None] + np.arange(12)[None, :]
    budgets = np.full(tokens.shape, 3, np.int32)
    np.put_along_axis(budgets, slots - 1, np.maximum(np.asarray(ro.budget_pages), 3), axis=1)
    lp = np.asarray(sparse_logprobs(model, tokens, budgets, prompt_lengths=pl, page_size=P,
                                    dense_layers=(0,), temperature=0.7))
    np.testing.assert_allclose(np.take_along_axis(lp, slots, axis=1), np.asarray(ro.logprobs),
                               atol=2e-5)
    # The schedule itself gives position i the budget of lengths i + 1: the same numbers at the
    # response (past it the recorded budgets are padding).
    logits = np.asarray(sparse_logits(model, tokens, schedule, prompt_lengths=pl, page_size=P,
                                      dense_layers=(0,), temperature=0.7))
    logq = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    at = np.take_along_axis(logq[:, :-1], tokens[:, 1:, None], axis=2)[..., 0]
    np.testing.assert_allclose(np.take_along_axis(at, slots - 1, axis=1),
                               np.take_along_axis(lp, slots, axis=1), atol=2e-5)
    alpha = np.asarray(acceptance_rate(np.asarray(model(tokens)) / 0.7, logits))
    assert alpha.min() < 0.999


BAD = [
    ({"estimator": "papr"}, ["estimator", "'papr'"]),
    ({"target": 1.5}, ["target", "1.5"]),
    ({"budgets": []}, ["budgets", "[]"]),
    ({"budget": [1]}, ["'budget'", "did you mean 'budgets'"]),
    ({"preset": "tiny"}, ["model", "preset", "exactly one"]),
    ({"n": "two"}, ["n", "'two'"]),
    ({"temperature": 0}, ["temperature", "0"]),
    ({"step_times": "/nonexistent/steps.json"}, ["step_times", "no file /nonexistent"]),
]


@pytest.mark.parametrize("edits, expected", BAD, ids=[next(iter(e)) for e, _ in BAD])
def test_bad_configs_are_named_in_one_line(tmp_path, capsys, edits, expected):
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path, **edits)))
    assert main(["calibrate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sparrow calibrate: error:"), err
    assert "cal.yaml" in err
    for text in expected:
        assert text in err, (text, err)


def test_missing_config_is_named(tmp_path, capsys):
    assert main(["calibrate"]) == 2
    assert main(["calibrate", "--config", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "needs --config" in err[0] and "nope.yaml" in err[1] and "not found" in err[1]
