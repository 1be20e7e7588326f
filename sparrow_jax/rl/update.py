"""The GRPO update of the dense weights (DESIGN 3.6, 3.7).

One rollout batch -> ``epochs`` x ``mini_batches`` AdamW steps. A mini-batch's gradient is the
sum of its micro-batches' gradients, each of ``sum(token losses) / N`` with N the mini-batch's
response-token count, so micro-batching changes only the summation order. Only ``nnx.Param``
leaves that are not ``LoRAParam`` are trained, in float32, and every forward runs with LoRA off.

The dense recompute is a separate pass (:mod:`sparrow_jax.rl.recompute`), not fused into the
first mini-batch's forward: the mismatch metrics need the dense top-20 and the dense log-probs at
the actor's top-k ids for every row, which the loss forward does not produce; fusing would save
one forward of the first mini-batch only.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sparrow_jax.models.lora import LoRAParam
from sparrow_jax.rl.config import OptimConfig, UpdateConfig
from sparrow_jax.rl.losses import grpo_loss
from sparrow_jax.rl.recompute import gather_rows, plan_micro_batches, response_logprobs, round_up

TRAINABLE = nnx.All(nnx.Param, nnx.Not(LoRAParam))


class NonFiniteError(FloatingPointError):
    """A loss or gradient was NaN/inf; the update was not applied."""


class UpdateBatch(NamedTuple):
    """Host arrays of one rollout batch, as the update needs them (S rows, R response slots)."""

    tokens: np.ndarray            # [S, T] int32
    prompt_lengths: np.ndarray    # [S] int32
    response_lengths: np.ndarray  # [S] int32
    logp_old: np.ndarray          # [S, R] float32: dense recompute
    logp_sparse: np.ndarray       # [S, R] float32: the rollout's
    advantages: np.ndarray        # [S] float32


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with linear warmup from 0 to a constant rate."""
    lr = config.learning_rate
    if config.warmup_steps:
        lr = optax.join_schedules(
            [optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps),
             optax.constant_schedule(config.learning_rate)], [config.warmup_steps])
    adamw = optax.adamw(lr, b1=config.b1, b2=config.b2, eps=config.eps,
                        weight_decay=config.weight_decay)
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)


def split_model(model) -> tuple[Any, nnx.State, nnx.State]:
    """-> (graphdef, trainable float32 params, everything else)."""
    graphdef, params, rest = nnx.split(model, TRAINABLE, ...)
    bad = {str(x.dtype) for x in jax.tree.leaves(params) if x.dtype != jnp.float32}
    if bad:
        raise TypeError(f"trainable parameters must be float32 masters (DESIGN 3.0), found {bad}; "
                        "load the model with param_dtype=float32")
    return graphdef, params, rest


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=(
    "response_capacity", "temperature", "loss_config", "chunk_size"))
def _micro_grads(graphdef, params, rest, tokens, prompt_lengths, mask, logp_old, logp_sparse,
                 advantages, num_tokens, *, response_capacity, temperature, loss_config,
                 chunk_size):
    def loss_fn(p):
        model = nnx.merge(graphdef, p, rest)
        logp, entropy = response_logprobs(model, tokens, prompt_lengths, response_capacity,
                                          temperature, chunk_size=chunk_size)
        loss, metrics = grpo_loss(logp, logp_old, logp_sparse, advantages, mask, num_tokens,
                                  loss_config)
        metrics["update_entropy"] = jnp.sum(entropy * mask) / num_tokens
        return loss, metrics

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return grads, dict(metrics, loss=loss)


@jax.jit
def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


def mini_batch_gradients(graphdef, params, rest, batch: UpdateBatch, rows: np.ndarray,
                         config: UpdateConfig, temperature: float) -> tuple[Any, dict[str, float]]:
    """Gradient of the mini-batch loss over ``rows`` (token-mean over all their response
    tokens), accumulated over length-bucketed micro-batches of ``config.micro_batch_size``.
    Returns (grads like ``params``, metrics: loss, clip fractions, the current policy's
    entropy, ...)."""
    rows = np.asarray(rows)
    num_tokens = int(batch.response_lengths[rows].sum())
    if num_tokens == 0:
        raise ValueError("mini-batch holds no response token")
    total = batch.prompt_lengths + batch.response_lengths
    r_cap = batch.logp_old.shape[1]
    mask_all = np.arange(r_cap)[None, :] < batch.response_lengths[:, None]
    grads, sums = None, {}
    for micro in plan_micro_batches(rows, total, config.micro_batch_size):
        t_len = round_up(total[micro].max(), config.length_multiple)
        r_len = round_up(batch.response_lengths[micro].max(), config.length_multiple)
        mb = gather_rows(micro, config.micro_batch_size, {
            "tokens": batch.tokens, "prompt_lengths": batch.prompt_lengths, "mask": mask_all,
            "logp_old": batch.logp_old, "logp_sparse": batch.logp_sparse,
            "advantages": batch.advantages}, t_len, r_len)
        g, m = _micro_grads(graphdef, params, rest, *(jnp.asarray(mb[k]) for k in (
            "tokens", "prompt_lengths", "mask", "logp_old", "logp_sparse", "advantages")),
            jnp.float32(num_tokens), response_capacity=r_len, temperature=float(temperature),
            loss_config=config.loss, chunk_size=config.chunk_size)
        grads = g if grads is None else _add(grads, g)
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    return grads, sums


@functools.partial(jax.jit, static_argnums=(0,))
def _apply(optimizer, params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@jax.jit
def _global_norm(grads):
    return optax.global_norm(grads)


class PolicyUpdater:
    """Holds the optimizer; :meth:`update` trains ``model``'s dense weights in place."""

    def __init__(self, update_config: UpdateConfig, optim_config: OptimConfig):
        self.config = update_config
        self.optimizer = make_optimizer(optim_config)

    def init(self, model) -> Any:
        return self.optimizer.init(split_model(model)[1])

    def update(self, model, opt_state, batch: UpdateBatch, key: jax.Array, temperature: float,
               step: int) -> tuple[Any, dict[str, float]]:
        """Runs the epochs x mini-batches of one rollout batch; returns (opt_state, metrics
        averaged over the optimizer steps). Raises :class:`NonFiniteError` naming ``step``
        before applying an update whose loss or gradient is not finite."""
        cfg = self.config
        s = batch.tokens.shape[0]
        if s % cfg.mini_batches:
            raise ValueError(f"{s} rows do not split into {cfg.mini_batches} mini-batches")
        graphdef, params, rest = split_model(model)
        history: list[dict[str, float]] = []
        for epoch, k in enumerate(jax.random.split(key, cfg.epochs)):
            order = np.asarray(jax.random.permutation(k, s))
            for i, rows in enumerate(np.split(order, cfg.mini_batches)):
                grads, metrics = mini_batch_gradients(graphdef, params, rest, batch, rows, cfg,
                                                      temperature)
                norm = float(_global_norm(grads))
                if not (math.isfinite(metrics["loss"]) and math.isfinite(norm)):
                    raise NonFiniteError(
                        f"non-finite {'loss' if not math.isfinite(metrics['loss']) else 'gradient'}"
                        f" at training step {step} (epoch {epoch}, mini-batch {i}): loss="
                        f"{metrics['loss']}, grad_norm={norm}; the update was not applied")
                params, opt_state = _apply(self.optimizer, params, opt_state, grads)
                history.append(dict(metrics, grad_norm=norm))
        nnx.update(model, params)
        return opt_state, {k: float(np.mean([h[k] for h in history])) for k in history[0]}
