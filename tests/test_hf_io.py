"""HF folder I/O: round trips, EOS merging, and a clear error for each kind of bad folder."""

from __future__ import annotations

import json
import shutil
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_case, max_rel_err
from safetensors.numpy import load_file, save_file

from sparrow_jax.config import ConfigError
from sparrow_jax.models.hf_io import (CheckpointError, load_config, load_generation_config,
                                      load_qwen3, save_qwen3)


def _params(model) -> dict:
    from flax import nnx
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture
def folder(tmp_path):
    """A writable copy of an untied, single-file fixture."""
    dst = tmp_path / "m"
    shutil.copytree(hf_case("untied_gqa2_hd16")["path"], dst)
    return dst


def _edit_tensors(folder, fn):
    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


# -- loading what transformers wrote ---------------------------------------------------------
def test_weights_land_in_our_layout(folder):
    """Independent of the forward: HF's [out, in] q_proj is our [in, out] kernel, norms and the
    untied head are copied as they are."""
    hf = load_file(str(folder / "model.safetensors"))
    model, _ = load_qwen3(folder)
    attn = model.layers[1].self_attn
    np.testing.assert_array_equal(attn.q_proj.kernel[...],
                                  hf["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(model.layers[1].mlp.down_proj.kernel[...],
                                  hf["model.layers.1.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(attn.k_norm.weight[...],
                                  hf["model.layers.1.self_attn.k_norm.weight"])
    np.testing.assert_array_equal(model.lm_head[...], hf["lm_head.weight"])
    np.testing.assert_array_equal(model.norm.weight[...], hf["model.norm.weight"])


def test_config_and_eos_ids_merged_from_generation_config():
    case = hf_case("chat")
    gen = json.loads((case["path"] / "generation_config.json").read_text())
    _, config = load_qwen3(case["path"])
    # config.json names one EOS; generation_config.json two (Qwen3: <|im_end|>, <|endoftext|>).
    assert config.eos_token_ids == (case["hf_config"]["eos_token_id"], *[
        e for e in gen["eos_token_id"] if e != case["hf_config"]["eos_token_id"]])
    assert set(config.eos_token_ids) == set(gen["eos_token_id"])
    assert config.rope_theta == case["hf_config"]["rope_parameters"]["rope_theta"]
    assert config.tie_word_embeddings and config.vocab_size == 320
    assert load_generation_config(case["path"])["eos_token_ids"] == tuple(gen["eos_token_id"])
    assert load_generation_config(case["path"].parent) == {}


def test_sharded_checkpoint_loads_all_shards():
    case = hf_case("gqa4_theta_sharded")
    index = json.loads((case["path"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, config = load_qwen3(case["path"])
    assert config.group_size == 4 and config.head_dim == 8 and config.hidden_size == 32


def test_param_dtype_bfloat16_storage():
    model, _ = load_qwen3(hf_case("tied_gqa1")["path"], dtype=jnp.bfloat16,
                          param_dtype=jnp.bfloat16)
    assert {a.dtype for a in _params(model).values()} == {jnp.dtype(jnp.bfloat16)}


# -- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tied_gqa1", "attn_bias", "bf16"])
def test_save_load_round_trip_is_exact(tmp_path, name):
    case = hf_case(name)
    model, config = load_qwen3(case["path"])
    save_qwen3(model, tmp_path / "out")
    again, config2 = load_qwen3(tmp_path / "out")
    assert config2 == config
    a, b = _params(model), _params(again)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))
    # the written tensors are HF's tensors again (names, layouts, values)
    hf = load_file(str(case["path"] / "model.safetensors"))
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert ours.keys() == hf.keys()
    for k in hf:
        np.testing.assert_array_equal(ours[k].astype(np.float32), hf[k].astype(np.float32),
                                      err_msg=k)


def test_round_trip_with_bf16_params_and_tokenizer(tmp_path):
    model, config = load_qwen3(hf_case("untied_gqa2_hd16")["path"], param_dtype=jnp.bfloat16)
    tok_dir = hf_case("chat")["path"]
    save_qwen3(model, tmp_path / "out", tokenizer_dir=tok_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_bytes() == (tok_dir / name).read_bytes()
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert saved["model.norm.weight"].dtype == "bfloat16"
    again, config2 = load_qwen3(tmp_path / "out", param_dtype=jnp.bfloat16)
    a, b = _params(model), _params(again)
    assert a.keys() == b.keys() and config2 == config
    for k in a:
        assert b[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


@pytest.mark.hf
def test_transformers_loads_what_we_save(tmp_path, hf_python):
    """Our writer's folder loads in transformers and gives our logits."""
    model, _ = load_qwen3(hf_case("attn_bias")["path"])
    out = tmp_path / "out"
    save_qwen3(model, out)
    ids = np.array([[5, 9, 2, 77, 31, 0, 64]], np.int64)
    script = (
        "import sys, numpy as np, torch, transformers\n"
        "m = transformers.Qwen3ForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "ids = torch.tensor(np.array(eval(sys.argv[2])))\n"
        "with torch.no_grad(): np.save(sys.argv[3], m(input_ids=ids).logits.float().numpy())\n")
    subprocess.run([str(hf_python), "-c", script, str(out), repr(ids.tolist()),
                    str(tmp_path / "ref.npy")], check=True, capture_output=True, timeout=300)
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    assert max_rel_err(ours, np.load(tmp_path / "ref.npy")) < 1e-4


# -- bad folders ---------------------------------------------------------------------------------
def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_qwen3(tmp_path / "nope")


def test_missing_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_qwen3(folder)


def test_missing_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        load_qwen3(folder)


def test_missing_shard(tmp_path):
    dst = tmp_path / "s"
    shutil.copytree(hf_case("gqa4_theta_sharded")["path"], dst)
    next(dst.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="missing.*model-00002"):
        load_qwen3(dst)


def test_missing_tensor_is_named(folder):
    _edit_tensors(folder, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"lacks tensor model\.layers\.1\.self_attn\.k_norm"):
        load_qwen3(folder)


def test_wrong_shape_names_tensor_and_shapes(folder):
    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]
    _edit_tensors(folder, shrink)
    with pytest.raises(CheckpointError, match=r"up_proj\.weight has shape \(63, 32\), expected "
                                              r"\(64, 32\)"):
        load_qwen3(folder)


def test_config_disagreeing_with_weights(folder):
    _edit_config(folder, num_key_value_heads=4)
    with pytest.raises(CheckpointError,
                       match=r"k_proj\.weight has shape \(32, 32\), expected \(64, 32\)"):
        load_qwen3(folder)


def test_unexpected_tensor_is_an_error_but_inv_freq_is_ignored(folder):
    _edit_tensors(folder, lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    load_qwen3(folder)
    _edit_tensors(folder, lambda t: t.update(
        {"model.layers.2.mlp.up_proj.weight": np.ones((2, 2), np.float32)}))
    with pytest.raises(CheckpointError, match=r"does not use.*layers\.2\.mlp\.up_proj"):
        load_qwen3(folder)


def test_tied_checkpoint_with_a_different_lm_head_is_rejected(tmp_path):
    dst = tmp_path / "t"
    shutil.copytree(hf_case("tied_gqa1")["path"], dst)
    emb = load_file(str(dst / "model.safetensors"))["model.embed_tokens.weight"]
    _edit_tensors(dst, lambda t: t.update({"lm_head.weight": emb.copy()}))
    load_qwen3(dst)  # an explicit copy of the tied head is fine
    _edit_tensors(dst, lambda t: t.update({"lm_head.weight": emb + 1}))
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_qwen3(dst)


def test_unknown_architecture(folder):
    _edit_config(folder, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(ConfigError, match="unsupported architecture.*LlamaForCausalLM"):
        load_qwen3(folder)


def test_rope_scaling_rejected(folder):
    _edit_config(folder, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
    with pytest.raises(ConfigError, match="unsupported rope scaling 'yarn'"):
        load_qwen3(folder)
    _edit_config(folder, rope_parameters=None, rope_theta=1e6,
                 rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(ConfigError, match="unsupported rope scaling 'linear'"):
        load_config(folder)


def test_broken_json_is_named(folder):
    (folder / "generation_config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="generation config .* not valid JSON"):
        load_qwen3(folder)
