"""The DistillSparse gain, measured on a step's own rollout (docs/design.md, sections 5 and 8).

The sparse actor is replayed over the rollout (teacher-forced sparse forward at the recorded
budgets, the rollout's selection rule, :mod:`sparrow_jax.rl.distill`) with its LoRA on or off,
and its top-k log-probs at each response slot compared with the dense recompute's by the
``paper`` acceptance-rate estimator. With the LoRA on this reproduces the rollout's own alpha;
with it off it is the alpha the same dense weights would reach without the adapter.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from sparrow_jax import sharding
from sparrow_jax.models.lm_head import head_outputs
from sparrow_jax.rl.config import UpdateConfig
from sparrow_jax.rl.distill import SparseRule, actor_hidden, put_rows
from sparrow_jax.rl.recompute import (DenseStats, HostRollout, gather_rows, plan_micro_batches,
                                      response_rows, round_up)
from sparrow_jax.rollout.types import Rollout


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=(
    "response_capacity", "temperature", "rule", "top_k", "chunk_size", "lora"))
def _actor_topk(graphdef, state, tokens, prompt_lengths, budget_pages, *, response_capacity,
                temperature, rule, top_k, chunk_size, lora):
    model = nnx.merge(graphdef, state)
    hidden = actor_hidden(model, tokens, prompt_lengths, budget_pages, rule, lora=lora)
    out = head_outputs(response_rows(hidden, prompt_lengths, response_capacity),
                       model.head_weight(), temperature=temperature, top_k=top_k,
                       chunk_size=chunk_size)
    # Read whole on the host by every process.
    return sharding.constrain_replicated((out.topk_ids, out.topk_logprobs))


def actor_topk(model, rollout: Rollout, temperature: float, rule: SparseRule,
               config: UpdateConfig, *, lora: bool) -> tuple[np.ndarray, np.ndarray]:
    """The sparse actor's top-k (k: the rollout's) over ``rollout``'s response slots -> host
    (ids ``[S, R, k]`` int32, log-probs ``[S, R, k]``), zero past each response; in
    length-bucketed micro-batches of ``config``, no gradient."""
    host = HostRollout.of(rollout)
    budget_pages = np.asarray(rollout.budget_pages)
    s, r, k = host.topk_ids.shape
    ids, lps = np.zeros((s, r, k), np.int32), np.zeros((s, r, k), np.float32)
    total = host.total_lengths
    graphdef, state = nnx.split(model)
    mesh = sharding.mesh_of(state)
    arrays = {"tokens": host.tokens, "prompt_lengths": host.prompt_lengths,
              "budget_pages": budget_pages}
    for micro in plan_micro_batches(np.arange(s), total, config.micro_batch_size):
        t_len = round_up(total[micro].max(), config.length_multiple)
        r_len = round_up(host.response_lengths[micro].max(), config.length_multiple)
        mb = gather_rows(micro, config.micro_batch_size, arrays, t_len, r_len)
        with sharding.use_mesh(mesh):
            i, lp = _actor_topk(graphdef, state, *(put_rows(mesh, mb[name]) for name in arrays),
                                response_capacity=r_len, temperature=float(temperature),
                                rule=rule, top_k=k, chunk_size=config.chunk_size, lora=lora)
        keep = min(r, r_len)
        valid = (np.arange(keep)[None, :] < host.response_lengths[micro][:, None])[..., None]
        ids[micro, :keep] = np.where(valid, np.asarray(i)[:len(micro), :keep], 0)
        lps[micro, :keep] = np.where(valid, np.asarray(lp)[:len(micro), :keep], 0.0)
    return ids, lps


def alpha_tokens_without_lora(model, rollout: Rollout, dense: DenseStats, temperature: float,
                              rule: SparseRule, config: UpdateConfig) -> np.ndarray:
    """The ``paper`` acceptance rate ``[S, R]`` of the sparse actor without its LoRA
    (``model``'s dense weights: those of ``dense``) against the dense recompute, per response
    slot (meaningless past each response)."""
    from sparrow_jax.mismatch import acceptance_rate_paper

    ids, lps = actor_topk(model, rollout, temperature, rule, config, lora=False)
    return np.asarray(acceptance_rate_paper(dense.topk_ids, dense.topk_logprobs, ids, lps))


def alpha_without_lora(model, rollout: Rollout, dense: DenseStats, temperature: float,
                       rule: SparseRule, config: UpdateConfig) -> dict[str, float]:
    """``alpha_paper_mean_nolora`` and ``alpha_paper_p5_nolora``: the ``paper`` acceptance rate
    of the sparse actor without its LoRA (``model``'s dense weights: those of the rollout and of
    ``dense``) over all response tokens, to set beside the rollout's ``alpha_paper_*``."""
    alpha = alpha_tokens_without_lora(model, rollout, dense, temperature, rule, config)
    a = alpha[np.asarray(rollout.response_mask)]
    return {"alpha_paper_mean_nolora": float(a.mean()),
            "alpha_paper_p5_nolora": float(np.percentile(a, 5))}
