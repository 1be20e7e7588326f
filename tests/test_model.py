"""Qwen3 model: bad input, LoRA switched per call, remat equivalence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.config import ModelConfig
from sparrow_jax.models.lora import Linear, LoRAConfig, LoRAParam, attach_lora
from sparrow_jax.models.qwen3 import check_tokens, init_model

CFG = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
TOKENS = jnp.array([[3, 7, 1, 39, 0, 12], [5, 5, 2, 8, 30, 1]], jnp.int32)


# Jitted: op-by-op eager execution compiles every op separately and is far slower on CPU.
_forward = nnx.jit(lambda model, tokens, lora=False: model(tokens, lora=lora),
                   static_argnames="lora")


def test_check_tokens_rejects_out_of_range():
    check_tokens(np.array([[0, 39]]), 40)
    with pytest.raises(ValueError, match=r"out of range \[0, 40\).*40"):
        check_tokens(np.array([[1, 40]]), 40)
    with pytest.raises(ValueError, match=r"out of range.*-1"):
        check_tokens([[-1, 3]], 40)


def test_wrong_rank_tokens():
    model = init_model(CFG)
    with pytest.raises(ValueError, match=r"tokens must be \[batch, seq\].*\(6,\)"):
        model(TOKENS[0])


def test_lora_linear_equals_numpy():
    """One layer with a nonzero adapter: y = x K + b + scale * x A B (float64 NumPy)."""
    layer = Linear(CFG.hidden_size, 12, use_bias=True, rngs=nnx.Rngs(0))
    layer.add_lora(rank=4, scale=2.0, key=jax.random.key(1))
    rng = np.random.default_rng(0)
    layer.bias[...] = jnp.asarray(rng.normal(size=12), jnp.float32)
    layer.lora_b[...] = jnp.asarray(rng.normal(size=layer.lora_b.shape), jnp.float32)
    x = rng.normal(size=(3, 5, CFG.hidden_size)).astype(np.float32)
    k, bias, a, b = (np.asarray(v[...], np.float64)
                     for v in (layer.kernel, layer.bias, layer.lora_a, layer.lora_b))
    base = x.astype(np.float64) @ k + bias
    np.testing.assert_allclose(layer(jnp.asarray(x), lora=True), base + 2.0 * (x @ a) @ b,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer(jnp.asarray(x), lora=False), base, rtol=1e-5, atol=1e-5)


def test_lora_switch_on_the_whole_model():
    model = init_model(CFG, seed=2)
    plain = np.asarray(_forward(model, TOKENS))
    attach_lora(model, LoRAConfig(rank=2), jax.random.key(0))
    # B starts at zero: the adapted model starts equal to the base model
    np.testing.assert_allclose(_forward(model, TOKENS, lora=True), plain, rtol=0, atol=1e-6)
    for _, b in nnx.to_flat_state(nnx.state(model, LoRAParam)):
        if b.shape[0] == 2:  # lora_b is [rank, out]
            b[...] = jnp.full(b.shape, 0.3, jnp.float32)
    # lora=False never touches the adapter, whatever its weights
    np.testing.assert_array_equal(_forward(model, TOKENS, lora=False), plain)
    assert np.abs(np.asarray(_forward(model, TOKENS, lora=True)) - plain).max() > 1e-3


def _loss(model, tokens):
    return jnp.mean(jax.nn.log_softmax(model(tokens))[..., 0])


_grad = nnx.jit(nnx.grad(_loss))


def test_remat_gives_same_logits_and_grads():
    plain, remat = init_model(CFG, seed=4), init_model(CFG, seed=4, remat=True)
    np.testing.assert_allclose(_forward(remat, TOKENS), _forward(plain, TOKENS), rtol=1e-6,
                               atol=1e-6)
    g_plain = nnx.to_flat_state(_grad(plain, TOKENS))
    g_remat = dict(nnx.to_flat_state(_grad(remat, TOKENS)))
    assert len(g_plain) == len(g_remat)
    for path, g in g_plain:
        np.testing.assert_allclose(g_remat[path][...], g[...], rtol=1e-5, atol=1e-7,
                                   err_msg=str(path))
    assert any(np.abs(np.asarray(g[...])).max() > 0 for _, g in g_plain)
