"""The teacher-forced flash kernel (pallas_kernels/teacher_forced_gpu.py) in Pallas' interpreter:
its masked attention and gradients against float64 NumPy, and the whole teacher-forced layer
against the token-by-token reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.teacher_forced_gpu import (TeacherForcedTuning, page_masked_attention,
                                               page_words)
from reference_np import assert_kernel_close, teacher_forced_case, teacher_forced_np
from sparrow_jax.attention.teacher_forced import resolve_impl, teacher_forced_sparse_attention

SMALL = TeacherForcedTuning(block_q=32, block_k=32, bwd_block_q=16, bwd_block_k=32)
# On a GPU the kernels compile through Triton (scripts/test_gpu.sh); elsewhere they interpret.
INTERPRET = jax.default_backend() != "gpu"


def test_page_words_packs_bit_p_of_word_p_over_32():
    mask = np.zeros((1, 1, 2, 40), bool)
    mask[0, 0, 0, [0, 5, 31]] = True
    mask[0, 0, 1, [32, 39]] = True
    words = np.asarray(page_words(jnp.asarray(mask))).view(np.uint32)
    assert words.shape == (1, 1, 2, 2)                  # [B, H, W, T]
    assert words[0, 0, 0, 0] == 1 + 2 ** 5 + 2 ** 31 and words[0, 0, 1, 0] == 0
    assert words[0, 0, 0, 1] == 0 and words[0, 0, 1, 1] == 1 + 2 ** 7


def _masked_attention_np(q, k, v, mask, page_size, g):
    """float64 forward and backward of softmax attention where query i sees key j iff j <= i
    and mask[b, kv_head, i, j // page_size]."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    r = hq // hkv
    i = np.arange(t)
    vis = np.repeat(mask[:, :, :, i // page_size] & (i[:, None] >= i[None, :]), r, axis=1)
    kk, vv = np.repeat(k, r, axis=2), np.repeat(v, r, axis=2)
    s = np.where(vis, np.einsum("bihd,bjhd->bhij", q, kk) / np.sqrt(d), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhij,bjhd->bihd", p, vv)
    dp = np.einsum("bihd,bjhd->bhij", g, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhij,bjhd->bihd", ds, kk) / np.sqrt(d)
    dk = (np.einsum("bhij,bihd->bjhd", ds, q) / np.sqrt(d)).reshape(b, t, hkv, r, d).sum(3)
    dv = np.einsum("bhij,bihd->bjhd", p, g).reshape(b, t, hkv, r, d).sum(3)
    return out, (dq, dk, dv)


def test_masked_attention_and_gradients_match_numpy():
    rng = np.random.default_rng(0)
    b, t, hq, hkv, d, page = 2, 128, 4, 2, 16, 16
    q, g = (rng.standard_normal((b, t, hq, d)) for _ in range(2))
    k, v = (rng.standard_normal((b, t, hkv, d)) for _ in range(2))
    mask = rng.random((b, hkv, t, t // page)) < 0.4
    mask[:, :, np.arange(t), np.arange(t) // page] = True     # every query sees its own key
    # A key block (pages 0-1) that no query of the last two query blocks selected: skipped.
    mask[0, 1, 64:, :2] = False
    want, grads = _masked_attention_np(q, k, v, mask, page, g)
    words = page_words(jnp.asarray(mask))
    f = lambda q, k, v: page_masked_attention(q, k, v, words, page, SMALL, INTERPRET)
    out, vjp = jax.vjp(f, *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    for name, got, ref in zip("qkv", vjp(jnp.asarray(g, jnp.float32)), grads):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


def _layer_case(rng, t=70, dtype=np.float32):
    return teacher_forced_case(rng, t=t, d=16, dtype=dtype)


@pytest.mark.parametrize("scorer", ["centroid", "quest"])
def test_kernel_layer_matches_numpy_token_by_token(scorer):
    rng = np.random.default_rng(1)
    q, k, v, budgets = _layer_case(rng)
    prompts = np.array([9, 1], np.int32)
    got = teacher_forced_sparse_attention(*map(jnp.asarray, (q, k, v, budgets, prompts)),
                                          page_size=4, scorer=scorer, chunk_size=4,
                                          impl="pallas", tuning=SMALL, interpret=INTERPRET)
    want = teacher_forced_np(q, k, v, budgets, prompts, page_size=4, scorer=scorer)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_kernel_layer_gradients_equal_the_xla_path():
    """The XLA path's gradients are checked against finite differences in
    test_teacher_forced.py; the kernel's must equal them."""
    rng = np.random.default_rng(3)
    q, k, v, budgets = _layer_case(rng, t=45)
    prompts = jnp.asarray([3, 0], jnp.int32)
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(impl):
        def f(q, k, v):
            out = teacher_forced_sparse_attention(q, k, v, jnp.asarray(budgets), prompts,
                                                  page_size=4, chunk_size=8, impl=impl,
                                                  tuning=SMALL, interpret=INTERPRET)
            return jnp.sum(out * w)
        return jax.grad(f, argnums=(0, 1, 2))(*map(jnp.asarray, (q, k, v)))

    for name, got, ref in zip("qkv", loss("pallas"), loss("xla")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-5,
                                   err_msg=f"d{name}")


def test_kernel_bfloat16_matches_numpy_on_the_same_values():
    rng = np.random.default_rng(2)
    q, k, v, budgets = _layer_case(rng)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    prompts = np.array([5, 1], np.int32)
    got = teacher_forced_sparse_attention(q, k, v, jnp.asarray(budgets), jnp.asarray(prompts),
                                          page_size=4, chunk_size=4, impl="pallas",
                                          tuning=SMALL, interpret=INTERPRET)
    assert got.dtype == jnp.bfloat16
    want = teacher_forced_np(*(np.asarray(x, np.float64) for x in (q, k, v)), budgets, prompts,
                             page_size=4, scorer="centroid")
    assert_kernel_close(np.asarray(got, np.float64), want, low_precision=True)


def test_auto_picks_the_kernel_on_gpu_only_and_bad_settings_raise_one_line():
    assert resolve_impl("auto", 128, "gpu") == "pallas"
    assert resolve_impl("auto", 128, "cpu") == resolve_impl("auto", 128, "tpu") == "xla"
    assert resolve_impl("auto", 24, "gpu") == "xla"       # not a power of two
    with pytest.raises(ValueError, match="unknown teacher-forced attention impl"):
        resolve_impl("triton", 128)
    with pytest.raises(ValueError, match="block_q must be a power of two"):
        TeacherForcedTuning(block_q=48)
    with pytest.raises(ValueError, match="block_k=64 must divide 32 x page_size = 32"):
        TeacherForcedTuning().check(page_size=1)


def test_selection_kernel_equals_select_pages_with_ties_and_signed_zeros():
    from pallas_kernels.teacher_forced_gpu import select_pages_kernel
    from sparrow_jax.attention.selection import select_pages

    rng = np.random.default_rng(4)
    b, h, c, m = 2, 2, 32, 40
    scores = rng.standard_normal((b, h, c, m)).astype(np.float32)
    scores[..., ::3] = np.round(scores[..., ::3])          # many ties, -0.0 among them
    scores[0, 0, 0] = 0.0
    scores[0, 0, 1, 5] = -0.0
    n = rng.integers(1, m + 1, c).astype(np.int32)
    budget = rng.integers(0, 20, (b, c)).astype(np.int32)  # below 3 acts as 3; >= n is dense
    got = select_pages_kernel(*map(jnp.asarray, (scores, n, budget)), interpret=INTERPRET)
    want = select_pages(jnp.asarray(scores), jnp.asarray(n)[None, None],
                        jnp.asarray(budget)[:, None])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert 0.2 < np.asarray(want).mean() < 0.8


def _count_in_grad_jaxpr(remat: bool, names=("teacher_forced_select", "teacher_forced_forward")):
    from flax import nnx

    from sparrow_jax.attention.teacher_forced import (TeacherForcedBudgets,
                                                      make_teacher_forced_attend)
    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.qwen3 import init_model

    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    graphdef, params = nnx.split(init_model(cfg, seed=0, remat=remat))
    attend = make_teacher_forced_attend(page_size=4, dense_layers=(), impl="pallas")
    state = TeacherForcedBudgets(jnp.full((1, 64), 4, jnp.int32), jnp.array([8], jnp.int32))
    tokens = jnp.zeros((1, 64), jnp.int32)

    def grads(params):
        loss = lambda m: m.forward(tokens, attend=attend, state=state)[0].sum()
        return nnx.grad(loss)(nnx.merge(graphdef, params))

    text = str(jax.make_jaxpr(grads)(params))
    return [text.count(n) for n in names]


def test_remat_keeps_the_selection_and_recomputes_the_attention():
    select, forward = _count_in_grad_jaxpr(remat=False)
    select_remat, forward_remat = _count_in_grad_jaxpr(remat=True)
    assert forward_remat > forward          # remat is on: the attention runs again
    assert select_remat == select           # the selection is saved, not recomputed
