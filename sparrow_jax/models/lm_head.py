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

from sparrow_jax import sharding


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


def map_positions(fn: Callable[..., Any], xs: tuple[jax.Array, ...], params: Any = (), *,
                  chunk_size: int = 1024, remat: bool = True) -> Any:
    """Applies ``fn`` to chunks of positions and concatenates: the one chunking of the LM head.

    xs: arrays ``[N, ...]`` (positions first: hidden states, ids, ...); ``fn(params, *chunks)``
    gets ``params`` (a pytree every chunk reads whole: the head weight) and ``[C, ...]`` slices
    (the last chunk zero padded) and returns a pytree of ``[C, ...]`` arrays, typically
    computing ``[C, V]`` logits with :func:`scaled_logits` and reducing them. Returns that
    pytree with ``[N, ...]`` leaves. With ``remat`` each chunk is recomputed in the backward
    pass, so at most one chunk's logits are ever alive.

    On a mesh whose data/fsdp axes split the positions, each device loops over its own
    positions (chunks of ``chunk_size`` of them), ``params`` gathered once and their gradient
    summed over the devices once. A loop over the whole array would run every chunk on every
    device; ``params`` reached by closure would have their gradient summed at every chunk.
    """
    axes = sharding.row_axes(xs[0].shape[0])
    if axes is None:
        return _map_chunks(fn, params, xs, chunk_size, remat)

    def local(params, *xs):
        params = jax.tree.map(lambda a: jax.lax.pcast(a, axes, to="varying"), params)
        return _map_chunks(fn, params, xs, chunk_size, remat)

    rows = sharding.PartitionSpec(axes)
    return jax.shard_map(local, in_specs=(sharding.PartitionSpec(), *(rows,) * len(xs)),
                         out_specs=rows, axis_names=set(axes))(params, *xs)


def _map_chunks(fn, params, xs, chunk_size, remat):
    n = xs[0].shape[0]
    chunk = max(1, min(chunk_size, n))
    pad = (-n) % chunk

    def split(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(-1, chunk, *x.shape[1:])

    body = functools.partial(jax.checkpoint, prevent_cse=False)(fn) if remat else fn
    out = jax.lax.map(lambda c: body(params, *c), tuple(split(x) for x in xs))
    return jax.tree.map(lambda o: o.reshape(-1, *o.shape[2:])[:n], out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def take_vocab(logits: jax.Array, ids: jax.Array, vocab: int) -> jax.Array:
    """logits ``[C, V]``, ids ``[C, g]`` -> ``logits`` at ``ids``, ``[C, g]``.

    A gather whose gradient is built by comparing ids with the vocabulary's positions instead
    of scatter-adding into it. With the vocabulary split over devices (``tensor``), that scatter
    is partitioned into per-shard scatters that drop the other shards' ids, and XLA's GPU
    scatter determinism expander, which the gradient programs ask for
    (:mod:`sparrow_jax.determinism`), returns wrong sums for them (two H100s, jax 0.11.2: the
    log-prob gradient off by 0.02-7 against 1e-6 without the expander). The comparison is one
    elementwise pass over the ``[C, V]`` block, as the scatter's zero fill was, and is
    deterministic by construction.
    """
    del vocab
    return jnp.take_along_axis(logits, ids, -1)


def _take_vocab_fwd(logits, ids, vocab):
    del vocab
    return jnp.take_along_axis(logits, ids, -1), ids


def _take_vocab_bwd(vocab, ids, ct):
    pos = jax.lax.broadcasted_iota(jnp.int32, (ids.shape[0], vocab), 1)
    d = sum(jnp.where(pos == ids[:, j:j + 1], ct[:, j:j + 1], 0) for j in range(ids.shape[1]))
    return d.astype(ct.dtype), None


take_vocab.defvjp(_take_vocab_fwd, _take_vocab_bwd)


@jax.custom_vjp
def _read_as(w: jax.Array, w32: jax.Array) -> jax.Array:
    """``w``, whose gradient goes to ``w32`` (the same weight in float32) in float32.

    Summed over a loop's chunks in a bfloat16 weight's own dtype, the head's gradient lost
    precision with the chunk count (2.3% of its largest entry at 64 chunks against 0.4% in one
    chunk, tests/test_lm_head.py).
    """
    del w32
    return w


def _read_as_fwd(w, w32):
    del w32
    return w, None


def _read_as_bwd(_, ct):
    return None, ct.astype(jnp.float32)


_read_as.defvjp(_read_as_fwd, _read_as_bwd)


def _chunk_stats(h, w, ids, gather, temperature, top_k, with_entropy):
    logits = scaled_logits(h, w, temperature)
    logz = jax.nn.logsumexp(logits, axis=-1)
    v = logits.shape[-1]
    lp = None if ids is None else take_vocab(logits, ids[:, None], v)[:, 0] - logz
    gathered = None if gather is None else take_vocab(logits, gather, v) - logz[:, None]
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

    def body(w, *chunks):
        c = dict(zip(names, chunks))
        return _chunk_stats(c["h"], _read_as(*w), c.get("ids"), c.get("gather_ids"),
                            temperature, top_k, entropy)

    # The chunks read the weight as given; its gradient is summed over them in float32 (the
    # loop's second weight, which nothing reads) and rounded once after the loop.
    weights = (jax.lax.stop_gradient(head_weight), head_weight.astype(jnp.float32))
    out = map_positions(body, tuple(xs.values()), weights, chunk_size=chunk_size, remat=remat)
    return HeadOutputs(*(None if x is None else x.reshape(b, t, *x.shape[1:]) for x in out))
