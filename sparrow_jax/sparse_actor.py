"""A model's sparse actor over given tokens: the teacher-forced sparse forward plus the LM head
(docs/design.md, sections 3 and 5).

Position i of ``tokens`` is computed as the decode step that consumed token i did: block top-k
selection over its causal prefix with ``lengths = i + 1`` and that step's page budget; positions
before ``prompt_lengths`` attend densely, as prefill does. So ``sparse_logits(...)[b, i]`` is the
sparse actor's distribution of token ``i + 1`` and, with the dense ``model(tokens)``, gives
``acceptance_rate(logits_dense, logits_sparse)`` per position::

    logits_sparse = sparse_logits(model, tokens, BudgetSchedule.paper("qwen3-1.7b"))
    alpha = acceptance_rate(model(tokens), logits_sparse)      # [B, T]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.attention.teacher_forced import TeacherForcedBudgets, make_teacher_forced_attend
from sparrow_jax.models.lm_head import head_outputs, scaled_logits

__all__ = ["sparse_logits", "sparse_logprobs", "budget_array"]


def budget_array(budget, batch: int, length: int, page_size: int = 16) -> np.ndarray:
    """The page budget (reserved pages included) of every position -> ``[batch, length]`` int32.

    budget: an int (the same budget everywhere), a
    :class:`~sparrow_jax.schedule.BudgetSchedule` (position i at ``lengths = i + 1``), or an
    int array ``[length]`` or ``[batch, length]``.
    """
    from sparrow_jax.schedule import BudgetSchedule

    if isinstance(budget, BudgetSchedule):
        if budget.page_size != page_size:
            raise ValueError(f"budget schedule counts pages of {budget.page_size} tokens, not "
                             f"page_size={page_size}")
        budget = np.asarray(budget.budget_pages(np.arange(1, length + 1)))
    out = np.asarray(budget)
    if not np.issubdtype(out.dtype, np.integer):
        raise ValueError(f"budget must be an int, a BudgetSchedule or an int array, got "
                         f"{out.dtype}")
    try:
        return np.broadcast_to(out, (batch, length)).astype(np.int32)
    except ValueError:
        raise ValueError(f"budget of shape {out.shape} does not broadcast to tokens' "
                         f"{(batch, length)}") from None


def _hidden(model, tokens, budget, prompt_lengths, page_size, scorer, dense_layers, chunk_size):
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    b, t = tokens.shape
    budgets = jnp.asarray(budget_array(budget, b, t, page_size))
    prompts = jnp.zeros((b,), jnp.int32) if prompt_lengths is None else jnp.broadcast_to(
        jnp.asarray(prompt_lengths, jnp.int32), (b,))
    graphdef, state = nnx.split(model)
    return _forward(graphdef, state, tokens, budgets, prompts, page_size=page_size,
                    scorer=scorer, dense_layers=tuple(int(x) for x in dense_layers),
                    chunk_size=chunk_size), model.head_weight()


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=(
    "page_size", "scorer", "dense_layers", "chunk_size"))
def _forward(graphdef, state, tokens, budgets, prompts, *, page_size, scorer, dense_layers,
             chunk_size):
    model = nnx.merge(graphdef, state)
    attend = make_teacher_forced_attend(page_size=page_size, scorer=scorer,
                                        dense_layers=dense_layers,
                                        chunk_size=min(chunk_size, tokens.shape[1]))
    hidden, _ = model.forward(tokens, attend=attend, state=TeacherForcedBudgets(budgets, prompts))
    return hidden


def sparse_logits(model, tokens, budget, *, prompt_lengths=None, page_size: int = 16,
                  scorer: str = "centroid", dense_layers=(0, 1), temperature: float = 1.0,
                  chunk_size: int = 128) -> jax.Array:
    """The sparse actor's ``logits / temperature`` ``[B, T, V]`` float32 over ``tokens [B, T]``.

    budget: see :func:`budget_array`. prompt_lengths ``[B]`` (or a scalar; default 0): positions
    before it attend densely. dense_layers attend densely everywhere, as in the rollout engine.
    Builds the whole ``[B, T, V]`` block: for long sequences use :func:`sparse_logprobs`.
    """
    hidden, w = _hidden(model, tokens, budget, prompt_lengths, page_size, scorer, dense_layers,
                        chunk_size)
    b, t, d = hidden.shape
    return scaled_logits(hidden.reshape(b * t, d), w, temperature).reshape(b, t, -1)


def sparse_logprobs(model, tokens, budget, *, prompt_lengths=None, page_size: int = 16,
                    scorer: str = "centroid", dense_layers=(0, 1), temperature: float = 1.0,
                    chunk_size: int = 128) -> jax.Array:
    """Per token, the sparse actor's log-prob given its prefix: ``[B, T]`` float32 with
    ``out[b, i] = log q(tokens[b, i] | tokens[b, :i])`` for ``i >= 1`` and 0 at ``i = 0``.

    Arguments as :func:`sparse_logits`; the LM head runs in chunks, never ``[B, T, V]``. On a
    rollout's tokens and recorded budgets this is what the decode loop recorded.
    """
    hidden, w = _hidden(model, tokens, budget, prompt_lengths, page_size, scorer, dense_layers,
                        chunk_size)
    tokens = jnp.asarray(tokens, jnp.int32)
    # Position i predicts token i + 1; the last position predicts nothing (its id is a dummy).
    nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    lp = head_outputs(hidden, w, nxt, temperature=temperature).logprobs
    return jnp.concatenate([jnp.zeros_like(lp[:, :1]), lp[:, :-1]], axis=1)
