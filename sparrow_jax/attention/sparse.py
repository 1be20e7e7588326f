"""Sparse decode attention for one layer over a paged KV cache (DESIGN 3.1, 3.2 and 4).

The reference implementation here defines the semantics; a Pallas kernel (``impl="pallas"``) must
match it. It is jittable with budgets and lengths as runtime arrays: the number of pages it
gathers per sequence and KV head is static (``max_budget_pages``, by default the page-table width).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sparrow_jax.attention import selection

IMPLS = ("auto", "reference", "pallas")


def _concrete(x) -> np.ndarray | None:
    """x as a NumPy array when its value is known now (not a tracer), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_args(q, k_pages, v_pages, page_table, lengths, budget_pages, page_size, scorer,
                max_budget_pages):
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {q.shape}")
    b, hq, d = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError("k_pages and v_pages must both be [kv_heads, pages_total, page_size, "
                         f"head_dim], got {k_pages.shape} and {v_pages.shape}")
    hkv, _, p, dk = k_pages.shape
    if p != page_size:
        raise ValueError(f"k_pages hold pages of {p} tokens but page_size={page_size}")
    if dk != d:
        raise ValueError(f"q head_dim {d} != k_pages head_dim {dk}")
    if hq % hkv:
        raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hkv})")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be [batch={b}, max_pages], got {page_table.shape}")
    for name, x in (("lengths", lengths), ("budget_pages", budget_pages)):
        if x.shape != (b,):
            raise ValueError(f"{name} must be [batch={b}], got shape {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {x.dtype}")
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page_table must be integer, got {page_table.dtype}")
    if scorer not in selection.SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; expected one of {selection.SCORERS}")
    m = page_table.shape[1]
    if max_budget_pages is not None and not (
            selection.MIN_BUDGET_PAGES <= max_budget_pages <= m):
        raise ValueError(f"max_budget_pages must be in [{selection.MIN_BUDGET_PAGES}, "
                         f"page_table width {m}], got {max_budget_pages}")
    budgets = _concrete(budget_pages)
    if budgets is not None:
        if (budgets < selection.MIN_BUDGET_PAGES).any():
            raise ValueError(f"budget_pages must be >= {selection.MIN_BUDGET_PAGES} (page 0 and "
                             f"the last two pages are always kept), got {budgets.tolist()}")
    lens = _concrete(lengths)
    if lens is not None:
        if (lens < 1).any() or (lens > m * page_size).any():
            raise ValueError(f"lengths must be in [1, page_table width x page_size = "
                             f"{m * page_size}], got {lens.tolist()}")
        if budgets is not None and max_budget_pages is not None:
            n = -(-lens // page_size)
            over = (np.minimum(budgets, n) > max_budget_pages)
            if over.any():
                raise ValueError(
                    f"sequences {np.flatnonzero(over).tolist()} need more than max_budget_pages="
                    f"{max_budget_pages} pages (budget_pages={budgets.tolist()}, pages in use="
                    f"{n.tolist()})")


def _summaries(k_pages, scorer, centroids, summaries):
    if scorer == "centroid":
        if summaries is not None:
            raise ValueError("scorer='centroid' takes centroids=, not summaries=")
        if centroids is None:
            return (selection.page_centroids(k_pages),)
        if centroids.shape != k_pages.shape[:2] + k_pages.shape[3:]:
            raise ValueError(f"centroids must be [kv_heads, pages_total, head_dim] = "
                             f"{k_pages.shape[:2] + k_pages.shape[3:]}, got {centroids.shape}")
        return (centroids,)
    if centroids is not None:
        raise ValueError("scorer='quest' takes summaries=(kmin, kmax), not centroids=")
    if summaries is None:
        return selection.page_minmax(k_pages)
    if len(summaries) != 2 or any(s.shape != k_pages.shape[:2] + k_pages.shape[3:]
                                  for s in summaries):
        raise ValueError("summaries must be a pair (kmin, kmax), each [kv_heads, pages_total, "
                         "head_dim]")
    return tuple(summaries)


def sparse_decode(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                  lengths: jax.Array, budget_pages: jax.Array, *, page_size: int = 16,
                  scorer: str = "centroid", impl: str = "auto",
                  centroids: jax.Array | None = None,
                  summaries: tuple[jax.Array, jax.Array] | None = None,
                  max_budget_pages: int | None = None) -> jax.Array:
    """One decode step of block top-k sparse attention, for one layer.

    Args:
      q: ``[B, Hq, D]`` queries of the current tokens, after q-norm and RoPE.
      k_pages, v_pages: ``[Hkv, N, P, D]`` the paged cache of this layer (keys after k-norm and
        RoPE), the current token already written.
      page_table: ``[B, M]`` int32, physical page of each sequence's j-th page.
      lengths: ``[B]`` int32 tokens in the cache, the current token included.
      budget_pages: ``[B]`` int32 pages each sequence may attend to, the 3 reserved ones included
        (>= 3). A sequence with ``ceil(length / P) <= budget`` attends densely.
      page_size: P.
      scorer: ``"centroid"`` (qbar . page mean of keys) or ``"quest"`` (elementwise min/max bound).
      impl: ``"reference"`` (pure JAX), ``"pallas"`` (the GPU kernel), ``"auto"`` (the best
        available; the reference for now).
      centroids: ``[Hkv, N, D]`` page centroids for ``scorer="centroid"``, computed from the pages
        when None. Only full pages' centroids are read.
      summaries: ``(kmin, kmax)``, each ``[Hkv, N, D]``, for ``scorer="quest"``; computed when None.
      max_budget_pages: static number of pages gathered per (sequence, KV head); default M.
        Concrete budgets needing more raise; inside jit they are clipped to it, budgets below 3
        act as 3 and a row of length 0 returns zeros (traced values cannot be checked).

    Returns:
      ``[B, Hq, D]`` in q's dtype. Scores and softmax in float32, scale ``D**-0.5``; the query
      heads ``h*r .. h*r+r-1`` of KV head h share its pages.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    _check_args(q, k_pages, v_pages, page_table, lengths, budget_pages, page_size, scorer,
                max_budget_pages)
    if impl == "pallas":
        raise NotImplementedError(
            "sparse_decode(impl='pallas'): the Pallas kernel is not wired in yet; use "
            "impl='reference' or impl='auto'")
    summ = _summaries(k_pages, scorer, centroids, summaries)
    return _reference(q, k_pages, v_pages, page_table, lengths, budget_pages, summ,
                      page_size=page_size, scorer=scorer,
                      max_pages=max_budget_pages or page_table.shape[1])


@functools.partial(jax.jit, static_argnames=("page_size", "scorer", "max_pages"))
def _reference(q, k_pages, v_pages, page_table, lengths, budget_pages, summ, *, page_size,
               scorer, max_pages):
    b, hq, d = q.shape
    hkv = k_pages.shape[0]
    m = page_table.shape[1]
    r = hq // hkv
    page_table = page_table.astype(jnp.int32)
    lengths = lengths.astype(jnp.int32)
    q_group = q.reshape(b, hkv, r, d)
    # Summaries of each sequence's pages, in page-table order: [B, Hkv, M, D].
    per_seq = [jnp.moveaxis(s[:, page_table], 0, 1) for s in summ]
    if scorer == "centroid":
        scores = selection.centroid_scores(q_group, per_seq[0])
    else:
        scores = selection.quest_scores(q_group, *per_seq)
    n = selection.num_pages(lengths, page_size)
    budget = jnp.minimum(budget_pages.astype(jnp.int32), max_pages)
    mask = selection.select_pages(scores, n[:, None], budget[:, None])      # [B, Hkv, M]
    # Compact the chosen slots to the front (in page order) and gather max_pages of them.
    slot = lax.broadcasted_iota(jnp.int32, mask.shape, 2)
    key = jnp.where(mask, slot, m + slot)
    _, order = lax.top_k(-key, max_pages)                                     # [B, Hkv, S]
    valid = jnp.take_along_axis(mask, order, axis=-1)
    phys = jnp.take_along_axis(jnp.broadcast_to(page_table[:, None, :], mask.shape), order, -1)
    heads = jnp.arange(hkv)[None, :, None]
    k_sel = k_pages[heads, phys]                                               # [B, Hkv, S, P, D]
    v_sel = v_pages[heads, phys]
    pos = order[..., None] * page_size + jnp.arange(page_size)                 # [B, Hkv, S, P]
    tok_ok = valid[..., None] & (pos < lengths[:, None, None, None])
    k_sel = k_sel.reshape(b, hkv, max_pages * page_size, d)
    v_sel = v_sel.reshape(b, hkv, max_pages * page_size, d)
    tok_ok = tok_ok.reshape(b, hkv, 1, max_pages * page_size)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    hi = lax.Precision.HIGHEST  # the reference: no TF32 for float32 inputs on GPU
    logits = jnp.einsum("bhrd,bhtd->bhrt", q_group, k_sel, precision=hi,
                        preferred_element_type=acc) * (d ** -0.5)
    logits = jnp.where(tok_ok, logits, -jnp.inf)
    # A row with nothing visible (length 0, possible only in padding rows inside jit) gets zeros
    # rather than NaN, so that it cannot poison a batch.
    probs = jnp.where(tok_ok, jax.nn.softmax(logits, axis=-1), 0.0)
    out = jnp.einsum("bhrt,bhtd->bhrd", probs, v_sel.astype(acc), precision=hi)
    return out.reshape(b, hq, d).astype(q.dtype)
