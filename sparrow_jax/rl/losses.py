"""The TIS-corrected GRPO loss (docs/design.md, section 7), per token, summed over a global token
count, with optional entropy and KL-to-reference terms (off by default, as in the paper).

Every per-token quantity is divided by ``num_tokens``, the number of response tokens of the
whole mini-batch, not of the micro-batch at hand: the micro-batch losses (and their metrics)
then simply add up, and the gradient does not depend on how the mini-batch was split.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

CORRECTIONS = ("tis", "none", "mis")
K_CLIP = 20.0    # |log p_target - log p| cap inside the k3 estimator
K3_CLIP = 10.0   # per-token cap of the k3 value


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Defaults are the paper's recipe.

    correction:
      ``tis``  truncated IS: ``w = min(exp(logp_old_dense - logp_sparse), tis_cap)``.
      ``none`` ``w = 1``: the sparse actor is treated as if it were the dense policy.
      ``mis``  masked IS: ``w = exp(logp_old_dense - logp_sparse)`` where that ratio lies in
               ``[mis_low, mis_high]`` and ``w = 0`` outside, so tokens the two policies disagree
               on too much drop out of the gradient instead of being capped. Masked tokens still
               count in the token-mean denominator (the normaliser must not depend on the
               sampled mismatch, or the micro-batch invariance of the gradient is lost).
    entropy_coef: weight of the entropy bonus: ``- entropy_coef x`` the token-mean entropy of
      the policy being trained (its full-vocabulary distribution at each response token).
    kl_coef: weight of the pull toward the reference policy (the run's initial weights): ``+
      kl_coef x`` the token-mean :func:`k3` estimate of KL(policy || reference) at the sampled
      tokens. The trainer then keeps a frozen copy of the initial weights in the compute dtype
      and runs one more dense forward a step for the reference's log-probs.
    """

    correction: str = "tis"
    tis_cap: float = 3.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 3.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0

    def __post_init__(self):
        if self.correction not in CORRECTIONS:
            raise ValueError(f"loss correction must be one of {CORRECTIONS}, got "
                             f"{self.correction!r}")
        if self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be positive, got {self.tis_cap}")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got "
                             f"{self.clip_low}, {self.clip_high}")
        if self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if not 0 <= self.mis_low < 1 < self.mis_high:
            raise ValueError(f"need 0 <= mis_low < 1 < mis_high, got {self.mis_low}, "
                             f"{self.mis_high}")
        for name in ("entropy_coef", "kl_coef"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def k3(logp_target: jax.Array, logp: jax.Array) -> jax.Array:
    """Per token ``clip(exp(k) - k - 1, -10, 10)``, ``k = clip(logp_target - logp, -20, 20)``:
    the k3 estimator of KL(p || target) on p's own samples (non-negative, zero where the two
    log-probs agree, and so is its gradient)."""
    k = jnp.clip(logp_target - logp, -K_CLIP, K_CLIP)
    return jnp.clip(jnp.exp(k) - k - 1.0, -K3_CLIP, K3_CLIP)


def importance_weights(logp_old: jax.Array, logp_sparse: jax.Array,
                       config: LossConfig) -> tuple[jax.Array, jax.Array]:
    """-> (stop-gradient weight ``w``, bool "the correction changed the raw ratio here")."""
    raw = jnp.exp(jax.lax.stop_gradient(logp_old - logp_sparse))
    if config.correction == "tis":
        return jnp.minimum(raw, config.tis_cap), raw > config.tis_cap
    if config.correction == "mis":
        outside = (raw < config.mis_low) | (raw > config.mis_high)
        return jnp.where(outside, 0.0, raw), outside
    return jnp.ones_like(raw), jnp.zeros(raw.shape, bool)


def grpo_loss(logp_new: jax.Array, logp_old: jax.Array, logp_sparse: jax.Array,
              advantages: jax.Array, mask: jax.Array, num_tokens: jax.Array | float,
              config: LossConfig = LossConfig(), *, entropy: jax.Array | None = None,
              logp_ref: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Sum of the masked per-token losses divided by ``num_tokens``.

    Args: logp_new, logp_old (dense recompute), logp_sparse (rollout) ``[B, R]``; advantages
    ``[B]`` (one per response); mask ``[B, R]`` (True on response tokens); num_tokens: the
    mini-batch's response-token count (a scalar); entropy ``[B, R]`` (the policy's, with its
    gradient; needed when ``config.entropy_coef`` > 0); logp_ref ``[B, R]`` (the reference
    policy's; needed when ``config.kl_coef`` > 0).

    Returns (loss, metrics); each metric is likewise a masked sum / num_tokens, so they add over
    micro-batches: ``clip_fraction`` (the PPO clip cut the gradient), ``dual_clip_fraction``,
    ``is_corrected_fraction`` (TIS capped or MIS masked the weight), ``ratio_mean``,
    ``is_weight_mean``; with ``kl_coef`` > 0 also ``kl`` (the token-mean k3).
    """
    for coef, name, x in (("entropy_coef", "entropy", entropy), ("kl_coef", "logp_ref", logp_ref)):
        if getattr(config, coef) and x is None:
            raise ValueError(f"a loss with {coef}={getattr(config, coef)} needs {name}")
    mask = mask.astype(jnp.float32)
    adv = advantages.astype(jnp.float32)[:, None]
    w, corrected = importance_weights(logp_old, logp_sparse, config)
    ratio = jnp.exp(logp_new - logp_old)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    pg = jnp.maximum(unclipped, clipped)
    dual = -adv * config.dual_clip
    dual_active = (adv < 0) & (dual < pg)
    pg = jnp.where(adv < 0, jnp.minimum(pg, dual), pg)
    per_token = w * pg
    denom = jnp.asarray(num_tokens, jnp.float32)

    def frac(x):
        return jnp.sum(x.astype(jnp.float32) * mask) / denom

    loss = jnp.sum(per_token * mask) / denom
    metrics = {
        "clip_fraction": frac((clipped > unclipped) & ~dual_active),
        "dual_clip_fraction": frac(dual_active),
        "is_corrected_fraction": frac(corrected),
        "ratio_mean": frac(jax.lax.stop_gradient(ratio)),
        "is_weight_mean": frac(w),
    }
    if config.entropy_coef:
        loss = loss - config.entropy_coef * jnp.sum(entropy * mask) / denom
    if config.kl_coef:
        # Not importance-weighted: the pull toward the reference holds at every sampled token.
        kl = jnp.sum(k3(jax.lax.stop_gradient(logp_ref), logp_new) * mask) / denom
        loss = loss + config.kl_coef * kl
        metrics["kl"] = jax.lax.stop_gradient(kl)
    return loss, metrics
