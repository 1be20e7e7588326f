"""q/k-norm and RoPE as data (QKPrep) against float64 NumPy, and the decode step's fused kernel
(q/k-norm, RoPE and the cache write in one launch, interpreted here) against the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.attention.paged_cache import init_cache, prep_and_append_token
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.qk_prep import QKPrep
from sparrow_jax.models.rope import rope_angles
from test_paged_cache import write_steps

EPS = 1e-6


def _numpy_prep(x, weight, positions, theta):
    """float64: x [B, H, D] normed over D, scaled, rotated (rotate-half) at positions [B]."""
    x = x.astype(np.float64)
    d = x.shape[-1]
    normed = x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * weight
    inv = theta ** -(np.arange(0, d, 2) / d)
    ang = np.concatenate([positions[:, None] * inv] * 2, axis=-1)[:, None, :]
    half = d // 2
    rotated = np.concatenate([-normed[..., half:], normed[..., :half]], axis=-1)
    return normed * np.cos(ang) + rotated * np.sin(ang)


def _prep(rng, d, positions, theta=1e4):
    cos, sin = rope_angles(jnp.asarray(positions, jnp.int32)[:, None], d, theta)
    qw, kw = (jnp.asarray(rng.uniform(0.5, 1.5, size=d), jnp.float32) for _ in range(2))
    return QKPrep(qw, kw, cos, sin, eps=EPS)


def test_prep_matches_float64_numpy():
    rng = np.random.default_rng(0)
    b, hq, hk, d = 3, 4, 2, 16
    positions = np.array([0, 17, 30000])
    prep = _prep(rng, d, positions)
    q, k = (rng.normal(size=(b, h, d)) * 3 for h in (hq, hk))
    got_q, got_k = prep(jnp.asarray(q, jnp.float32)[:, None], jnp.asarray(k, jnp.float32)[:, None])
    for got, x, w in ((got_q, q, prep.q_weight), (got_k, k, prep.k_weight)):
        want = _numpy_prep(x, np.asarray(w, np.float64), positions, 1e4)
        # Angles near 3e4 rad are formed in float32 (as the model does): ~2e-3 rad of slack.
        np.testing.assert_allclose(np.asarray(got[:, 0]), want, rtol=0, atol=1e-2)
        np.testing.assert_allclose(np.asarray(got[:2, 0]), want[:2], rtol=0, atol=2e-5)


# 4 + 2 + 2 heads of projections, and 12; a Quest cache (running min and max, kmin and kmax).
@pytest.mark.parametrize("q_heads,dtype,scorer", [
    (4, jnp.float32, "centroid"), (8, jnp.float32, "centroid"), (4, jnp.bfloat16, "centroid"),
    (8, jnp.bfloat16, "centroid"), (4, jnp.bfloat16, "quest")])
def test_fused_kernel_matches_the_xla_path(q_heads, dtype, scorer):
    """The steps of ``write_steps``: the kernel's q and every cache array against QKPrep + the
    XLA scatters; and the kernel handed the projections as split-K partial sums (the decode
    GEMM's) bit for bit against the kernel handed their sum."""
    cfg = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=q_heads, num_key_value_heads=2, head_dim=8)
    caches, steps = write_steps(cfg, dtype, scorer=scorer)
    caches["partials"] = caches["pallas"]
    rng = np.random.default_rng(5)
    # bfloat16: the two paths may round a product differently (one ulp at the normed values'
    # scale of ~1).
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2 ** -7,
                                                                       atol=2 ** -7)
    for active, pos in steps:
        prep = _prep(rng, 8, np.asarray(pos))
        q = jnp.asarray(rng.normal(size=(3, q_heads, 8)) * 3, dtype)
        k, v = (jnp.asarray(rng.normal(size=(3, 2, 8)) * 3, dtype) for _ in range(2))
        outs = {}
        for impl in caches:
            for layer in range(2):
                outs[impl], caches[impl] = prep_and_append_token(
                    caches[impl], layer, q, k, v, pos, active,
                    prep.replace(partials=_partials(rng, q, k, v)) if impl == "partials"
                    else prep, impl="xla" if impl == "xla" else "pallas")
        np.testing.assert_allclose(np.asarray(outs["pallas"], np.float32),
                                   np.asarray(outs["xla"], np.float32), **tol)
        np.testing.assert_array_equal(np.asarray(outs["partials"], np.float32),
                                      np.asarray(outs["pallas"], np.float32))
    for a, c in zip(jax.tree.leaves(caches["xla"]), jax.tree.leaves(caches["pallas"])):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32), **tol)
    for a, c in zip(jax.tree.leaves(caches["partials"]), jax.tree.leaves(caches["pallas"])):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


def _partials(rng, q, k, v, rows=16):
    """q, k, v ``[B, H, D]`` as the decode GEMM would hand them: two float32 partial sums
    ``[2, rows, (Hq + 2 Hkv) * D]`` adding up to them exactly (each value's bfloat16 head, then
    the rest), garbage in the rows past B (the kernel must read only its own row)."""
    b = q.shape[0]
    qkv = jnp.concatenate([q, k, v], axis=1).reshape(b, -1).astype(jnp.float32)
    head = qkv.astype(jnp.bfloat16).astype(jnp.float32)
    parts = jnp.stack([head, qkv - head])
    junk = jnp.asarray(rng.normal(size=(2, rows - b, qkv.shape[1])), jnp.float32)
    return jnp.concatenate([parts, junk], axis=1)


def test_fused_kernel_needs_power_of_two_query_heads():
    cfg = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    cache = init_cache(cfg, 8, np.zeros((1, 2), np.int32), page_size=4)
    prep = _prep(np.random.default_rng(0), 8, np.array([0]))
    q, k = jnp.zeros((1, 6, 8)), jnp.zeros((1, 2, 8))
    with pytest.raises(ValueError, match=r"q_heads \(6\) must be powers of two"):
        prep_and_append_token(cache, 0, q, k, k, jnp.zeros((1,), jnp.int32),
                              jnp.ones((1,), bool), prep, impl="pallas")
