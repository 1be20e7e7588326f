"""The LM head in chunks over positions: log-probs of given ids, top-k, entropy.

A 32K-token response of Qwen3 (vocab 151,936) has 20 GB of float32 logits; these functions keep
one ``[chunk, vocab]`` block alive at a time (and recompute it in the backward pass), returning
only what RL needs. :func:`map_positions` is the chunking itself; the mismatch measurement
reduces its own statistics (two distributions at once) through it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp


class HeadOutputs(NamedTuple):
    """Per position: log-prob of the given id, top-k ids and log-probs, entropy, log-probs at
    given ids (all of the temperature-scaled distribution ``softmax(logits / T)``)."""

    logprobs: jax.Array | None      # [B, T] float32
    topk_ids: jax.Array | None      # [B, T, k] int32
    topk_logprobs: jax.Array | None  # [B, T, k] float32
    entropy: jax.Array | None        # [B, T] float32
    gathered_logprobs: jax.Array | None = None  # [B, T, g] float32, at gather_ids


def scaled_logits(h: jax.Array, head_weight: jax.Array, temperature: float = 1.0) -> jax.Array:
    """h ``[C, d]``, head_weight ``[V, d]`` -> ``logits / T`` ``[C, V]`` float32."""
    return jnp.einsum("td,vd->tv", h.astype(head_weight.dtype), head_weight,
                      preferred_element_type=jnp.float32) / temperature


def map_positions(fn: Callable[..., Any], xs: tuple[jax.Array, ...], *,
                  chunk_size: int = 1024, remat: bool = True) -> Any:
    """Applies ``fn`` to chunks of positions and concatenates: the one chunking of the LM head.

    xs: arrays ``[N, ...]`` (positions first: hidden states, ids, ...); ``fn(*chunks)`` gets
    ``[C, ...]`` slices (the last chunk zero padded) and returns a pytree of ``[C, ...]`` arrays,
    typically computing ``[C, V]`` logits with :func:`scaled_logits` and reducing them. Returns
    that pytree with ``[N, ...]`` leaves. With ``remat`` each chunk is recomputed in the
    backward pass, so at most one chunk's logits are ever alive.
    """
    n = xs[0].shape[0]
    chunk = max(1, min(chunk_size, n))
    pad = (-n) % chunk

    def split(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(-1, chunk, *x.shape[1:])

    body = functools.partial(jax.checkpoint, prevent_cse=False)(fn) if remat else fn
    out = jax.lax.map(lambda c: body(*c), tuple(split(x) for x in xs))
    return jax.tree.map(lambda o: o.reshape(-1, *o.shape[2:])[:n], out)


def _chunk_stats(h, w, ids, gather, temperature, top_k, with_entropy):
    logits = scaled_logits(h, w, temperature)
    logz = jax.nn.logsumexp(logits, axis=-1)
    lp = None if ids is None else jnp.take_along_axis(logits, ids[:, None], -1)[:, 0] - logz
    gathered = None if gather is None else jnp.take_along_axis(logits, gather, -1) - logz[:, None]
    tk_ids = tk_lp = None
    if top_k:
        tk_val, tk_ids = jax.lax.top_k(logits, top_k)
        tk_lp, tk_ids = tk_val - logz[:, None], tk_ids.astype(jnp.int32)
    ent = None
    if with_entropy:
        logp = logits - logz[:, None]
        ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return lp, tk_ids, tk_lp, ent, gathered


def head_outputs(hidden: jax.Array, head_weight: jax.Array, ids: jax.Array | None = None, *,
                 temperature: float = 1.0, top_k: int = 0, entropy: bool = False,
                 gather_ids: jax.Array | None = None, chunk_size: int = 1024,
                 remat: bool = True) -> HeadOutputs:
    """hidden ``[B, T, d]``, head_weight ``[V, d]``, ids ``[B, T]``, gather_ids ``[B, T, g]``
    -> :class:`HeadOutputs`.

    Differentiable in ``hidden`` and ``head_weight`` (the top-k ids are not); with ``remat``
    each chunk is rematerialised in the backward pass, so peak memory is one ``[chunk, V]``
    block (``remat=False`` where nothing is differentiated).
    """
    b, t, d = hidden.shape
    xs = {"h": hidden.reshape(b * t, d)}
    if ids is not None:
        if ids.shape != (b, t):
            raise ValueError(f"ids must be {(b, t)} like hidden's leading axes, got {ids.shape}")
        xs["ids"] = ids.reshape(b * t).astype(jnp.int32)
    if gather_ids is not None:
        if gather_ids.ndim != 3 or gather_ids.shape[:2] != (b, t):
            raise ValueError(f"gather_ids must be [B, T, g] with (B, T) = {(b, t)} like hidden's "
                             f"leading axes, got {gather_ids.shape}")
        xs["gather_ids"] = gather_ids.reshape(b * t, -1).astype(jnp.int32)
    names = tuple(xs)

    def body(*chunks):
        c = dict(zip(names, chunks))
        return _chunk_stats(c["h"], head_weight, c.get("ids"), c.get("gather_ids"), temperature,
                            top_k, entropy)

    out = map_positions(body, tuple(xs.values()), chunk_size=chunk_size, remat=remat)
    return HeadOutputs(*(None if x is None else x.reshape(b, t, *x.shape[1:]) for x in out))
