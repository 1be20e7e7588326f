"""DistillSparse: the sparse actor's LoRA trained toward the dense policy (docs/design.md,
section 8).

The student is the sparse actor itself: dense weights (frozen here) plus LoRA, run through the
teacher-forced sparse forward with the budgets the rollout recorded and the rollout's selection
rule (page size, scorer, dense layers), so student and actor are one function and the student's
log-probs at the start of the update equal the rollout's. Its loss per rollout batch:

    L = grpo_loss(logp_new=logp_student, logp_old=stop_grad(logp_student at the start),
                  logp_sparse=the rollout's, the batch's advantages)      # TIS weight
        + lambda_kl * token_mean(clip(exp(k) - k - 1, -10, 10)),
    k = clip(logp_dense - logp_student, -20, 20)

with ``logp_dense`` the dense recompute of the same dense weights (before the GRPO step moves
them, so the adapter is never asked to undo that step). Only ``LoRAParam`` leaves train, with
their own AdamW. Micro-batching works as in :mod:`sparrow_jax.rl.update`: every token loss is
divided by the mini-batch's token count, so micro-batches only change the summation order, and
the first mini-batch's forward doubles as the pass that records its rows' ``logp_old``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sparrow_jax import sharding
from sparrow_jax.determinism import DETERMINISTIC_SCATTER
from sparrow_jax.attention.teacher_forced import TeacherForcedBudgets, make_teacher_forced_attend
from sparrow_jax.models.lm_head import head_outputs
from sparrow_jax.models.lora import LoRAParam
# DistillConfig lives with the trainer's other configs (TrainConfig.distill); re-exported here.
from sparrow_jax.rl.config import DistillConfig, OptimConfig, UpdateConfig  # noqa: F401
from sparrow_jax.rl.losses import LossConfig, grpo_loss, k3
from sparrow_jax.rl.recompute import (gather_rows, plan_micro_batches, response_rows,
                                      response_tokens, round_up)
from sparrow_jax.rl.update import NonFiniteError, make_optimizer
from sparrow_jax.rollout.types import Rollout


@dataclasses.dataclass(frozen=True)
class SparseRule:
    """The rollout's selection rule, which the student replays (from its
    :class:`~sparrow_jax.rollout.engine.RolloutConfig`): page size, scorer, dense layers; and
    how the teacher-forced attention runs (speed and memory only, never the result): its query
    chunk, implementation (:func:`~sparrow_jax.attention.teacher_forced.resolve_impl`) and the
    kernel's block sizes."""

    page_size: int = 16
    scorer: str = "centroid"
    dense_layers: tuple[int, ...] = (0, 1)
    query_chunk: int = 128
    impl: str = "auto"
    tuning: Any = None    # the kernel's TeacherForcedTuning; None: its defaults

    @classmethod
    def of(cls, rollout_config, query_chunk: int = 128, impl: str = "auto") -> "SparseRule":
        return cls(rollout_config.page_size, rollout_config.scorer,
                   tuple(rollout_config.dense_layers), query_chunk, impl)


class DistillBatch(NamedTuple):
    """Host arrays of one rollout batch, as the LoRA update needs them (S rows, R slots)."""

    tokens: np.ndarray            # [S, T] int32
    prompt_lengths: np.ndarray    # [S] int32
    response_lengths: np.ndarray  # [S] int32
    budget_pages: np.ndarray      # [S, R] int32: the rollout's recorded budgets (0: dense)
    logp_sparse: np.ndarray       # [S, R] float32: the rollout's (LoRA actor's) log-probs
    logp_dense: np.ndarray        # [S, R] float32: dense recompute, same dense weights
    advantages: np.ndarray        # [S] float32

    @classmethod
    def of(cls, rollout: Rollout, logp_dense, advantages) -> "DistillBatch":
        return cls(*(np.asarray(getattr(rollout, f)) for f in (
            "tokens", "prompt_lengths", "response_lengths", "budget_pages", "logprobs")),
            np.asarray(logp_dense, np.float32), np.asarray(advantages, np.float32))


# --------------------------------------------------------------------------- the student
def position_budgets(budget_pages: jax.Array, prompt_lengths: jax.Array, seq_len: int,
                     page_size: int) -> jax.Array:
    """The rollout's per-step budgets ``[B, R]`` -> per-position budgets ``[B, T]`` of
    :class:`TeacherForcedBudgets`.

    Response token j >= 1 was sampled by the decode step that fed position ``p + j - 1``, at that
    step's recorded budget; token 0 came from the dense prefill, and a recorded 0 means the step
    ran densely (no schedule). Dense positions get ``max(3, ceil(T / page_size))`` pages, which
    selects every page.
    """
    r = budget_pages.shape[1]
    dense = max(3, -(-seq_len // page_size))
    slot = jnp.arange(seq_len, dtype=jnp.int32)[None, :] - prompt_lengths[:, None] + 1
    recorded = jnp.take_along_axis(budget_pages, jnp.clip(slot, 0, r - 1), axis=1)
    use = (slot >= 1) & (slot < r) & (recorded > 0)
    return jnp.where(use, recorded, dense).astype(jnp.int32)


def actor_hidden(model, tokens: jax.Array, prompt_lengths: jax.Array, budget_pages: jax.Array,
                 rule: SparseRule, *, lora: bool = True) -> jax.Array:
    """The sparse actor teacher-forced over a rollout: tokens ``[B, T]``, prompt_lengths
    ``[B]``, budget_pages ``[B, R]`` (the rollout's) -> final hidden states ``[B, T, d]``, each
    position attending as the decode step that fed it did; ``lora``: the adapters on."""
    attend = make_teacher_forced_attend(page_size=rule.page_size, scorer=rule.scorer,
                                        dense_layers=rule.dense_layers,
                                        chunk_size=rule.query_chunk, impl=rule.impl,
                                        tuning=rule.tuning)
    state = TeacherForcedBudgets(
        position_budgets(budget_pages, prompt_lengths, tokens.shape[1], rule.page_size),
        prompt_lengths)
    return model.forward(tokens, attend=attend, state=state, lora=lora)[0]


def student_logprobs(model, tokens: jax.Array, prompt_lengths: jax.Array,
                     budget_pages: jax.Array, *, temperature: float, rule: SparseRule,
                     chunk_size: int = 1024) -> jax.Array:
    """The sparse actor (LoRA on) teacher-forced over a rollout -> log p of each response token
    ``[B, R]`` at ``temperature``.

    tokens ``[B, T]``, prompt_lengths ``[B]``, budget_pages ``[B, R]`` (the rollout's). Equals
    the log-probs the rollout recorded for the same weights; differentiable in the weights.
    """
    r = budget_pages.shape[1]
    hidden = actor_hidden(model, tokens, prompt_lengths, budget_pages, rule)
    h = response_rows(hidden, prompt_lengths, r)
    ids = response_tokens(tokens, prompt_lengths, r)
    return head_outputs(h, model.head_weight(), ids, temperature=temperature,
                        chunk_size=chunk_size).logprobs


# --------------------------------------------------------------------------- the loss
def distill_loss(logp_student: jax.Array, logp_student_old: jax.Array, logp_sparse: jax.Array,
                 logp_dense: jax.Array, advantages: jax.Array, mask: jax.Array,
                 num_tokens: jax.Array | float, config: LossConfig = LossConfig(),
                 lambda_kl: float = 0.001) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The student's loss: :func:`~sparrow_jax.rl.losses.grpo_loss` with ``logp_new =
    logp_student``, ``logp_old = logp_student_old`` (so the TIS weight is ``min(exp(
    logp_student_old - logp_sparse), C)``), plus ``lambda_kl`` times the masked sum of
    :func:`k3` over ``num_tokens``.

    All per-token arrays ``[B, R]``, advantages ``[B]``, mask ``[B, R]``; ``num_tokens`` the
    mini-batch's response-token count. Returns (loss, metrics: the GRPO loss's, prefixed
    ``distill_``, plus ``distill_pg_loss``, ``distill_k3``, ``distill_logp_gap`` (the student's
    mean ``|logp_student_old - logp_sparse|``, ~0: same weights, same rule)).
    """
    logp_student_old = jax.lax.stop_gradient(logp_student_old)
    pg, metrics = grpo_loss(logp_student, logp_student_old, logp_sparse, advantages, mask,
                            num_tokens, config)
    m = mask.astype(jnp.float32)
    denom = jnp.asarray(num_tokens, jnp.float32)
    kl = jnp.sum(k3(jax.lax.stop_gradient(logp_dense), logp_student) * m) / denom
    gap = jnp.sum(jnp.abs(logp_student_old - logp_sparse) * m) / denom
    out = {f"distill_{k}": v for k, v in metrics.items()}
    out.update(distill_pg_loss=pg, distill_k3=kl, distill_logp_gap=gap)
    return pg + lambda_kl * kl, out


# --------------------------------------------------------------------------- the update
def split_lora(model) -> tuple[Any, nnx.State, nnx.State]:
    """-> (graphdef, LoRA params, everything else); raises if the model has no adapter."""
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)
    if not jax.tree.leaves(lora):
        raise ValueError("DistillSparse needs a model with LoRA adapters (attach_lora)")
    return graphdef, lora, rest


_STATIC = ("response_capacity", "temperature", "rule", "loss_config", "lambda_kl",
           "chunk_size", "fused", "remat")


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=_STATIC,
                   compiler_options=DETERMINISTIC_SCATTER)     # bit-exact resume on a GPU
def _micro_grads(graphdef, lora, rest, tokens, prompt_lengths, budget_pages, mask, logp_old,
                 logp_sparse, logp_dense, advantages, num_tokens, *, response_capacity,
                 temperature, rule, loss_config, lambda_kl, chunk_size, fused, remat):
    """Gradient (LoRA leaves only) of one micro-batch's share of the mini-batch loss. With
    ``fused`` the adapter is the one at the start of the update, and ``logp_old`` is this
    forward's own stop-gradient log-probs (also returned)."""
    def loss_fn(model):
        lp = student_logprobs(model, tokens, prompt_lengths, budget_pages[:, :response_capacity],
                              temperature=temperature, rule=rule, chunk_size=chunk_size)
        old = jax.lax.stop_gradient(lp) if fused else logp_old
        loss, metrics = distill_loss(lp, old, logp_sparse, logp_dense, advantages, mask,
                                     num_tokens, loss_config, lambda_kl)
        return loss, (metrics, old)

    model = nnx.merge(graphdef, lora, rest)
    # Remat only on this merged copy; NNX's grad, so the model's nnx.remat sees its variables at
    # the trace level it expects (as in rl/update.py).
    model.remat = remat
    (loss, (metrics, old)), grads = nnx.value_and_grad(
        loss_fn, argnums=nnx.DiffState(0, LoRAParam), has_aux=True)(model)
    # Under a mesh (as in rl/update.py): gradients in the adapters' layout, what the host reads
    # replicated.
    return (sharding.constrain_params(grads),
            sharding.constrain_replicated(dict(metrics, distill_loss=loss)),
            sharding.constrain_replicated(old))


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("temperature", "rule",
                                                                  "chunk_size"))
def _student_jit(graphdef, state, tokens, prompt_lengths, budget_pages, *, temperature, rule,
                 chunk_size):
    return sharding.constrain_replicated(student_logprobs(
        nnx.merge(graphdef, state), tokens, prompt_lengths, budget_pages,
        temperature=temperature, rule=rule, chunk_size=chunk_size))


@jax.jit
def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


@functools.partial(jax.jit, static_argnums=(0,))
def _apply(optimizer, params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (sharding.constrain_params(optax.apply_updates(params, updates)), opt_state,
            sharding.constrain_replicated(optax.tree.norm(grads)))


def put_rows(mesh, x: np.ndarray) -> jax.Array:
    """A host micro-batch array on the device, or on ``mesh`` with its rows split over ``data``
    x ``fsdp`` (every process passes the whole micro-batch)."""
    return jnp.asarray(x) if mesh is None else jax.device_put(
        x, sharding.batch_sharding(mesh, x.shape))


def _micro_arrays(batch: DistillBatch, logp_old: np.ndarray) -> dict[str, np.ndarray]:
    r = batch.logp_sparse.shape[1]
    mask = np.arange(r)[None, :] < batch.response_lengths[:, None]
    return {"tokens": batch.tokens, "prompt_lengths": batch.prompt_lengths,
            "budget_pages": batch.budget_pages, "mask": mask, "logp_old": logp_old,
            "logp_sparse": batch.logp_sparse, "logp_dense": batch.logp_dense,
            "advantages": batch.advantages}


class DistillUpdater:
    """Holds the adapter's optimizer; :meth:`update` trains ``model``'s ``LoRAParam`` leaves in
    place (dense weights untouched), one rollout batch at a time. On a mesh (the model placed by
    :func:`sparrow_jax.sharding.shard_model`, adapters included) the passes run under it, as
    the GRPO update's do (:mod:`sparrow_jax.rl.update`)."""

    def __init__(self, config: DistillConfig, update_config: UpdateConfig,
                 policy_optim: OptimConfig, rule: SparseRule):
        self.config = config
        self.update_config = update_config
        self.rule = rule
        self.optimizer = make_optimizer(config.optim(policy_optim))

    def init(self, model) -> Any:
        """The AdamW state of ``model``'s adapter, laid out like the adapter on a mesh."""
        return sharding.init_opt_state(self.optimizer, split_lora(model)[1])

    def student_logprobs(self, model, batch: DistillBatch, rows: np.ndarray,
                         temperature: float) -> np.ndarray:
        """Host ``[S, R]`` student log-probs on ``rows`` (zero elsewhere and past each
        response), in length-bucketed micro-batches; no gradient."""
        cfg = self.update_config
        graphdef, state = nnx.split(model)
        mesh = sharding.mesh_of(state)
        out = np.zeros(batch.logp_sparse.shape, np.float32)
        total = batch.prompt_lengths + batch.response_lengths
        arrays = _micro_arrays(batch, out)
        for micro in plan_micro_batches(np.asarray(rows), total, cfg.micro_batch_size):
            t_len = round_up(total[micro].max(), cfg.length_multiple)
            r_len = round_up(batch.response_lengths[micro].max(), cfg.length_multiple)
            mb = gather_rows(micro, cfg.micro_batch_size, arrays, t_len, r_len)
            with sharding.use_mesh(mesh):
                lp = _student_jit(graphdef, state, *(put_rows(mesh, mb[k]) for k in (
                    "tokens", "prompt_lengths", "budget_pages")), temperature=float(temperature),
                    rule=self.rule, chunk_size=cfg.chunk_size)
            _fill(out, micro, np.asarray(lp), mb["mask"])
        return out

    def update(self, model, opt_state, batch: DistillBatch, plan: list[list[np.ndarray]],
               temperature: float, step: int) -> tuple[Any, dict[str, float]]:
        """The adapter's optimizer steps over ``plan`` (rows of each mini-batch of each epoch,
        as :meth:`sparrow_jax.rl.update.PolicyUpdater.plan`) -> (opt_state, metrics averaged
        over the steps). ``logp_old`` is the student at the start: the first mini-batch's own
        forward, one gradient-free pass for the other rows (none with one mini-batch and one
        epoch). Raises :class:`~sparrow_jax.rl.update.NonFiniteError` naming ``step`` before
        applying a non-finite update."""
        cfg = self.update_config
        first = np.asarray(plan[0][0])
        others = np.setdiff1d(np.concatenate([np.concatenate(e) for e in plan]), first)
        logp_old = (self.student_logprobs(model, batch, others, temperature) if len(others)
                    else np.zeros(batch.logp_sparse.shape, np.float32))
        arrays = _micro_arrays(batch, logp_old)
        graphdef, lora, rest = split_lora(model)
        mesh = sharding.mesh_of(lora)
        total = batch.prompt_lengths + batch.response_lengths
        history = []
        for epoch, mini_batches in enumerate(plan):
            for i, rows in enumerate(mini_batches):
                fused = epoch == 0 and i == 0
                num_tokens = int(batch.response_lengths[rows].sum())
                if num_tokens == 0:
                    raise ValueError("mini-batch holds no response token")
                grads, sums = None, {}
                for micro in plan_micro_batches(np.asarray(rows), total, cfg.micro_batch_size):
                    t_len = round_up(total[micro].max(), cfg.length_multiple)
                    r_len = round_up(batch.response_lengths[micro].max(), cfg.length_multiple)
                    mb = gather_rows(micro, cfg.micro_batch_size, arrays, t_len, r_len)
                    with sharding.use_mesh(mesh):
                        g, m, old = _micro_grads(
                            graphdef, lora, rest, *(put_rows(mesh, mb[k]) for k in (
                                "tokens", "prompt_lengths", "budget_pages", "mask", "logp_old",
                                "logp_sparse", "logp_dense", "advantages")),
                            jnp.float32(num_tokens), response_capacity=r_len,
                            temperature=float(temperature), rule=self.rule,
                            loss_config=cfg.loss, lambda_kl=float(self.config.lambda_kl),
                            chunk_size=cfg.chunk_size, fused=fused, remat=cfg.remat)
                    if fused:
                        _fill(logp_old, micro, np.asarray(old), mb["mask"])
                    grads = g if grads is None else _add(grads, g)
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + float(v)
                with sharding.use_mesh(mesh):
                    new_lora, new_state, norm = _apply(self.optimizer, lora, opt_state, grads)
                norm = float(norm)
                if not (math.isfinite(sums["distill_loss"]) and math.isfinite(norm)):
                    raise NonFiniteError(
                        f"non-finite distill loss or gradient at training step {step} (epoch "
                        f"{epoch}, mini-batch {i}): loss={sums['distill_loss']}, grad_norm="
                        f"{norm}; the LoRA update was not applied")
                lora, opt_state = new_lora, new_state
                history.append(dict(sums, distill_grad_norm=norm))
        nnx.update(model, lora)
        return opt_state, {k: float(np.mean([h[k] for h in history])) for k in history[0]}


def _fill(into: np.ndarray, rows: np.ndarray, out: np.ndarray, mask: np.ndarray) -> None:
    """Writes micro-batch rows ``out[:len(rows)]`` (masked to their responses) into ``into``."""
    keep = min(into.shape[1], out.shape[1])
    into[rows, :keep] = np.where(mask[:len(rows), :keep], out[:len(rows), :keep], 0.0)
