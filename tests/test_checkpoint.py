"""Orbax checkpoints: bit-exact round trip of NNX params, optax state and RNG key data; keep-k."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from sparrow_jax.checkpoint import Checkpointer
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.qwen3 import init_model

CFG = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=4)


def _state(seed):
    params = nnx.state(init_model(CFG, seed=seed), nnx.Param)
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda x: x * 0.1 + 1e-3, params)
    _, opt_state = opt.update(grads, opt_state, params)
    return {"params": params, "opt_state": opt_state,
            "key": jax.random.key_data(jax.random.key(seed))}


def test_round_trip_is_bit_exact_and_structured(tmp_path):
    saved = _state(1)
    ck = Checkpointer(tmp_path / "ck", keep=2)
    record = {"step": 4, "data": {"epoch": 1, "position": 3, "seed": 0}, "schedule": None}
    ck.save(4, saved, record)
    restored, rec = ck.restore(4, _state(2))   # a template with other values, same structure
    assert rec == record
    assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(saved["opt_state"])
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # differs from the template: the values really came from the file
    assert not np.array_equal(np.asarray(restored["key"]), np.asarray(_state(2)["key"]))


def test_keeps_last_k_and_names_missing_steps(tmp_path):
    ck = Checkpointer(tmp_path / "ck", keep=2)
    s = _state(0)
    for step in (1, 2, 3):
        ck.save(step, s, {"step": step})
    assert ck.all_steps() == [2, 3] and ck.latest_step() == 3
    with pytest.raises(FileNotFoundError, match="available: \\[2, 3\\]"):
        ck.restore(1, s)
    # a new manager on the same folder sees them (what --resume does)
    assert Checkpointer(tmp_path / "ck", keep=2).latest_step() == 3
