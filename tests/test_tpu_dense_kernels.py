"""The TPU dense kernels (paged decode, splash causal attention) run in TPU interpret mode on CPU
against float64 NumPy references and the XLA path, and ``impl="auto"`` on CPU compiles only XLA
while holding the TPU kernels for a TPU lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.attention.dense import causal_attention
from sparrow_jax.attention.paged_dense import paged_attention, paged_attention_xla


def np_paged(q, k_pages, v_pages, table, lengths):
    """float64 decode attention; rows of length 0 give zeros (the TPU kernel's padding rows)."""
    b, hq, d = q.shape
    h, _, p, _ = k_pages.shape
    out = np.zeros((b, hq, d))
    for i in range(b):
        n = min(int(lengths[i]), table.shape[1] * p)
        if n == 0:
            continue
        for j in range(hq):
            k = k_pages[j // (hq // h)][table[i]].reshape(-1, d)[:n].astype(np.float64)
            v = v_pages[j // (hq // h)][table[i]].reshape(-1, d)[:n].astype(np.float64)
            s = k @ q[i, j].astype(np.float64) * d ** -0.5
            w = np.exp(s - s.max())
            out[i, j] = w @ v / w.sum()
    return out


def np_causal(q, k, v):
    """float64 causal GQA attention: q [B, T, Hq, D], k/v [B, T, Hkv, D]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    r = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, r, axis=2), np.repeat(v, r, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
    t = q.shape[1]
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", w / w.sum(-1, keepdims=True), v)


def paged_case(hq, hkv, page_size, dtype, lengths, pages=5, seed=0):
    rng = np.random.default_rng(seed)
    b, d = len(lengths), 128
    n = b * pages + 3
    q = rng.standard_normal((b, hq, d)).astype(np.float32)
    k = rng.standard_normal((hkv, n, page_size, d)).astype(np.float32)
    v = rng.standard_normal((hkv, n, page_size, d)).astype(np.float32)
    table = rng.permutation(n)[:b * pages].reshape(b, pages).astype(np.int32)  # scattered
    cast = lambda x: jnp.asarray(x, dtype)
    return (cast(q), cast(k), cast(v), jnp.asarray(table), jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("hq,hkv,page_size", [(5, 1, 16), (16, 2, 32)])
def test_paged_tpu_matches_float64(hq, hkv, page_size):
    """GQA 5 and 8, pages of 16 and 32; a padding row, a partial page, a full table."""
    args = paged_case(hq, hkv, page_size, jnp.bfloat16, [0, 37, 5 * page_size])
    got = np.asarray(paged_attention(*args, impl="pallas_tpu"), np.float64)
    want = np_paged(*(np.asarray(a, np.float32) for a in args[:3]), *map(np.asarray, args[3:]))
    np.testing.assert_allclose(got, want, atol=2e-2)
    assert np.all(got[0] == 0)


def test_named_tpu_kernels_reject_shapes_they_cannot_take():
    args = paged_case(4, 2, 16, jnp.bfloat16, [3, 9])
    with pytest.raises(ValueError, match="pallas_tpu.*head_dim 64 is not a multiple of 128"):
        paged_attention(args[0][..., :64], args[1][..., :64], args[2][..., :64], *args[3:],
                        impl="pallas_tpu")
    with pytest.raises(ValueError, match="page_size 8 is not a multiple of 16 for bfloat16"):
        paged_attention(args[0], args[1][:, :, :8], args[2][:, :, :8], *args[3:],
                        impl="pallas_tpu")
    x = jnp.zeros((1, 8, 2, 64))
    with pytest.raises(ValueError, match="splash.*head_dim 64 is not a multiple of 128"):
        causal_attention(x, x, x, impl="splash")
    with pytest.raises(ValueError, match="unknown causal attention impl 'flash'"):
        causal_attention(x, x, x, impl="flash")


def test_auto_on_cpu_compiles_only_xla():
    """head_dim 128, bf16: auto holds the TPU kernels for a TPU lowering, but lowered here it
    compiles the XLA path alone and gives its values (forward and gradients)."""
    args = paged_case(8, 2, 16, jnp.bfloat16, [20, 50])
    dec = jax.jit(lambda *a: paged_attention(*a))
    assert "tpu_custom_call" not in dec.lower(*args).as_text()
    np.testing.assert_array_equal(dec(*args), paged_attention_xla(*args))

    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, 24, 4, 128)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((1, 24, 2, 128)), jnp.bfloat16)

    def loss(impl):
        return lambda q, k: causal_attention(q, k, k, impl=impl).astype(jnp.float32).sum()

    auto = jax.jit(jax.grad(loss("auto"), argnums=(0, 1)))
    assert "tpu_custom_call" not in auto.lower(q, kv).as_text()
    for a, b in zip(auto(q, kv), jax.jit(jax.grad(loss("xla"), argnums=(0, 1)))(q, kv)):
        np.testing.assert_array_equal(a, b)


def test_splash_forward_and_gradients():
    """T=300 padded to 384 (3 x 3 tiles of 128, half skipped), GQA 2, float32: forward against
    float64 NumPy, gradients against the XLA path."""
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 300, h, 128)), jnp.float32)
               for h in (2, 1, 1))
    np.testing.assert_allclose(causal_attention(q, k, v, impl="splash"), np_causal(q, k, v),
                               atol=1e-5)
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def grads(impl):
        f = lambda q, k, v: jnp.sum(causal_attention(q, k, v, impl=impl) * w)
        return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

    for got, want in zip(grads("splash"), grads("xla")):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("hq,hkv,t", [(8, 1, 130), (6, 2, 512), (3, 3, 384)])
def test_splash_bf16_matrix(hq, hkv, t):
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, h, 128)), jnp.bfloat16)
               for h in (hq, hkv, hkv))
    got = np.asarray(causal_attention(q, k, v, impl="splash"), np.float64)
    want = np_causal(*(np.asarray(x, np.float32) for x in (q, k, v)))
    np.testing.assert_allclose(got, want, atol=2e-2)
