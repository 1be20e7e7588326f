"""The TIS-corrected GRPO loss (docs/design.md, section 7), per token, summed over a global token
count.

Every per-token quantity is divided by ``num_tokens``, the number of response tokens of the
whole mini-batch, not of the micro-batch at hand: the micro-batch losses (and their metrics)
then simply add up, and the gradient does not depend on how the mini-batch was split.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

CORRECTIONS = ("tis", "none", "mis")


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
    """

    correction: str = "tis"
    tis_cap: float = 3.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 3.0
    mis_low: float = 0.5
    mis_high: float = 2.0

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
              config: LossConfig = LossConfig()) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Sum of the masked per-token losses divided by ``num_tokens``.

    Args: logp_new, logp_old (dense recompute), logp_sparse (rollout) ``[B, R]``; advantages
    ``[B]`` (one per response); mask ``[B, R]`` (True on response tokens); num_tokens: the
    mini-batch's response-token count (a scalar).

    Returns (loss, metrics); each metric is likewise a masked sum / num_tokens, so they add over
    micro-batches: ``clip_fraction`` (the PPO clip cut the gradient), ``dual_clip_fraction``,
    ``is_corrected_fraction`` (TIS capped or MIS masked the weight), ``ratio_mean``,
    ``is_weight_mean``.
    """
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
    return loss, metrics
