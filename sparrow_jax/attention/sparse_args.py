"""Argument checks of one sparse decode step (docs/design.md, sections 2-3), shared by every
implementation.

:func:`sparrow_jax.attention.sparse.sparse_decode` (the reference and the dispatch) and
:func:`pallas_kernels.sparse_decode_gpu.sparse_decode_pallas` (the kernels called directly) both
check their arguments here, so that they accept and reject the same inputs with the same words.
Shapes and dtypes are always checked; values only where they are known now (not under jit).
Under jit, where values cannot be checked, every implementation clips budgets to
``[3, max_budget_pages]`` and returns zeros for a row of length 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention import selection
from sparrow_jax.attention.selection import MIN_BUDGET_PAGES


def concrete(x) -> np.ndarray | None:
    """x as a NumPy array when its value is known now (not a tracer), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_summary(name: str, x, k_pages) -> None:
    """A page summary (centroids, Quest's kmin or kmax) must be ``[kv_heads, pages_total,
    head_dim]`` of ``k_pages [kv_heads, pages_total, P, head_dim]``."""
    want = k_pages.shape[:2] + k_pages.shape[3:]
    if x.shape != want:
        raise ValueError(f"{name} must be [kv_heads, pages_total, head_dim] = {want}, got "
                         f"{x.shape}")


def as_summaries(summaries) -> tuple:
    """Page summaries as the kernels take them: centroids (an array, or a 1-tuple) or Quest's
    pair (kmin, kmax), as a tuple whose length names the scorer."""
    return (summaries,) if isinstance(summaries, jax.Array) else tuple(summaries)


def checked_summaries(k_pages, scorer: str, centroids, summaries) -> tuple:
    """The page summaries a scorer reads, checked against ``k_pages [Hkv, N, P, D]``:
    ``(centroids,)`` for ``"centroid"``, ``(kmin, kmax)`` for ``"quest"``, each ``[Hkv, N, D]``,
    computed from the pages when not given."""
    if scorer == "centroid":
        if summaries is not None:
            raise ValueError("scorer='centroid' takes centroids=, not summaries=")
        if centroids is None:
            return (selection.page_centroids(k_pages),)
        check_summary("centroids", centroids, k_pages)
        return (centroids,)
    if scorer != "quest":
        raise ValueError(f"unknown scorer {scorer!r}; expected one of {selection.SCORERS}")
    if centroids is not None:
        raise ValueError("scorer='quest' takes summaries=(kmin, kmax), not centroids=")
    if summaries is None:
        return selection.page_minmax(k_pages)
    if len(summaries) != 2:
        raise ValueError("summaries must be a pair (kmin, kmax), each [kv_heads, pages_total, "
                         "head_dim]")
    for name, s in zip(("kmin", "kmax"), summaries):
        check_summary(f"summaries' {name}", s, k_pages)
    return tuple(summaries)


def check_sparse_decode_args(q, k_pages, v_pages, page_table, lengths, budget_pages, *,
                             page_size: int, max_budget_pages: int | None) -> None:
    """Raise ValueError, naming the argument, unless the arguments make one decode step:
    q ``[B, Hq, D]``, k/v_pages ``[Hkv, N, P, D]`` with Hq a multiple of Hkv, integer
    page_table ``[B, M]``, lengths ``[B]`` and budget_pages ``[B]``; ``max_budget_pages`` (the
    static list width) in ``[3, M]``. Where known now: lengths in ``[1, M * P]``, budgets >= 3,
    no row needing more than ``max_budget_pages`` pages, and each row's pages in use
    (``ceil(length / P)`` table entries) inside the pool ``[0, N)``."""
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {q.shape}")
    b, hq, d = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError("k_pages and v_pages must both be [kv_heads, pages_total, page_size, "
                         f"head_dim], got {k_pages.shape} and {v_pages.shape}")
    hkv, n_total, p, dk = k_pages.shape
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
    for name, x in (("page_table", page_table), ("lengths", lengths),
                    ("budget_pages", budget_pages)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {x.dtype}")
    m = page_table.shape[1]
    if max_budget_pages is not None and not MIN_BUDGET_PAGES <= max_budget_pages <= m:
        raise ValueError(f"max_budget_pages must be in [{MIN_BUDGET_PAGES}, page_table width "
                         f"{m}], got {max_budget_pages}")
    lens, budgets = concrete(lengths), concrete(budget_pages)
    if budgets is not None and (budgets < MIN_BUDGET_PAGES).any():
        raise ValueError(f"budget_pages must be >= {MIN_BUDGET_PAGES} (page 0 and the last two "
                         f"pages are always kept), got {budgets.tolist()}")
    if lens is None:
        return
    if (lens < 1).any() or (lens > m * page_size).any():
        raise ValueError(f"lengths must be in [1, page_table width x page_size = "
                         f"{m * page_size}], got {lens.tolist()}")
    n = -(-lens.astype(np.int64) // page_size)
    if budgets is not None and max_budget_pages is not None:
        over = np.minimum(budgets, n) > max_budget_pages
        if over.any():
            raise ValueError(
                f"sequences {np.flatnonzero(over).tolist()} need more than max_budget_pages="
                f"{max_budget_pages} pages (budget_pages={budgets.tolist()}, pages in use="
                f"{n.tolist()})")
    tab = concrete(page_table)
    if tab is not None:
        in_use = np.arange(m)[None, :] < n[:, None]
        bad = in_use & ((tab < 0) | (tab >= n_total))
        if bad.any():
            rows = np.flatnonzero(bad.any(axis=1)).tolist()
            raise ValueError(f"page_table entries in use (the first ceil(length / page_size) of "
                             f"each row) must be in [0, pages_total={n_total}); rows {rows} are "
                             "not")
