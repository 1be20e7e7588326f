"""Next-token sampling: temperature, top-k, top-p, greedy.

The log-prob a rollout records is always that of the *untruncated* distribution ``softmax(logits
/ T)`` (DESIGN 3.4): top-p / top-k only change which token is drawn. Training rollouts use
temperature alone, since truncation would bias the importance ratios.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0   # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0             # 0 means no top-k truncation

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0


def scaled_log_softmax(logits: jax.Array, temperature: float) -> jax.Array:
    """log softmax(logits / T) in float32; T = 0 (greedy) records the T = 1 distribution."""
    t = 1.0 if temperature == 0.0 else temperature
    return jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)


def truncate(logp: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Sets to -inf the log-probs outside the top-k and outside the smallest prefix of the sorted
    distribution whose mass reaches top_p (the token crossing top_p is kept). ``logp [..., V]``."""
    if top_k:
        kth = jax.lax.top_k(logp, top_k)[0][..., -1:]
        logp = jnp.where(logp < kth, -jnp.inf, logp)
    if top_p < 1.0:
        sorted_lp = jnp.sort(logp, axis=-1)[..., ::-1]
        mass_before = jnp.cumsum(jnp.exp(sorted_lp), axis=-1) - jnp.exp(sorted_lp)
        # the smallest kept log-prob: the last sorted entry whose preceding mass is < top_p
        keep = mass_before < top_p
        threshold = jnp.min(jnp.where(keep, sorted_lp, jnp.inf), axis=-1, keepdims=True)
        logp = jnp.where(logp < threshold, -jnp.inf, logp)
    return logp


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """logits ``[B, V]`` -> (token ``[B]`` int32, its untruncated log-prob ``[B]`` float32)."""
    return sample_from_logprobs(key, scaled_log_softmax(logits, params.temperature), params)


def sample_from_logprobs(key: jax.Array, logp: jax.Array,
                         params: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """``logp [B, V] = scaled_log_softmax(logits, T)`` -> (token ``[B]`` int32, ``logp`` at the
    token ``[B]``). For callers that also keep ``logp`` (its top-k, its entropy)."""
    if params.greedy:
        token = jnp.argmax(logp, axis=-1)
    else:
        token = jax.random.categorical(key, truncate(logp, params.top_k, params.top_p), axis=-1)
    token = token.astype(jnp.int32)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
