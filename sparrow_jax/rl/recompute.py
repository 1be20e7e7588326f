"""The dense policy's view of a rollout's response tokens (docs/design.md, sections 1, 5 and 7).

Every pass here runs the dense forward with LoRA off (the dense policy never depends on the
sparse actor's adapter) and the LM head in chunks over response positions only, so nothing of
shape ``[batch, seq, vocab]`` is ever built.

On a device mesh (the model placed by :func:`sparrow_jax.sharding.shard_model`) each micro-batch's
rows are split over ``data x fsdp`` and the result comes back replicated.

Rows are packed into micro-batches of similar length (:func:`plan_micro_batches`) and trimmed
to a multiple of ``length_multiple`` tokens, so padding stays small and the number of distinct
compiled shapes stays bounded.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax import sharding
from sparrow_jax.models.lm_head import head_outputs
from sparrow_jax.rollout.types import Rollout


# --------------------------------------------------------------------------- response positions
def response_hidden(model, tokens: jax.Array, prompt_lengths: jax.Array,
                    response_capacity: int) -> jax.Array:
    """Dense forward (LoRA off) -> the hidden state predicting each response token.

    tokens ``[B, T]``, prompt_lengths ``[B]`` -> ``[B, R, hidden]``: row b, slot j holds the
    hidden state at position ``prompt_lengths[b] + j - 1``, which predicts response token j.
    """
    hidden, _ = model.forward(tokens, lora=False)
    return response_rows(hidden, prompt_lengths, response_capacity)


def response_rows(hidden: jax.Array, prompt_lengths: jax.Array,
                  response_capacity: int) -> jax.Array:
    """hidden ``[B, T, d]`` -> ``[B, R, d]``: slot j holds position ``prompt_lengths + j - 1``,
    the query that produced response token j (clamped garbage past the end)."""
    pos = prompt_lengths[:, None] + jnp.arange(response_capacity)[None, :] - 1
    pos = jnp.clip(pos, 0, hidden.shape[1] - 1)
    return jnp.take_along_axis(hidden, pos[:, :, None], axis=1)


def response_tokens(tokens: jax.Array, prompt_lengths: jax.Array,
                    response_capacity: int) -> jax.Array:
    """tokens ``[B, T]`` -> the response tokens ``[B, R]`` (clamped garbage past the end)."""
    pos = prompt_lengths[:, None] + jnp.arange(response_capacity)[None, :]
    return jnp.take_along_axis(tokens, jnp.clip(pos, 0, tokens.shape[1] - 1), axis=1)


# --------------------------------------------------------------------------- dense statistics
class DenseStats(NamedTuple):
    """The dense recompute of one rollout, per response slot (``[S, R, ...]``; host NumPy
    arrays from :func:`recompute`, device arrays inside jitted code)."""

    logprobs: jax.Array             # [S, R]: dense log p of the sampled token (logp_old_dense)
    actor_topk_logprobs: jax.Array  # [S, R, k]: dense log p at the sparse actor's top-k ids
    topk_ids: jax.Array             # [S, R, top_k]: dense top-k ids
    topk_logprobs: jax.Array        # [S, R, top_k]
    entropy: jax.Array              # [S, R]


def stats_from_hidden(h: jax.Array, head_weight: jax.Array, ids: jax.Array,
                      actor_topk_ids: jax.Array, temperature: float, top_k: int,
                      chunk_size: int) -> DenseStats:
    """h ``[B, R, d]`` (from :func:`response_hidden`), ids ``[B, R]``, actor_topk_ids
    ``[B, R, k]`` -> :class:`DenseStats` ``[B, R, ...]`` (not differentiated)."""
    h, head_weight = jax.lax.stop_gradient(h), jax.lax.stop_gradient(head_weight)
    out = head_outputs(h, head_weight, ids, temperature=temperature, top_k=top_k, entropy=True,
                       gather_ids=actor_topk_ids, chunk_size=chunk_size, remat=False)
    return DenseStats(out.logprobs, out.gathered_logprobs, out.topk_ids, out.topk_logprobs,
                      out.entropy)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("response_capacity",
                   "temperature", "top_k", "chunk_size"))
def _dense_stats_jit(graphdef, state, tokens, prompt_lengths, actor_topk_ids, *,
                     response_capacity, temperature, top_k, chunk_size):
    model = nnx.merge(graphdef, state)
    h = response_hidden(model, tokens, prompt_lengths, response_capacity)
    ids = response_tokens(tokens, prompt_lengths, response_capacity)
    # Under a mesh every process reads the whole result on the host: replicated.
    return sharding.constrain_replicated(stats_from_hidden(
        h, model.head_weight(), ids, actor_topk_ids, temperature, top_k, chunk_size))


# --------------------------------------------------------------------------- micro-batches
def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-int(n) // multiple) * multiple)


def plan_micro_batches(rows: np.ndarray, total_lengths: np.ndarray,
                       micro_batch_size: int) -> list[np.ndarray]:
    """Splits ``rows`` into consecutive groups of ``micro_batch_size`` after sorting by length
    (longest first, ties by row index), so each micro-batch pads to a similar length."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
    rows = np.asarray(rows)
    order = rows[np.lexsort((rows, -np.asarray(total_lengths)[rows]))]
    return [order[i:i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]


class HostRollout(NamedTuple):
    """A :class:`Rollout` as NumPy arrays (host-side slicing without device round trips)."""

    tokens: np.ndarray
    prompt_lengths: np.ndarray
    response_lengths: np.ndarray
    logprobs: np.ndarray
    topk_ids: np.ndarray

    @classmethod
    def of(cls, rollout: Rollout) -> "HostRollout":
        return cls(*(np.asarray(getattr(rollout, f)) for f in cls._fields))

    @property
    def total_lengths(self) -> np.ndarray:
        return self.prompt_lengths + self.response_lengths


def gather_rows(rows: np.ndarray, pad_rows: int, arrays: dict[str, np.ndarray],
                seq_len: int | None = None, resp_len: int | None = None) -> dict[str, np.ndarray]:
    """Takes ``rows`` of each array, pads the row axis to ``pad_rows`` with zeros, and trims axis
    1 of ``tokens`` to ``seq_len`` and of every other 2D+ array to ``resp_len``."""
    out = {}
    for name, x in arrays.items():
        x = x[rows]
        if x.ndim >= 2:
            keep = seq_len if name == "tokens" else resp_len
            if keep is not None:
                x = x[:, :keep]
                if x.shape[1] < keep:
                    x = np.pad(x, [(0, 0), (0, keep - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
        if len(rows) < pad_rows:
            x = np.pad(x, [(0, pad_rows - len(rows))] + [(0, 0)] * (x.ndim - 1))
        out[name] = x
    return out


def micro_shapes(host: HostRollout, rows: np.ndarray, length_multiple: int) -> tuple[int, int]:
    """(sequence length, response length) a micro-batch of ``rows`` is trimmed to."""
    return (round_up(host.total_lengths[rows].max(), length_multiple),
            round_up(host.response_lengths[rows].max(), length_multiple))


def assemble_rows(shape: tuple[int, int, int, int], parts, response_lengths: np.ndarray
                  ) -> DenseStats:
    """Micro-batch results -> host :class:`DenseStats` of ``shape = (S, R, k, top_k)``.

    parts: ``(rows, out)`` pairs, ``out`` a micro-batch's stats whose first ``len(rows)`` rows
    answer rows ``rows`` (padding rows after them are dropped). Zero past each response
    (``response_lengths [S]``) and on rows no part holds."""
    s, r, k, top_k = shape
    into = DenseStats(np.zeros((s, r), np.float32), np.zeros((s, r, k), np.float32),
                      np.zeros((s, r, top_k), np.int32), np.zeros((s, r, top_k), np.float32),
                      np.zeros((s, r), np.float32))
    for rows, out in parts:
        keep = min(r, out.logprobs.shape[1])
        valid = np.arange(keep)[None, :] < response_lengths[rows][:, None]
        for dst, src in zip(into, out):
            src = np.asarray(src)[:len(rows), :keep]
            dst[rows, :keep] = np.where(valid.reshape(valid.shape + (1,) * (src.ndim - 2)), src,
                                        0)
    return into


def merge_rows(base: DenseStats, other: DenseStats, rows: np.ndarray) -> DenseStats:
    """``base`` with rows ``rows`` taken from ``other`` (same layout), as new arrays."""
    take = np.zeros(base.logprobs.shape[0], bool)
    take[rows] = True
    return DenseStats(*(np.where(take.reshape((-1,) + (1,) * (b.ndim - 1)), o, b)
                        for b, o in zip(base, other)))


def reference_policy(model):
    """A frozen copy of ``model`` (its weights now) in the compute dtype: the KL term's reference
    (``update.loss.kl_coef``). Every layer casts its weights to the compute dtype at use, so the
    copy computes the log-probs the model would, at half the bytes of float32 masters; under a
    mesh it keeps the weights' layout."""
    from sparrow_jax.rollout.engine import to_compute_dtype

    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(to_compute_dtype(jnp.dtype(model.dtype)), state))


def recompute(model, rollout: Rollout, temperature: float, *, rows: np.ndarray | None = None,
              micro_batch_size: int = 8, top_k: int = 20, chunk_size: int = 1024,
              length_multiple: int = 64) -> DenseStats:
    """Dense recompute of a rollout with the model's current weights (LoRA off).

    Returns host :class:`DenseStats` in the rollout's ``[S, R]`` layout, zero past each response
    and on rows outside ``rows`` (default: all rows). ``temperature`` must be the rollout's, so
    that log-probs compare with the actor's.
    """
    if temperature <= 0:
        raise ValueError(f"recompute needs the rollout's sampling temperature > 0, got "
                         f"{temperature}")
    host = HostRollout.of(rollout)
    s, r = host.logprobs.shape
    graphdef, state = nnx.split(model)
    mesh = sharding.mesh_of(state)

    def put(x):
        """Rows over ``data x fsdp`` when the model lies on a mesh (every process passes the
        whole micro-batch; each places its own devices' rows)."""
        return jnp.asarray(x) if mesh is None else jax.device_put(
            x, sharding.batch_sharding(mesh, x.shape))

    rows = np.arange(s) if rows is None else np.asarray(rows)
    parts = []
    for micro in plan_micro_batches(rows, host.total_lengths, micro_batch_size):
        t_len, r_len = micro_shapes(host, micro, length_multiple)
        mb = gather_rows(micro, micro_batch_size,
                         {"tokens": host.tokens, "prompt_lengths": host.prompt_lengths,
                          "topk_ids": host.topk_ids}, t_len, r_len)
        with sharding.use_mesh(mesh):
            out = _dense_stats_jit(graphdef, state, put(mb["tokens"]), put(mb["prompt_lengths"]),
                                   put(mb["topk_ids"]), response_capacity=r_len,
                                   temperature=float(temperature), top_k=top_k,
                                   chunk_size=chunk_size)
        parts.append((micro, jax.device_get(out)))
    return assemble_rows((s, r, host.topk_ids.shape[2], top_k), parts, host.response_lengths)
