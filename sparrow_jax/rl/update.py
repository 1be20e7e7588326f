"""The GRPO update of the dense weights (docs/design.md, sections 7 and 8).

One rollout batch -> ``epochs`` x ``mini_batches`` AdamW steps. A mini-batch's gradient is the
sum of its micro-batches' gradients, each of ``sum(token losses) / N`` with N the mini-batch's
response-token count, so micro-batching changes only the summation order. Only ``nnx.Param``
leaves that are not ``LoRAParam`` are trained, in float32, and every forward runs with LoRA off.

When the first mini-batch's forward runs with the parameters that generated the rollout (always:
it is the first optimizer step of the batch), it doubles as the dense recompute of its rows
(docs/design.md, section 7): ``logp_old`` is its own stop-gradient log-prob and the mismatch
statistics of those rows come out of the same forward, so only the other rows need a separate
recompute pass. With one mini-batch (the paper's setting) the recompute pass disappears.

On a device mesh (parameters placed by :func:`sparrow_jax.sharding.shard_model`) the same steps
run under that mesh: micro-batch rows are split over ``data`` x ``fsdp``, gradients and updated
parameters keep the parameters' layout, the optimizer state is built in it, and the host reads
only replicated scalars and statistics. Nothing else changes: the token-mean is still global
over the mini-batch.
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

from sparrow_jax.models.lm_head import head_outputs
from sparrow_jax import sharding
from sparrow_jax.determinism import DETERMINISTIC_SCATTER
from sparrow_jax.models.lora import LoRAParam
from sparrow_jax.rl.config import OptimConfig, UpdateConfig
from sparrow_jax.rl.losses import grpo_loss
from sparrow_jax.rl.recompute import (DenseStats, assemble_rows, gather_rows,
                                      plan_micro_batches, response_hidden, response_tokens,
                                      round_up, stats_from_hidden)

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
    actor_topk_ids: np.ndarray | None = None  # [S, R, k] int32: for a fused recompute
    logp_ref: np.ndarray | None = None        # [S, R] float32: the reference's (loss.kl_coef)


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
        raise TypeError(f"trainable parameters must be float32 masters (docs/design.md, "
                        f"section 1), found {bad}; load the model with param_dtype=float32")
    return graphdef, params, rest


# Scatter-adds in a fixed order (the embedding's gradient): bit-exact resume on a GPU.
@functools.partial(jax.jit, static_argnums=(0,), static_argnames=(
    "response_capacity", "temperature", "loss_config", "chunk_size", "fused_top_k", "remat"),
    compiler_options=DETERMINISTIC_SCATTER)
def _micro_grads(graphdef, params, rest, tokens, prompt_lengths, mask, logp_old, logp_sparse,
                 advantages, actor_topk_ids, logp_ref, num_tokens, *, response_capacity,
                 temperature, loss_config, chunk_size, fused_top_k, remat):
    """Gradient of one micro-batch's share of the mini-batch loss. With ``fused_top_k`` the
    parameters are those of the rollout policy, so this forward is also the dense recompute:
    ``logp_old`` is taken from it (stop-gradient) and the rows' :class:`DenseStats` returned."""
    def loss_fn(model):
        h = response_hidden(model, tokens, prompt_lengths, response_capacity)
        ids = response_tokens(tokens, prompt_lengths, response_capacity)
        out = head_outputs(h, model.head_weight(), ids, temperature=temperature, entropy=True,
                           chunk_size=chunk_size)
        stats, old = None, logp_old
        if fused_top_k:
            stats = stats_from_hidden(h, model.head_weight(), ids, actor_topk_ids, temperature,
                                      fused_top_k, chunk_size)
            old = stats.logprobs
        loss, metrics = grpo_loss(out.logprobs, old, logp_sparse, advantages, mask, num_tokens,
                                  loss_config, entropy=out.entropy, logp_ref=logp_ref)
        metrics["update_entropy"] = jnp.sum(out.entropy * mask) / num_tokens
        return loss, (metrics, stats)

    model = nnx.merge(graphdef, params, rest)
    # Remat only on this merged copy: the rollout and recompute forwards keep none. NNX's own
    # grad, so that the model's nnx.remat sees its variables at the trace level it expects.
    model.remat = remat
    (loss, (metrics, stats)), grads = nnx.value_and_grad(
        loss_fn, argnums=nnx.DiffState(0, TRAINABLE), has_aux=True)(model)
    # Under a mesh: gradients reduce-scattered into the parameters' layout; what the host reads
    # whole on every process (metrics, fused statistics) replicated.
    return (sharding.constrain_params(grads),
            sharding.constrain_replicated(dict(metrics, loss=loss)),
            sharding.constrain_replicated(stats))


@functools.partial(jax.jit, donate_argnums=0)
def _add(a, b):
    """The gradient sum so far plus the next micro-batch's, in the buffers of the sum so far."""
    return jax.tree.map(jnp.add, a, b)


def mini_batch_gradients(graphdef, params, rest, batch: UpdateBatch, rows: np.ndarray,
                         config: UpdateConfig, temperature: float, *, fuse_top_k: int = 0
                         ) -> tuple[Any, dict[str, float], DenseStats | None]:
    """Gradient of the mini-batch loss over ``rows`` (token-mean over all their response
    tokens), accumulated over length-bucketed micro-batches of ``config.micro_batch_size``.
    Returns (grads like ``params``, metrics: loss, clip fractions, the current policy's
    entropy, ..., the fused recompute or None).

    ``fuse_top_k`` > 0: this forward is also the dense recompute of ``rows`` (dense top-k of
    that size; needs ``batch.actor_topk_ids``): ``batch.logp_old`` is ignored on them and their
    host :class:`DenseStats` returned in the batch's ``[S, R]`` layout, zero on other rows.
    """
    rows = np.asarray(rows)
    num_tokens = int(batch.response_lengths[rows].sum())
    if num_tokens == 0:
        raise ValueError("mini-batch holds no response token")
    fused = None
    if fuse_top_k:
        if batch.actor_topk_ids is None:
            raise ValueError("a fused recompute needs the rollout's actor_topk_ids in the batch")
        fused = []
    total = batch.prompt_lengths + batch.response_lengths
    r_cap = batch.logp_old.shape[1]
    mask_all = np.arange(r_cap)[None, :] < batch.response_lengths[:, None]
    actor = (batch.actor_topk_ids if fused is not None
             else np.zeros(batch.logp_old.shape + (1,), np.int32))
    if config.loss.kl_coef and batch.logp_ref is None:
        raise ValueError(f"update.loss.kl_coef={config.loss.kl_coef} needs the reference "
                         f"policy's log-probs in the batch (logp_ref)")
    ref = np.zeros_like(batch.logp_old) if batch.logp_ref is None else batch.logp_ref
    mesh = sharding.mesh_of(params)

    def put(x):
        return jnp.asarray(x) if mesh is None else jax.device_put(
            x, sharding.batch_sharding(mesh, x.shape))

    grads, sums = None, {}
    for micro in plan_micro_batches(rows, total, config.micro_batch_size):
        t_len = round_up(total[micro].max(), config.length_multiple)
        r_len = round_up(batch.response_lengths[micro].max(), config.length_multiple)
        mb = gather_rows(micro, config.micro_batch_size, {
            "tokens": batch.tokens, "prompt_lengths": batch.prompt_lengths, "mask": mask_all,
            "logp_old": batch.logp_old, "logp_sparse": batch.logp_sparse,
            "advantages": batch.advantages, "actor": actor, "ref": ref}, t_len, r_len)
        with sharding.use_mesh(mesh):
            g, m, stats = _micro_grads(graphdef, params, rest, *(put(mb[k]) for k in (
                "tokens", "prompt_lengths", "mask", "logp_old", "logp_sparse", "advantages",
                "actor", "ref")), jnp.float32(num_tokens), response_capacity=r_len,
                temperature=float(temperature), loss_config=config.loss,
                chunk_size=config.chunk_size,
                fused_top_k=fuse_top_k,
                remat=config.remat)
        if fused is not None:
            fused.append((micro, jax.device_get(stats)))
        grads = g if grads is None else _add(grads, g)
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    if fused is not None:
        fused = assemble_rows((*batch.logp_old.shape, batch.actor_topk_ids.shape[2], fuse_top_k),
                              fused, batch.response_lengths)
    return grads, sums, fused


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2, 3))
def _apply(optimizer, params, opt_state, grads):
    """One optimizer step. The moments and the gradients are donated: the new moments and
    parameters take their buffers, so the step holds no second copy of the state (without it,
    Qwen3-14B on fsdp=4 peaked at 96.4 GiB a GPU, weights and moments twice over; BENCHMARKS.md,
    "Several GPUs on one host", run 11). The parameters are not donated: clones of the model
    (the reference policy, DistillSparse's weights before the step) share their buffers."""
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return sharding.constrain_params(optax.apply_updates(params, updates)), opt_state


@jax.jit
def _global_norm(grads):
    return optax.tree.norm(grads)


class PolicyUpdater:
    """Holds the optimizer; :meth:`update` trains ``model``'s dense weights in place."""

    def __init__(self, update_config: UpdateConfig, optim_config: OptimConfig):
        self.config = update_config
        self.optimizer = make_optimizer(optim_config)

    def init(self, model) -> Any:
        """The optimizer state of ``model``'s trainable parameters, laid out like them when the
        model is sharded (every copy of the parameter tree takes the parameters' shardings)."""
        return sharding.init_opt_state(self.optimizer, split_model(model)[1])

    def plan(self, key: jax.Array, num_rows: int) -> list[list[np.ndarray]]:
        """Rows of each mini-batch of each epoch: a fresh random permutation per epoch, cut in
        ``mini_batches`` equal parts."""
        cfg = self.config
        if num_rows % cfg.mini_batches:
            raise ValueError(f"{num_rows} rows do not split into {cfg.mini_batches} "
                             "mini-batches")
        return [np.split(np.asarray(jax.random.permutation(k, num_rows)), cfg.mini_batches)
                for k in jax.random.split(key, cfg.epochs)]

    def update(self, model, opt_state, batch: UpdateBatch, plan: list[list[np.ndarray]],
               temperature: float, step: int, *, fuse_top_k: int = 0
               ) -> tuple[Any, dict[str, float], DenseStats | None]:
        """Runs the optimizer steps of ``plan`` (from :meth:`plan`) on one rollout batch;
        returns (opt_state, metrics averaged over the optimizer steps, the fused recompute).

        ``fuse_top_k`` > 0: the first mini-batch's forward (``plan[0][0]``; same parameters as
        the rollout policy) is also its rows' dense recompute, with a dense top-k of that size:
        their host :class:`DenseStats` are returned (``[S, R]`` layout, zero on other rows; None
        without fusing), and the later optimizer steps use their log-probs as ``logp_old``
        (``batch`` itself is left as it is). Raises :class:`NonFiniteError` naming ``step``
        before applying an update whose loss or gradient is not finite. The ``opt_state`` given
        is consumed by the first optimizer step (its buffers become the new state's); ``model``
        is updated in place once every step has run.
        """
        graphdef, params, rest = split_model(model)
        history: list[dict[str, float]] = []
        fused = None
        if fuse_top_k:
            batch = batch._replace(logp_old=batch.logp_old.copy())
        for epoch, mini_batches in enumerate(plan):
            for i, rows in enumerate(mini_batches):
                first = bool(fuse_top_k) and epoch == 0 and i == 0
                grads, metrics, stats = mini_batch_gradients(
                    graphdef, params, rest, batch, rows, self.config, temperature,
                    fuse_top_k=fuse_top_k if first else 0)
                if first:
                    fused = stats
                    batch.logp_old[rows] = fused.logprobs[rows]
                norm = float(_global_norm(grads))
                if not (math.isfinite(metrics["loss"]) and math.isfinite(norm)):
                    raise NonFiniteError(
                        f"non-finite {'loss' if not math.isfinite(metrics['loss']) else 'gradient'}"
                        f" at training step {step} (epoch {epoch}, mini-batch {i}): loss="
                        f"{metrics['loss']}, grad_norm={norm}; the update was not applied")
                with sharding.use_mesh(sharding.mesh_of(params)):
                    params, opt_state = _apply(self.optimizer, params, opt_state, grads)
                history.append(dict(metrics, grad_norm=norm))
        nnx.update(model, params)
        return (opt_state, {k: float(np.mean([h[k] for h in history])) for k in history[0]},
                fused)
