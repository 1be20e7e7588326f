"""Teacher-forced sparse attention over whole sequences (docs/design.md, section 3).

Every position i attends through its own block top-k selection over its causal prefix, with
``lengths = i + 1`` and that position's budget, exactly as the decode step that consumed token i
did; prompt positions attend densely as prefill did.

Two implementations of one contract (``impl``):

* ``"xla"``: positions in query chunks; a chunk's ``[chunk, T]`` scores are the largest
  intermediate, so memory grows linearly in T, and each chunk is rematerialised in the backward
  pass so its scores are never stored. Runs anywhere, in any float dtype (float64 for gradient
  checks); it is the reference of the kernel.
* ``"pallas"``: the selection as above (as ``[chunk, M]`` page masks, packed to bits), then
  :mod:`pallas_kernels.teacher_forced_gpu`'s flash attention under that mask, forward and
  backward: no score tensor in memory, key blocks no query of a block selected are skipped.

``"auto"``: the kernel on GPU (head_dim a power of two >= 16), XLA elsewhere.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from sparrow_jax.attention import selection
from sparrow_jax.attention.dense import causal_attention


# Query chunks are grouped by how far back they can see (see _attention).
CAUSAL_GROUPS = 4
IMPLS = ("auto", "xla", "pallas")


def resolve_impl(impl: str, head_dim: int, platform: str | None = None) -> str:
    """The implementation ``impl`` runs on ``platform`` (default: jax's backend)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown teacher-forced attention impl {impl!r}; known: {IMPLS}")
    if impl != "auto":
        return impl
    fits = head_dim >= 16 and not head_dim & (head_dim - 1)
    return "pallas" if fits and (platform or jax.default_backend()) == "gpu" else "xla"


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
                                    chunk_size: int = 128, impl: str = "auto",
                                    tuning=None, interpret: bool | None = None) -> jax.Array:
    """q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]`` (after norms and RoPE), budget_pages ``[B, T]``,
    prompt_lengths ``[B]`` -> ``[B, T, Hq, D]`` in q's dtype.

    Equals the decode step run token by token on a paged cache holding these keys and values.
    Differentiable with respect to q, k and v (the selection itself is piecewise constant).
    Budgets below 3 at response positions raise when concrete; traced ones act as 3.
    ``chunk_size`` bounds memory: ``[chunk, T]`` scores (xla) or ``[chunk * page_size, M]``
    selection masks (pallas). ``tuning``: the kernel's
    :class:`~pallas_kernels.teacher_forced_gpu.TeacherForcedTuning` (None: its defaults);
    ``interpret``: run the kernels in Pallas' interpreter (None: off GPU, so an explicit
    ``impl="pallas"`` runs, slowly, in CPU tests).
    """
    _check(q, k, v, budget_pages, prompt_lengths, page_size, scorer, chunk_size)
    budget_pages = budget_pages.astype(jnp.int32)
    prompt_lengths = prompt_lengths.astype(jnp.int32)
    if resolve_impl(impl, q.shape[-1]) == "pallas":
        from pallas_kernels.teacher_forced_gpu import TeacherForcedTuning

        tuning = tuning or TeacherForcedTuning()
        tuning.check(page_size)
        if interpret is None:
            interpret = jax.default_backend() != "gpu"
        return _kernel_attention(q, k, v, budget_pages, prompt_lengths, page_size=page_size,
                                 scorer=scorer, chunk_size=chunk_size * page_size,
                                 tuning=tuning, interpret=interpret)
    return _attention(q, k, v, budget_pages, prompt_lengths,
                      page_size=page_size, scorer=scorer, chunk_size=min(chunk_size, q.shape[1]))


def make_teacher_forced_attend(*, page_size: int = 16, scorer: str = "centroid",
                               dense_layers: tuple[int, ...] = (0, 1), chunk_size: int = 128,
                               impl: str = "auto", tuning=None):
    """An :data:`~sparrow_jax.models.qwen3.AttendFn` for ``model.forward(tokens, attend=...,
    state=TeacherForcedBudgets(budget_pages, prompt_lengths))``: sparse teacher-forced attention
    (``impl``, ``tuning`` as in :func:`teacher_forced_sparse_attention`) in every layer but
    ``dense_layers``, which attend causally and densely. The state passes through unchanged."""
    dense_layers = tuple(int(x) for x in dense_layers)

    def attend(layer: int, q, k, v, state: TeacherForcedBudgets):
        if not isinstance(state, TeacherForcedBudgets):
            raise TypeError("teacher-forced attention needs state=TeacherForcedBudgets(budget_pages"
                            f", prompt_lengths), got {type(state).__name__}")
        if layer in dense_layers:
            return causal_attention(q, k, v), state
        out = teacher_forced_sparse_attention(q, k, v, state.budget_pages, state.prompt_lengths,
                                              page_size=page_size, scorer=scorer,
                                              chunk_size=chunk_size, impl=impl,
                                              tuning=tuning)
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


def selection_words(q, k, budget_pages, prompt_lengths, *, page_size, scorer, chunk_size,
                    tuning=None, interpret=False):
    """The page masks of every query, packed for the kernel: q ``[B, T, Hq, D]``, k ``[B, T,
    Hkv, D]`` with T a whole number of pages and of ``tuning.select_rows``, budget_pages ``[B,
    T]`` -> ``[B, Hkv, W, T]`` int32 (:func:`pallas_kernels.teacher_forced_gpu.page_words`).
    Scores in XLA (the reference's functions), ``chunk_size`` queries at a time; the block
    top-k by the selection kernel. Positions before ``prompt_lengths`` see their whole prefix."""
    from pallas_kernels.teacher_forced_gpu import (TeacherForcedTuning, page_words,
                                                   select_pages_kernel)

    tuning = tuning or TeacherForcedTuning()
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    m = t // page_size
    summaries = _page_summaries(k, page_size, scorer)
    chunk = min(-(-chunk_size // tuning.select_rows) * tuning.select_rows, t)
    num_chunks = -(-t // chunk)
    pad = num_chunks * chunk - t
    q_c = lax.stop_gradient(jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))))
    q_c = q_c.reshape(b, num_chunks, chunk, hkv, hq // hkv, d).transpose(1, 0, 3, 2, 4, 5)
    positions = jnp.arange(num_chunks * chunk, dtype=jnp.int32)
    budget = jnp.pad(budget_pages, ((0, 0), (0, pad)), constant_values=m)
    budget = jnp.where(positions[None, :] < prompt_lengths[:, None], m, budget)
    budget = budget.reshape(b, num_chunks, chunk).transpose(1, 0, 2)

    def chunk_words(args):
        qc, pos, bud = args                          # [B, Hkv, C, r, D], [C], [B, C]
        if scorer == "centroid":
            scores = selection.centroid_scores(qc, summaries[0][:, :, None])
        else:
            scores = selection.quest_scores(qc, summaries[0][:, :, None], summaries[1][:, :, None])
        chosen = select_pages_kernel(scores, selection.num_pages(pos + 1, page_size), bud,
                                     rows=tuning.select_rows, warps=tuning.select_warps,
                                     interpret=interpret)
        return page_words(chosen)

    words = lax.map(chunk_words, (q_c, positions.reshape(num_chunks, chunk), budget))
    words = words.transpose(1, 2, 3, 0, 4).reshape(b, hkv, words.shape[3], num_chunks * chunk)
    return words[..., :t]


def _kernel_attention(q, k, v, budget_pages, prompt_lengths, *, page_size, scorer, chunk_size,
                      tuning, interpret):
    from pallas_kernels.teacher_forced_gpu import page_masked_attention

    t = q.shape[1]
    pad = -t % tuning.multiple
    # Padded queries see their whole prefix (their budget is every page); their outputs are cut
    # off, and no real query sees the padded keys after it.
    q_p, k_p, v_p = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    budget = jnp.pad(budget_pages, ((0, 0), (0, pad)), constant_values=(t + pad) // page_size)
    words = selection_words(q_p, k_p, budget, prompt_lengths, page_size=page_size,
                            scorer=scorer, chunk_size=chunk_size, tuning=tuning,
                            interpret=interpret)
    # Not jitted apart, so the model's remat policy sees the name and keeps the words.
    words = checkpoint_name(words, selection.SAVED_NAME)
    out = page_masked_attention(q_p, k_p, v_p, words, page_size, tuning, interpret)
    return out[:, :t]


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
