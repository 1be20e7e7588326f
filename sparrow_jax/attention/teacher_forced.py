"""Teacher-forced sparse attention over whole sequences (docs/design.md, section 3).

Every position i attends through its own block top-k selection over its causal prefix, with
``lengths = i + 1`` and that position's budget, exactly as the decode step that consumed token i
did; prompt positions attend densely as prefill did. Positions are computed in parallel, in query
chunks: a chunk's ``[chunk, T]`` scores are the largest intermediate, so memory grows linearly in
T, and each chunk is rematerialised in the backward pass so its scores are never stored.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sparrow_jax.attention import selection
from sparrow_jax.attention.dense import causal_attention


# Query chunks are grouped by how far back they can see (see _attention).
CAUSAL_GROUPS = 4


class TeacherForcedBudgets(NamedTuple):
    """The attention ``state`` of :func:`make_teacher_forced_attend`.

    budget_pages: ``[B, T]`` int32, the budget (pages, reserved included) of the query at each
      position, i.e. of the decode step that attended with ``lengths = i + 1``; read only where
      ``i >= prompt_lengths[b]``.
    prompt_lengths: ``[B]`` int32, positions ``< prompt_lengths[b]`` attend densely.
    """

    budget_pages: jax.Array
    prompt_lengths: jax.Array


def teacher_forced_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                                    budget_pages: jax.Array, prompt_lengths: jax.Array, *,
                                    page_size: int = 16, scorer: str = "centroid",
                                    chunk_size: int = 128) -> jax.Array:
    """q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]`` (after norms and RoPE), budget_pages ``[B, T]``,
    prompt_lengths ``[B]`` -> ``[B, T, Hq, D]`` in q's dtype.

    Equals the decode step run token by token on a paged cache holding these keys and values.
    Differentiable with respect to q, k and v (the selection itself is piecewise constant).
    Budgets below 3 at response positions raise when concrete; traced ones act as 3.
    """
    _check(q, k, v, budget_pages, prompt_lengths, page_size, scorer, chunk_size)
    return _attention(q, k, v, budget_pages.astype(jnp.int32), prompt_lengths.astype(jnp.int32),
                      page_size=page_size, scorer=scorer, chunk_size=min(chunk_size, q.shape[1]))


def make_teacher_forced_attend(*, page_size: int = 16, scorer: str = "centroid",
                               dense_layers: tuple[int, ...] = (0, 1), chunk_size: int = 128):
    """An :data:`~sparrow_jax.models.qwen3.AttendFn` for ``model.forward(tokens, attend=...,
    state=TeacherForcedBudgets(budget_pages, prompt_lengths))``: sparse teacher-forced attention
    in every layer but ``dense_layers``, which attend causally and densely. The state passes
    through unchanged."""
    dense_layers = tuple(int(x) for x in dense_layers)

    def attend(layer: int, q, k, v, state: TeacherForcedBudgets):
        if not isinstance(state, TeacherForcedBudgets):
            raise TypeError("teacher-forced attention needs state=TeacherForcedBudgets(budget_pages"
                            f", prompt_lengths), got {type(state).__name__}")
        if layer in dense_layers:
            return causal_attention(q, k, v), state
        out = teacher_forced_sparse_attention(q, k, v, state.budget_pages, state.prompt_lengths,
                                              page_size=page_size, scorer=scorer,
                                              chunk_size=chunk_size)
        return out, state

    return attend


def _check(q, k, v, budget_pages, prompt_lengths, page_size, scorer, chunk_size):
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"q must be [B, T, Hq, D] and k, v [B, T, Hkv, D]; got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    b, t, hq, d = q.shape
    if k.shape[:2] != (b, t) or k.shape[3] != d or hq % k.shape[2]:
        raise ValueError(f"k/v {k.shape} do not match q {q.shape} (same B, T, D; Hq a multiple "
                         "of Hkv)")
    if budget_pages.shape != (b, t):
        raise ValueError(f"budget_pages must be [B, T] = {(b, t)}, got {budget_pages.shape}")
    if prompt_lengths.shape != (b,):
        raise ValueError(f"prompt_lengths must be [B] = {(b,)}, got {prompt_lengths.shape}")
    if scorer not in selection.SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; expected one of {selection.SCORERS}")
    if page_size < 1 or chunk_size < 1:
        raise ValueError(f"page_size and chunk_size must be positive, got {page_size}, "
                         f"{chunk_size}")
    try:
        budgets, prompts = np.asarray(budget_pages), np.asarray(prompt_lengths)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    response = np.arange(t)[None, :] >= prompts[:, None]
    low = response & (budgets < selection.MIN_BUDGET_PAGES)
    if low.any():
        b_, i_ = np.argwhere(low)[0]
        raise ValueError(
            f"budget_pages must be >= {selection.MIN_BUDGET_PAGES} at response positions (fill "
            f"padding with any budget >= 3); e.g. sequence {b_} position {i_} has "
            f"{budgets[b_, i_]}")


def _page_summaries(k, page_size, scorer):
    """k ``[B, T, Hkv, D]`` -> tuple of ``[B, Hkv, M, D]``; the last page zero padded (it is
    never scored: a page is scored only by queries after it is full)."""
    b, t, hkv, d = k.shape
    m = -(-t // page_size)
    k = jnp.pad(k, ((0, 0), (0, m * page_size - t), (0, 0), (0, 0)))
    pages = k.reshape(b, m, page_size, hkv, d).transpose(0, 3, 1, 2, 4)
    pages = lax.stop_gradient(pages)
    if scorer == "centroid":
        return (selection.page_centroids(pages),)
    return selection.page_minmax(pages)


@functools.partial(jax.jit, static_argnames=("page_size", "scorer", "chunk_size"))
def _attention(q, k, v, budget_pages, prompt_lengths, *, page_size, scorer, chunk_size):
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    r = hq // hkv
    m = -(-t // page_size)
    summaries = _page_summaries(k, page_size, scorer)
    num_chunks = -(-t // chunk_size)
    pad = num_chunks * chunk_size - t
    # Padded query positions get a dense budget; their outputs are cut off below.
    q_c = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q_c = q_c.reshape(b, num_chunks, chunk_size, hkv, r, d).transpose(1, 0, 3, 2, 4, 5)
    positions = jnp.arange(num_chunks * chunk_size, dtype=jnp.int32)
    dense = positions[None, :] < prompt_lengths[:, None]
    budget = jnp.pad(budget_pages, ((0, 0), (0, pad)), constant_values=m)
    budget = jnp.where(dense, m, budget)
    budget = budget.reshape(b, num_chunks, chunk_size).transpose(1, 0, 2)
    positions = positions.reshape(num_chunks, chunk_size)
    k_h = k.transpose(0, 2, 1, 3)                                   # [B, Hkv, T, D]
    v_h = v.transpose(0, 2, 1, 3)
    token_page = jnp.arange(t, dtype=jnp.int32) // page_size
    acc = jnp.promote_types(q.dtype, jnp.float32)  # float32, or float64 when checking gradients
    # Products of bfloat16 values are exact in a float32 accumulator, so HIGHEST (full float32
    # passes) buys nothing there but time; probabilities meet v in v's dtype, as the GPU decode
    # kernel computes them (a float32 p @ v cannot use bfloat16 tensor cores).
    low = jnp.dtype(jnp.promote_types(q.dtype, k.dtype)).itemsize < 4
    precision = lax.Precision.DEFAULT if low else lax.Precision.HIGHEST

    def chunk_fn(keys: int):
        """A chunk's attention over the first ``keys`` keys (all its queries can see)."""
        k_g, v_g = k_h[:, :, :keys], v_h[:, :, :keys]

        @jax.checkpoint
        def chunk(args):
            qc, pos, bud = args          # [B, Hkv, C, r, D], [C], [B, C]
            if scorer == "centroid":
                scores = selection.centroid_scores(qc, summaries[0][:, :, None])
            else:
                scores = selection.quest_scores(qc, summaries[0][:, :, None],
                                                summaries[1][:, :, None])
            n = selection.num_pages(pos + 1, page_size)                   # [C]
            pages = selection.select_pages(scores, n[None, None, :], bud[:, None, :])  # [B,Hkv,C,M]
            visible = jnp.take(pages, token_page[:keys], axis=-1)         # [B, Hkv, C, keys]
            visible &= jnp.arange(keys)[None, :] <= pos[:, None]            # causal
            logits = jnp.einsum("bhcrd,bhtd->bhcrt", qc, k_g, precision=precision,
                                preferred_element_type=acc) * (d ** -0.5)
            logits = jnp.where(visible[:, :, :, None, :], logits, -jnp.inf)
            probs = jax.nn.softmax(logits, axis=-1)
            return jnp.einsum("bhcrt,bhtd->bhcrd", probs.astype(v_g.dtype if low else acc),
                              v_g.astype(v_g.dtype if low else acc), precision=precision,
                              preferred_element_type=acc)

        return chunk

    # Chunks in causal groups, each over the keys its last chunk can see: with 4 groups the
    # score tensors cover 5/8 of the [T, T] square instead of all of it (one compiled body a
    # group, so few groups).
    bounds = np.linspace(0, num_chunks, min(CAUSAL_GROUPS, num_chunks) + 1).round().astype(int)
    out = jnp.concatenate([
        lax.map(chunk_fn(min(t, int(hi) * chunk_size)),
                (q_c[lo:hi], positions[lo:hi], budget[lo:hi]))
        for lo, hi in zip(bounds[:-1], bounds[1:])])                 # [nc, B, Hkv, C, r, D]
    out = out.transpose(1, 0, 3, 2, 4, 5).reshape(b, num_chunks * chunk_size, hq, d)
    return out[:, :t].astype(q.dtype)
