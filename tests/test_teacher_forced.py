"""Teacher-forced sparse attention equals the decode step run token by token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from reference_np import assert_kernel_close, teacher_forced_case, teacher_forced_np
from sparrow_jax.attention.dense import causal_attention
from sparrow_jax.attention.sparse import sparse_decode
from sparrow_jax.attention.teacher_forced import (TeacherForcedBudgets,
                                                  make_teacher_forced_attend,
                                                  teacher_forced_sparse_attention)
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.qwen3 import init_model, logits_from_hidden

P = 4


def _layer_case(rng, b=2, t=37, dtype=np.float32):
    return teacher_forced_case(rng, b=b, t=t, page_size=P, dtype=dtype)


@pytest.mark.parametrize("scorer", ["centroid", "quest"])
def test_layer_matches_numpy_token_by_token(scorer):
    rng = np.random.default_rng(1)
    q, k, v, budgets = _layer_case(rng)
    prompts = np.array([5, 1], np.int32)
    got = np.asarray(teacher_forced_sparse_attention(
        *map(jnp.asarray, (q, k, v, budgets, prompts)), page_size=P, scorer=scorer,
        chunk_size=8))
    want = teacher_forced_np(q, k, v, budgets, prompts, page_size=P, scorer=scorer)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The case is not secretly dense: most response positions see a visibly different output.
    dense = np.asarray(causal_attention(*map(jnp.asarray, (q, k, v))))
    changed = np.abs(dense - want).max(axis=(2, 3)) > 1e-3
    assert changed[:, 20:].mean() > 0.5
    assert not changed[0, :5].any()  # prompt positions are dense


def test_bfloat16_matches_numpy_on_the_same_values():
    """bfloat16 inputs (the accelerator dtype): bfloat16 products in a float32 accumulator, the
    probabilities rounded to bfloat16 for P.V as in the decode kernels; against the float64
    reference on the same (rounded) values."""
    rng = np.random.default_rng(2)
    q, k, v, budgets = _layer_case(rng)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    prompts = np.array([5, 1], np.int32)
    got = teacher_forced_sparse_attention(q, k, v, jnp.asarray(budgets), jnp.asarray(prompts),
                                          page_size=P, chunk_size=8)
    assert got.dtype == jnp.bfloat16
    want = teacher_forced_np(*(np.asarray(x, np.float64) for x in (q, k, v)), budgets, prompts,
                             page_size=P, scorer="centroid")
    assert_kernel_close(np.asarray(got, np.float64), want, low_precision=True)


def _tiny_config():
    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _decode_token_by_token(model, tokens, budgets, prompts, dense_layers, scorer):
    """The decode loop, one token per step, with a contiguous paged cache: the reference for
    teacher-forced attention. Returns logits ``[B, T, V]``."""
    cfg = model.config
    b, t = tokens.shape
    m = -(-t // P)
    table = (jnp.arange(b)[:, None] * m + jnp.arange(m)[None, :]).astype(jnp.int32)
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, b * m, P, cfg.head_dim)

    @jax.jit
    def step(cache, token, i, budget):
        def attend(layer, q, k, v, cache):
            kc, vc = cache
            phys = table[:, i // P]
            kl = kc[layer].at[:, phys, i % P].set(k[:, 0].transpose(1, 0, 2))
            vl = vc[layer].at[:, phys, i % P].set(v[:, 0].transpose(1, 0, 2))
            bud = jnp.where((layer in dense_layers) | (i < prompts), m, budget)
            out = sparse_decode(q[:, 0], kl, vl, table, jnp.full((b,), i + 1, jnp.int32), bud,
                                page_size=P, scorer=scorer)
            return out[:, None], (kc.at[layer].set(kl), vc.at[layer].set(vl))
        pos = jnp.full((b, 1), i, jnp.int32)
        hidden, cache = model.forward(token[:, None], pos, attend=attend, state=cache)
        return cache, logits_from_hidden(hidden, model.head_weight())[:, 0]

    cache = (jnp.zeros(shape), jnp.zeros(shape))
    logits = []
    for i in range(t):
        cache, out = step(cache, tokens[:, i], jnp.int32(i), budgets[:, i])
        logits.append(out)
    return jnp.stack(logits, axis=1)


@pytest.mark.parametrize("scorer", ["centroid", "quest"])
def test_model_matches_decode_loop(scorer):
    model = init_model(_tiny_config(), seed=0)
    rng = np.random.default_rng(2)
    b, t = 2, 32
    tokens = jnp.asarray(rng.integers(0, 64, size=(b, t)), jnp.int32)
    budgets = jnp.asarray(rng.integers(3, 7, size=(b, t)), jnp.int32)
    prompts = jnp.asarray([6, 3], jnp.int32)
    dense_layers = (0,)
    attend = make_teacher_forced_attend(page_size=P, scorer=scorer, dense_layers=dense_layers,
                                        chunk_size=16)
    hidden, _ = jax.jit(lambda tok, st: model.forward(tok, attend=attend, state=st))(
        tokens, TeacherForcedBudgets(budgets, prompts))
    got = logits_from_hidden(hidden, model.head_weight())
    want = _decode_token_by_token(model, tokens, budgets, prompts, dense_layers, scorer)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(got), np.asarray(model(tokens)), atol=1e-4)


def test_gradient_matches_finite_differences():
    rng = np.random.default_rng(4)
    with jax.enable_x64(True):
        q, k, v, budgets = _layer_case(rng, b=1, t=21, dtype=np.float64)
        w = jnp.asarray(rng.standard_normal(q.shape))
        prompts = jnp.asarray([3], jnp.int32)

        def loss(q, k, v):
            out = teacher_forced_sparse_attention(q, k, v, jnp.asarray(budgets), prompts,
                                                  page_size=P, chunk_size=8)
            return jnp.sum(out * w)

        check_grads(loss, tuple(map(jnp.asarray, (q, k, v))), order=1, modes=("rev",),
                    eps=1e-6, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", [
    "xla", pytest.param("pallas", marks=pytest.mark.skipif(
        jax.default_backend() != "gpu", reason="the kernel's Triton lowering needs a GPU"))])
def test_memory_grows_linearly_with_length(impl):
    def temp_bytes(t, grad):
        q = jax.ShapeDtypeStruct((1, t, 4, 16), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
        bud = jax.ShapeDtypeStruct((1, t), jnp.int32)
        pl = jax.ShapeDtypeStruct((1,), jnp.int32)
        f = lambda q, k, v, b, p: teacher_forced_sparse_attention(
            q, k, v, b, p, page_size=16, chunk_size=64 if impl == "xla" else 4,
            impl=impl).sum()
        if grad:
            f = jax.grad(f, argnums=(0, 1, 2))
        return jax.jit(f).lower(q, kv, kv, bud, pl).compile().memory_analysis().temp_size_in_bytes

    for grad in (False, True):
        small, large = temp_bytes(256, grad), temp_bytes(1024, grad)
        assert large / small < 5, (grad, small, large)     # quadratic would be 16x
        assert large < 1024 * 1024 * 4 * 4 / 2              # far below one [T, T, Hq] f32 array


def test_bad_input_is_named():
    rng = np.random.default_rng(0)
    q, k, v, budgets = _layer_case(rng, b=1, t=9)
    budgets[0, 6] = 2
    with pytest.raises(ValueError, match="position 6"):
        teacher_forced_sparse_attention(*map(jnp.asarray, (q, k, v, budgets)),
                                        jnp.asarray([3]), page_size=P)
    with pytest.raises(ValueError, match="budget_pages must be"):
        teacher_forced_sparse_attention(*map(jnp.asarray, (q, k, v)), jnp.asarray(budgets[:, :4]),
                                        jnp.asarray([3]), page_size=P)
    attend = make_teacher_forced_attend(page_size=P)
    with pytest.raises(TypeError, match="TeacherForcedBudgets"):
        attend(2, q, k, v, None)
