"""Logits of load_qwen3's model equal transformers' Qwen3ForCausalLM on checkpoints it saved.

The fixtures (tests/fixtures/hf, made by scripts/make_hf_fixtures.py with torch 2.13 CPU and
transformers) hold transformers' own logits. Relative error is ``max|ours - hf| / max|hf|``
over the whole ``[batch, seq, vocab]`` array.
"""

from __future__ import annotations

import subprocess

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, hf_case, hf_case_names, max_rel_err

from sparrow_jax.models.hf_io import load_qwen3
from sparrow_jax.models.lm_head import head_outputs

FLOAT32_CASES = [c for c in hf_case_names() if c != "bf16"]
FP32_TOL = 1e-4


def _logits(model, case) -> np.ndarray:
    return np.asarray(model(jnp.asarray(case["input_ids"]), jnp.asarray(case["position_ids"])))


def test_fixture_matrix_covers_the_issue():
    """The matrix the issue asks for is really in the committed fixtures (read from their
    config.json files, not from our loader)."""
    cfgs = {name: hf_case(name)["hf_config"] for name in hf_case_names()}
    ratios = {c["num_attention_heads"] // c["num_key_value_heads"] for c in cfgs.values()}
    assert {1, 2, 4} <= ratios
    assert {c["tie_word_embeddings"] for c in cfgs.values()} == {True, False}
    assert any(c["head_dim"] != c["hidden_size"] // c["num_attention_heads"] for c in cfgs.values())
    thetas = {c["rope_parameters"]["rope_theta"] for c in cfgs.values()}
    assert thetas - {10_000.0, 1_000_000.0}, thetas
    assert hf_case("pos32k")["position_ids"].max() >= 32_000
    assert (hf_case("gqa4_theta_sharded")["path"] / "model.safetensors.index.json").is_file()
    assert any(c["attention_bias"] for c in cfgs.values())
    assert cfgs["bf16"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("name", FLOAT32_CASES)
def test_float32_logits_match_transformers(name):
    case = hf_case(name)
    model, _ = load_qwen3(case["path"])
    # Random norm weights: a loader that left them at ones would still run, so check they arrived.
    norms = np.asarray(model.layers[0].self_attn.q_norm.weight[...])
    assert not np.allclose(norms, 1.0)
    err = max_rel_err(_logits(model, case), case["logits"])
    assert err < FP32_TOL, f"{name}: max relative error {err:.2e}"


def test_chunked_head_matches_transformers_logprobs():
    """The chunked LM head on the loaded model gives HF's log-probs and top-k (float64 numpy
    log-softmax of transformers' logits)."""
    case = hf_case("untied_gqa2_hd16")
    model, _ = load_qwen3(case["path"])
    ids, pos = jnp.asarray(case["input_ids"]), jnp.asarray(case["position_ids"])
    targets = np.roll(case["input_ids"], -1, axis=1)
    hidden, _ = model.forward(ids, pos)
    out = head_outputs(hidden, model.head_weight(), jnp.asarray(targets), top_k=5, chunk_size=7)
    ref = case["logits"].astype(np.float64)
    shifted = ref - ref.max(-1, keepdims=True)
    ref_lp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    want = np.take_along_axis(ref_lp, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), want, atol=1e-4 * np.abs(ref).max())
    want_top = np.sort(ref_lp, -1)[..., ::-1][..., :5]
    np.testing.assert_allclose(np.asarray(out.topk_logprobs), want_top,
                               atol=1e-4 * np.abs(ref).max())


def test_bfloat16_logits_match_transformers_bfloat16():
    """Both sides compute in bfloat16 on the same bf16 checkpoint. bf16 keeps 8 significant bits
    (relative rounding 2**-9 ~ 2e-3 per op), and the two implementations round at different
    points (HF's logits are themselves bf16; ours accumulate the head in float32), so they cannot
    agree bit for bit: across 2 layers both land ~1.4e-2 (relative to max |logit|) from the
    float32 run of the same weights. The test holds (a) ours within 3e-2 of HF, i.e. a few bf16
    roundings of the logit scale, and (b) ours no further than 2x HF's own error from the exact
    float32 answer, so a real bug (error ~1e-1 and up) fails while legal rounding passes. (c)
    checks the compute really ran in bf16 (a float32 run would be ~1e-6 from exact)."""
    case = hf_case("bf16")
    model, _ = load_qwen3(case["path"], dtype=jnp.bfloat16)
    ours = _logits(model, case)
    exact = case["logits_fp32"]
    assert max_rel_err(ours, case["logits"]) < 3e-2
    hf_err, our_err = max_rel_err(case["logits"], exact), max_rel_err(ours, exact)
    assert our_err < 2 * hf_err, (our_err, hf_err)
    assert our_err > 1e-4


def test_float32_run_of_bf16_checkpoint_is_exact():
    """The bf16 checkpoint loads into float32 masters and then matches HF's float32 run of the
    same weights to float32 precision (the bf16 values are exact in float32)."""
    case = hf_case("bf16")
    model, _ = load_qwen3(case["path"])
    assert model.embed_tokens[...].dtype == jnp.float32
    assert max_rel_err(_logits(model, case), case["logits_fp32"]) < FP32_TOL


@pytest.mark.hf
def test_live_regenerated_fixtures_match(tmp_path, hf_python):
    """Rebuilds the fixtures with the installed transformers and checks parity on them."""
    subprocess.run([str(hf_python), str(REPO / "scripts" / "make_hf_fixtures.py"),
                    "--out", str(tmp_path)], check=True, capture_output=True, timeout=600)
    for name in FLOAT32_CASES:
        folder = tmp_path / name
        model, _ = load_qwen3(folder)
        case = {k: np.load(folder / f"{k}.npy") for k in ("input_ids", "position_ids")}
        err = max_rel_err(_logits(model, case), np.load(folder / "logits.npy"))
        assert err < FP32_TOL, (name, err)
