"""Next-token sampling: temperature, top-k, top-p, greedy.

The log-prob a rollout records is always that of the *untruncated* distribution
``softmax(logits / T)`` (docs/design.md, section 5): top-p / top-k only change which token is
drawn. Training rollouts use temperature alone, since truncation would bias the importance ratios.

Random streams: a rollout draws each row's token from a key that depends on (rollout key, prompt
id, sample index, response position) only (:func:`stream_keys`, :func:`step_keys`), never on the
row's slot, the batch it shares or the device it runs on: splitting a prompt list across calls,
shards or processes, or raising n, leaves every sample's tokens unchanged.
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


def stream_keys(key: jax.Array, prompt_ids: jax.Array, sample_ids: jax.Array) -> jax.Array:
    """Each row's random stream: ``fold_in(fold_in(key, prompt_ids[b]), sample_ids[b])``.
    ``prompt_ids, sample_ids [S]`` int -> ``[S]`` keys."""
    return jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(key, p), s))(
        jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(sample_ids, jnp.int32))


def step_keys(streams: jax.Array, positions: jax.Array) -> jax.Array:
    """The keys that draw response position ``positions [S]`` (0: the first response token) of
    the rows with ``streams [S]`` -> ``[S]`` keys."""
    return jax.vmap(jax.random.fold_in)(streams, jnp.asarray(positions, jnp.int32))


def sample(key: jax.Array, logits: jax.Array,
           params: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """logits ``[B, V]`` -> (token ``[B]`` int32, its untruncated log-prob ``[B]`` float32)."""
    return sample_from_logprobs(key, scaled_log_softmax(logits, params.temperature), params)


def sample_from_logprobs(key: jax.Array, logp: jax.Array,
                         params: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """``logp [B, V] = scaled_log_softmax(logits, T)`` -> (token ``[B]`` int32, ``logp`` at the
    token ``[B]``). For callers that also keep ``logp`` (its top-k, its entropy).

    ``key``: one key for the whole batch, or ``[B]`` keys, row b drawn from ``key[b]`` alone
    (as ``categorical(key[b], ...)`` on that row: the Gumbel-max draw ``argmax(logp + g)``,
    ``g = gumbel(key[b], (V,))``), so a row's token does not depend on the other rows."""
    if params.greedy:
        token = jnp.argmax(logp, axis=-1)
    else:
        kept = truncate(logp, params.top_k, params.top_p)
        typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        if key.ndim == (1 if typed else 2):     # raw uint32 keys carry a trailing axis
            token = jax.vmap(lambda k, row: jax.random.categorical(k, row))(key, kept)
        else:
            token = jax.random.categorical(key, kept, axis=-1)
    token = token.astype(jnp.int32)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
