"""The chunked LM head equals the full logits computed in float64 NumPy: log-probs of given ids,
top-k, entropy and gradients, for chunk sizes that do and do not divide B*T."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models.lm_head import head_outputs

B, T, D, V = 2, 7, 16, 50   # B*T = 14


def _data(seed=0):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(B, T, D)).astype(np.float32)
    w = (0.5 * rng.normal(size=(V, D))).astype(np.float32)
    ids = rng.integers(0, V, size=(B, T)).astype(np.int32)
    return h, w, ids


def _np_reference(h, w, ids, temperature):
    z = np.einsum("btd,vd->btv", h.astype(np.float64), w.astype(np.float64)) / temperature
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(logp)
    lp = np.take_along_axis(logp, ids[..., None], -1)[..., 0]
    order = np.argsort(-logp, axis=-1, kind="stable")
    entropy = -(p * logp).sum(-1)
    return dict(logp=logp, p=p, lp=lp, order=order, entropy=entropy)


# chunk 3 and 5 do not divide B*T = 14; 100 exceeds it.
@pytest.mark.parametrize("chunk, temperature", [(1, 1.0), (3, 0.7), (5, 1.0), (14, 0.7),
                                                (100, 1.3)])
def test_matches_full_logits(chunk, temperature):
    h, w, ids = _data()
    k = 6
    out = head_outputs(jnp.asarray(h), jnp.asarray(w), jnp.asarray(ids), temperature=temperature,
                       top_k=k, entropy=True, chunk_size=chunk)
    ref = _np_reference(h, w, ids, temperature)
    np.testing.assert_allclose(out.logprobs, ref["lp"], rtol=0, atol=2e-5)
    np.testing.assert_array_equal(out.topk_ids, ref["order"][..., :k])
    np.testing.assert_allclose(out.topk_logprobs,
                               np.take_along_axis(ref["logp"], ref["order"][..., :k], -1),
                               rtol=0, atol=2e-5)
    np.testing.assert_allclose(out.entropy, ref["entropy"], rtol=0, atol=2e-5)
    assert out.logprobs.dtype == jnp.float32 and out.topk_ids.dtype == jnp.int32
    assert out.gathered_logprobs is None


@pytest.mark.parametrize("remat", [True, False])
def test_gathered_logprobs_match_full_logits(remat):
    """Log-probs at given ids per position (the recompute's view of the actor's top-k)."""
    h, w, ids = _data(1)
    gather = np.random.default_rng(2).integers(0, V, size=(B, T, 4)).astype(np.int32)
    out = head_outputs(jnp.asarray(h), jnp.asarray(w), temperature=0.8, gather_ids=gather,
                       chunk_size=5, remat=remat)
    ref = _np_reference(h, w, ids, 0.8)
    np.testing.assert_allclose(out.gathered_logprobs,
                               np.take_along_axis(ref["logp"], gather, -1), rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="gather_ids must be"):
        head_outputs(jnp.asarray(h), jnp.asarray(w), gather_ids=gather[:, :3])


def test_outputs_not_requested_are_none():
    h, w, _ = _data()
    out = head_outputs(jnp.asarray(h), jnp.asarray(w), top_k=3, chunk_size=4)
    assert out.logprobs is None and out.entropy is None and out.topk_ids.shape == (B, T, 3)


def test_bad_ids_shape():
    h, w, ids = _data()
    with pytest.raises(ValueError, match="ids must be"):
        head_outputs(jnp.asarray(h), jnp.asarray(w), jnp.asarray(ids[:, :-1]))


@pytest.mark.parametrize("chunk", [3, 14])
def test_gradients_match_analytic(chunk):
    """d/d(hidden, head) of sum(c1 * logprob + c2 * entropy) against the float64 closed form:
    dlogp_y/dz = onehot(y) - p, dH/dz = -p (log p + H), both / T through z = h W^T / T."""
    h, w, ids = _data(1)
    temperature = 0.8
    rng = np.random.default_rng(2)
    c1, c2 = rng.normal(size=(B, T)), rng.normal(size=(B, T))

    def objective(h_, w_):
        out = head_outputs(h_, w_, jnp.asarray(ids), temperature=temperature, entropy=True,
                           chunk_size=chunk)
        return jnp.sum(jnp.asarray(c1, jnp.float32) * out.logprobs
                       + jnp.asarray(c2, jnp.float32) * out.entropy)

    gh, gw = jax.grad(objective, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(w))
    ref = _np_reference(h, w, ids, temperature)
    onehot = np.eye(V)[ids]
    gz = (c1[..., None] * (onehot - ref["p"])
          - c2[..., None] * ref["p"] * (ref["logp"] + ref["entropy"][..., None])) / temperature
    want_h = np.einsum("btv,vd->btd", gz, w.astype(np.float64))
    want_w = np.einsum("btv,btd->vd", gz, h.astype(np.float64))
    np.testing.assert_allclose(gh, want_h, rtol=0, atol=1e-4 * np.abs(want_h).max())
    np.testing.assert_allclose(gw, want_w, rtol=0, atol=1e-4 * np.abs(want_w).max())


def test_gathered_gradient_matches_analytic_and_holds_no_scatter():
    """d/dz of sum(c * logp at g) with repeated ids in a row is sum_j c_j (onehot(g_j) - p) / T;
    and the gradient is built without a scatter: XLA's GPU scatter determinism expander, which
    the gradient programs ask for, sums a scatter over a vocabulary split across devices wrongly
    (two H100s), so the log-prob gathers' gradient must not be one."""
    h, w, ids = _data(3)
    temperature = 0.9
    gather = np.random.default_rng(4).integers(0, V, size=(B, T, 3)).astype(np.int32)
    gather[:, :, 2] = gather[:, :, 0]            # the same id twice in every row
    c = np.random.default_rng(5).normal(size=(B, T, 3))
    c1 = np.random.default_rng(6).normal(size=(B, T))

    def objective(h_, w_):
        out = head_outputs(h_, w_, jnp.asarray(ids), temperature=temperature,
                           gather_ids=jnp.asarray(gather), chunk_size=4)
        return (jnp.sum(jnp.asarray(c, jnp.float32) * out.gathered_logprobs)
                + jnp.sum(jnp.asarray(c1, jnp.float32) * out.logprobs))

    grad = jax.grad(objective, argnums=(0, 1))
    gh, gw = grad(jnp.asarray(h), jnp.asarray(w))
    ref = _np_reference(h, w, ids, temperature)
    hits = np.eye(V)[gather]                     # [B, T, 3, V]
    gz = (np.einsum("btj,btjv->btv", c, hits) - c.sum(-1)[..., None] * ref["p"]
          + c1[..., None] * (np.eye(V)[ids] - ref["p"])) / temperature
    want_h = np.einsum("btv,vd->btd", gz, w.astype(np.float64))
    want_w = np.einsum("btv,btd->vd", gz, h.astype(np.float64))
    np.testing.assert_allclose(gh, want_h, rtol=0, atol=1e-4 * np.abs(want_h).max())
    np.testing.assert_allclose(gw, want_w, rtol=0, atol=1e-4 * np.abs(want_w).max())
    hlo = jax.jit(grad).lower(jnp.asarray(h), jnp.asarray(w)).as_text()
    assert "scatter" not in hlo


def test_bfloat16_head_gradient_is_summed_over_chunks_in_float32():
    """A bfloat16 head's weight gradient over 64 chunks is as close to the float64 closed form
    as over one chunk: summed over the chunks in bfloat16 it was 2.3% of the largest entry off
    (0.4% in one chunk)."""
    rng = np.random.default_rng(7)
    n, d, v = 4096, 64, 512
    h = rng.normal(size=(1, n, d)).astype(np.float32)
    w = (0.2 * rng.normal(size=(v, d))).astype(np.float32)
    ids = rng.integers(0, v, (1, n)).astype(np.int32)
    c = rng.normal(size=(1, n)).astype(np.float32)
    z = np.einsum("btd,vd->btv", h.astype(np.float64), w.astype(np.float64))
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("btv,btd->vd", c[..., None] * (np.eye(v)[ids] - p), h.astype(np.float64))

    def objective(w_, chunk):
        out = head_outputs(jnp.asarray(h, jnp.bfloat16), w_.astype(jnp.bfloat16),
                           jnp.asarray(ids), chunk_size=chunk)
        return jnp.sum(out.logprobs * c)

    for chunk in (n, 64):
        got = np.asarray(jax.grad(objective)(jnp.asarray(w), chunk), np.float64)
        assert np.abs(got - want).max() < 0.01 * np.abs(want).max(), chunk
