"""scripts/measure_mismatch.py end to end on a tiny random model: the JSON table's structure, and
alpha == 1 wherever the budget holds every page of every sequence (sparse = dense there)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import load_script
from sparrow_jax.config import ModelConfig
from sparrow_jax.mismatch import ESTIMATORS
from sparrow_jax.models.hf_io import save_qwen3
from sparrow_jax.models.qwen3 import init_model

P = 4
MAX_NEW = 24
PROMPT_LEN = (28, 40)
# (28..40) + 24 tokens < 64 tokens = 16 pages of 4: budget 16 covers every sequence, budget 3 does
# not (up to 16 pages: page 0, the last two and one chosen).
BIG = 16


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mismatch")
    cfg = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      eos_token_ids=(0,))
    save_qwen3(init_model(cfg, seed=1), tmp / "model")
    out = tmp / "out"
    result = load_script("measure_mismatch").main([
        "--model", str(tmp / "model"), "--needle-len", f"{PROMPT_LEN[0]},{PROMPT_LEN[1]}",
        "--budgets", f"3,{BIG}", "--page-size", str(P), "--dense-layers", "0",
        "--bin-tokens", "16", "--min-count", "4", "--max-new-tokens", str(MAX_NEW),
        "--num-prompts", "3", "--n", "2", "--batch-size", "4", "--top-k", "8",
        "--dtype", "float32", "--out", str(out), "--no-progress"])  # exact: bf16 on a GPU
    return result, out


def test_json_structure(run):
    result, out = run
    on_disk = json.loads((out / "mismatch.json").read_text())
    assert on_disk["budgets"] == json.loads(json.dumps(result["budgets"]))
    assert [b["label"] for b in on_disk["budgets"]] == ["3", str(BIG)]
    assert on_disk["sequences"] == 6
    num_bins = on_disk["config"]["num_bins"]
    assert num_bins == len(on_disk["bins"]) == -(-(PROMPT_LEN[1] + MAX_NEW) // 16)
    assert on_disk["dense_logprob_check_max_abs_diff"] < 1e-4
    for name in ("alpha_tail.png", "alpha_hist.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for b in on_disk["budgets"]:
        assert b["schedule"]["kind"] == "fixed"
        assert sum(b["counts"]) == b["tokens"] == 6 * MAX_NEW     # no EOS stop by default
        assert len(b["counts"]) == len(b["sparse_counts"]) == num_bins
        assert set(b["mean"]) == set(b["tail"]) == set(b["bin_mean"]) == set(ESTIMATORS)
        for name in ESTIMATORS:
            assert 0.0 <= b["mean"][name] <= 1.0 + 1e-6
            assert len(b["tail"][name]) == num_bins
            for count, v in zip(b["counts"], b["tail"][name]):
                assert (v is None) == (count < 4)
        # The estimators are ordered bounds: paper <= topk_bound <= exact.
        assert b["mean"]["paper"] <= b["mean"]["topk_bound"] + 1e-6
        assert b["mean"]["topk_bound"] <= b["mean"]["exact"] + 1e-6


def test_full_budget_is_dense_and_small_budget_is_not(run):
    result, out = run
    small, big = result["budgets"]
    assert big["sparse_fraction"] == 0.0 and small["sparse_fraction"] > 0.5
    saved = np.load(out / "alphas.npz")
    mask = saved["mask"]
    # Every sequence fits in BIG pages, so the teacher-forced "sparse" forward attends to every
    # page: q == p and alpha == 1 up to float32 rounding, per token.
    assert (np.ceil(saved["lengths"][mask] / P) <= BIG).all()
    np.testing.assert_allclose(saved[f"{BIG}/exact"][mask], 1.0, atol=1e-5)
    assert big["mean"]["exact"] == pytest.approx(1.0, abs=1e-5)
    # With 3 pages the sparse actor differs from the dense policy somewhere.
    assert saved["3/exact"][mask].min() < 1.0 - 1e-3
    assert small["mean"]["exact"] < 1.0 - 1e-4
