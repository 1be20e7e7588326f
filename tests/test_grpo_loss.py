"""The GRPO/TIS loss (docs/design.md, section 7) against hand-worked values and a float64 NumPy
reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.rl.losses import LossConfig, grpo_loss

# Six response tokens over two rows (A = +1 and A = -1), logp_old = 0 so ratio = exp(logp_new),
# and one padding slot per row holding garbage that must not count.
#   row 0 (A=+1): ratio 1.5 -> max(-1.5, -1.28) = -1.28 (clip-higher acts)
#                 ratio 0.5 -> max(-0.5, -0.8)  = -0.5  (no clip)
#                 ratio 1, raw IS weight 5 -> TIS cap 3 -> 3 * -1 = -3
#   row 1 (A=-1): ratio 0.7 -> max(0.7, 0.8) = 0.8 (low clip acts), dual min(0.8, 3) = 0.8
#                 ratio 4   -> max(4, 1.28) = 4, dual clip -> 3
#                 ratio 1, raw IS weight 2 -> 2 * 1 = 2
#   tis:  (-1.28 - 0.5 - 3 + 0.8 + 3 + 2) / 6 = 1.02 / 6
#   mis (band [0.5, 2]): the weight-5 token is masked: (-1.28 - 0.5 + 0 + 0.8 + 3 + 2) / 6
#   none: (-1.28 - 0.5 - 1 + 0.8 + 3 + 1) / 6
LOGP_NEW = np.log([[1.5, 0.5, 1.0, 7.0], [0.7, 4.0, 1.0, 0.1]])
LOGP_OLD = np.zeros((2, 4))
LOGP_SPARSE = -np.log([[1.0, 1.0, 5.0, 9.0], [1.0, 1.0, 2.0, 9.0]])
ADV = np.array([1.0, -1.0])
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], bool)


def _loss(correction, **kw):
    return grpo_loss(jnp.asarray(LOGP_NEW, jnp.float32), jnp.asarray(LOGP_OLD, jnp.float32),
                     jnp.asarray(LOGP_SPARSE, jnp.float32), jnp.asarray(ADV, jnp.float32),
                     jnp.asarray(MASK), 6, LossConfig(correction=correction, **kw))


@pytest.mark.parametrize("correction,expected", [
    ("tis", 1.02 / 6), ("mis", 4.02 / 6), ("none", 2.02 / 6)])
def test_hand_worked_loss(correction, expected):
    loss, _ = _loss(correction)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)


def test_hand_worked_metrics():
    _, m = _loss("tis")
    np.testing.assert_allclose(float(m["clip_fraction"]), 2 / 6, rtol=1e-6)
    np.testing.assert_allclose(float(m["dual_clip_fraction"]), 1 / 6, rtol=1e-6)
    np.testing.assert_allclose(float(m["is_corrected_fraction"]), 1 / 6, rtol=1e-6)
    _, m = _loss("mis")
    np.testing.assert_allclose(float(m["is_corrected_fraction"]), 1 / 6, rtol=1e-6)


def _np_loss(logp_new, logp_old, logp_sparse, adv, mask, num_tokens, cfg):
    """Written from docs/design.md, section 7 token by token, in float64."""
    total = 0.0
    for b in range(logp_new.shape[0]):
        a = adv[b]
        for j in range(logp_new.shape[1]):
            if not mask[b, j]:
                continue
            raw = np.exp(logp_old[b, j] - logp_sparse[b, j])
            if cfg.correction == "tis":
                w = min(raw, cfg.tis_cap)
            elif cfg.correction == "mis":
                w = raw if cfg.mis_low <= raw <= cfg.mis_high else 0.0
            else:
                w = 1.0
            r = np.exp(logp_new[b, j] - logp_old[b, j])
            pg = max(-a * r, -a * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high))
            if a < 0:
                pg = min(pg, -a * cfg.dual_clip)
            total += w * pg
    return total / num_tokens


def _random_batch(seed, b=5, r=7):
    rng = np.random.default_rng(seed)
    logp_old = rng.uniform(-3, -0.1, (b, r))
    logp_new = logp_old + rng.normal(0, 0.6, (b, r))
    logp_sparse = logp_old + rng.normal(0, 0.8, (b, r))
    adv = rng.normal(0, 1, b)
    mask = np.arange(r)[None, :] < rng.integers(1, r + 1, b)[:, None]
    return logp_new, logp_old, logp_sparse, adv, mask


@pytest.mark.parametrize("correction", ["tis", "mis", "none"])
def test_matches_numpy_reference(correction):
    cfg = LossConfig(correction=correction)
    for seed in range(3):
        batch = _random_batch(seed)
        n = int(batch[-1].sum()) + 3  # a global count larger than this micro-batch's
        loss, _ = grpo_loss(*[jnp.asarray(x) for x in batch], n, cfg)
        np.testing.assert_allclose(float(loss), _np_loss(*batch, n, cfg), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_gradient_matches_finite_differences(correction):
    cfg = LossConfig(correction=correction)
    logp_new, logp_old, logp_sparse, adv, mask = _random_batch(11)
    n = int(mask.sum())
    grad = np.asarray(jax.grad(lambda x: grpo_loss(
        x, jnp.asarray(logp_old, jnp.float32), jnp.asarray(logp_sparse, jnp.float32),
        jnp.asarray(adv, jnp.float32), jnp.asarray(mask), n, cfg)[0])(
            jnp.asarray(logp_new, jnp.float32)))
    h = 1e-6
    fd = np.zeros_like(logp_new)
    for idx in np.ndindex(*logp_new.shape):
        up, down = logp_new.copy(), logp_new.copy()
        up[idx] += h
        down[idx] -= h
        fd[idx] = (_np_loss(up, logp_old, logp_sparse, adv, mask, n, cfg)
                   - _np_loss(down, logp_old, logp_sparse, adv, mask, n, cfg)) / (2 * h)
    assert np.any(fd != 0) and np.any((fd == 0) & mask)  # both live and clipped tokens present
    np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-7)


def test_weights_are_stop_gradient():
    # d loss / d logp_sparse must be zero, and logp_old enters only through the ratio.
    logp_new, logp_old, logp_sparse, adv, mask = [jnp.asarray(x) for x in _random_batch(3)]
    g = jax.grad(lambda s: grpo_loss(logp_new, logp_old, s, adv, mask, 10)[0])(logp_sparse)
    assert not np.any(np.asarray(g))


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="correction"):
        LossConfig(correction="ppo")
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0, got -0.1"):
        LossConfig(kl_coef=-0.1)
    with pytest.raises(ValueError, match="entropy_coef"):
        LossConfig(entropy_coef=float("inf"))


def _np_extra_terms(logp_new, logp_ref, entropy, mask, num_tokens, cfg):
    """The entropy bonus and the KL pull, token by token in float64 (docs/design.md, section 7):
    ``- c_H * H`` and ``+ c_KL * k3``, ``k3 = exp(k) - k - 1``, ``k = ref - new`` (unclipped:
    the test's log-prob gaps stay far inside the clips)."""
    total = 0.0
    for idx in zip(*np.nonzero(mask)):
        k = logp_ref[idx] - logp_new[idx]
        total += cfg.kl_coef * (np.exp(k) - k - 1) - cfg.entropy_coef * entropy[idx]
    return total / num_tokens


def test_entropy_and_kl_terms_match_numpy_and_their_gradients():
    cfg = LossConfig(entropy_coef=0.03, kl_coef=0.2)
    logp_new, logp_old, logp_sparse, adv, mask = _random_batch(5)
    rng = np.random.default_rng(6)
    logp_ref = logp_new + rng.normal(0, 0.5, logp_new.shape)
    entropy = rng.uniform(0.1, 3.0, logp_new.shape)
    n = int(mask.sum()) + 2

    def loss_of(new, ent):
        return grpo_loss(new, *[jnp.asarray(x) for x in (logp_old, logp_sparse, adv, mask)], n,
                         cfg, entropy=ent, logp_ref=jnp.asarray(logp_ref))

    loss, metrics = loss_of(jnp.asarray(logp_new), jnp.asarray(entropy))
    pg = _np_loss(logp_new, logp_old, logp_sparse, adv, mask, n, cfg)
    extra = _np_extra_terms(logp_new, logp_ref, entropy, mask, n, cfg)
    np.testing.assert_allclose(float(loss), pg + extra, rtol=1e-5)
    kl = _np_extra_terms(logp_new, logp_ref, entropy, mask, n, LossConfig(kl_coef=1.0))
    np.testing.assert_allclose(float(metrics["kl"]), kl, rtol=1e-5)
    # gradients: d/d logp_new of the KL term is c_KL (1 - exp(ref - new)); d/d entropy is -c_H
    g_new, g_ent = jax.grad(lambda a, b: loss_of(a, b)[0], (0, 1))(jnp.asarray(logp_new),
                                                                   jnp.asarray(entropy))
    g_pg = jax.grad(lambda a: grpo_loss(
        a, *[jnp.asarray(x) for x in (logp_old, logp_sparse, adv, mask)], n, LossConfig())[0])(
            jnp.asarray(logp_new))
    want = cfg.kl_coef * (1 - np.exp(logp_ref - logp_new)) * mask / n
    np.testing.assert_allclose(np.asarray(g_new) - np.asarray(g_pg), want, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(g_ent), -cfg.entropy_coef * mask / n, rtol=1e-6)
    # a policy equal to its reference: no KL and no pull
    same, _ = grpo_loss(jnp.asarray(logp_new), *[jnp.asarray(x) for x in (
        logp_old, logp_sparse, adv, mask)], n, LossConfig(kl_coef=0.5),
        logp_ref=jnp.asarray(logp_new))
    np.testing.assert_allclose(float(same), pg, rtol=1e-6)


def test_terms_off_by_default_and_their_inputs_required():
    batch = [jnp.asarray(x) for x in _random_batch(7)]
    loss, metrics = grpo_loss(*batch, 10)
    assert "kl" not in metrics
    junk = jnp.full(batch[0].shape, jnp.nan)
    same, _ = grpo_loss(*batch, 10, entropy=junk, logp_ref=junk)   # unused when off
    assert float(same) == float(loss)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs logp_ref"):
        grpo_loss(*batch, 10, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy_coef=0.1 needs entropy"):
        grpo_loss(*batch, 10, LossConfig(entropy_coef=0.1))
