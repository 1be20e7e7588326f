"""Page summaries, page scores and Sparrow's block top-k page selection (docs/design.md,
sections 2-3).

Everything here is shape-polymorphic over leading axes, so the decode step (one query per
sequence) and teacher-forced attention (one query per position) share one definition of which
pages a query sees. Scores are float32 and never carry gradients: selection is discrete.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

RESERVED_FIRST = 1  # the sink page
RESERVED_LAST = 2   # the last full page and the partial current page
MIN_BUDGET_PAGES = RESERVED_FIRST + RESERVED_LAST
SCORERS = ("centroid", "quest")
# Selections marked with this name (jax.ad_checkpoint.checkpoint_name) are kept by the model's
# remat instead of recomputed in the backward pass: they are discrete, small (bits per page) and,
# at 32K context, as costly to compute as the attention itself.
SAVED_NAME = "page_selection"


def page_centroids(k_pages: jax.Array) -> jax.Array:
    """k_pages ``[..., N, P, D]`` -> centroids ``[..., N, D]`` in k_pages' dtype.

    Accumulated in float32 and stored in the cache dtype, as the paged cache does, so that scores
    from computed and from cached centroids agree bit for bit.
    """
    return jnp.mean(k_pages.astype(jnp.float32), axis=-2).astype(k_pages.dtype)


def page_minmax(k_pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k_pages ``[..., N, P, D]`` -> Quest's (kmin, kmax), each ``[..., N, D]``."""
    return jnp.min(k_pages, axis=-2), jnp.max(k_pages, axis=-2)


def centroid_scores(q_group: jax.Array, centroids: jax.Array) -> jax.Array:
    """q_group ``[..., r, D]`` (the r query heads of one KV head), centroids ``[..., M, D]`` ->
    float32 scores ``[..., M]`` = qbar . centroid with qbar the mean of the group's heads."""
    qbar = jnp.mean(q_group.astype(jnp.float32), axis=-2)
    return jnp.einsum("...d,...md->...m", qbar, centroids.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)


def quest_scores(q_group: jax.Array, kmin: jax.Array, kmax: jax.Array) -> jax.Array:
    """q_group ``[..., r, D]``, kmin/kmax ``[..., M, D]`` -> float32 scores ``[..., M]``:
    ``sum_d max(q_d kmax_d, q_d kmin_d)`` per query head (an upper bound of q . k over the page),
    then the max over the group's heads."""
    # Since kmax >= kmin, max(q kmax, q kmin) is q kmax where q > 0 and q kmin where q < 0: two
    # matmuls instead of an [r, M, D] intermediate.
    q = q_group.astype(jnp.float32)
    hi = lax.Precision.HIGHEST
    per_head = (jnp.einsum("...rd,...md->...rm", jnp.maximum(q, 0.0), kmax.astype(jnp.float32),
                           precision=hi)
                + jnp.einsum("...rd,...md->...rm", jnp.minimum(q, 0.0),
                             kmin.astype(jnp.float32), precision=hi))
    return jnp.max(per_head, axis=-2)


def _no_negative_zero(x: jax.Array) -> jax.Array:
    # A compare, not "x + 0.0": XLA folds that to x, keeping -0.0 (seen on CPU under jit).
    return jnp.where(x == jnp.float32(0.0), jnp.float32(0.0), x)


def order_key(score: jax.Array) -> jax.Array:
    """float32 scores -> int32 keys whose signed order is the scores' order, -0.0 and 0.0 alike:
    what the kernels' bitwise threshold searches compare (inside kernels too: typed constants)."""
    bits = lax.bitcast_convert_type(_no_negative_zero(score), jnp.int32)
    # Negative floats order backwards in their magnitude bits: flip those bits.
    return jnp.where(bits < jnp.int32(0), bits ^ jnp.int32(0x7FFFFFFF), bits)


def num_pages(lengths: jax.Array, page_size: int) -> jax.Array:
    """Pages holding ``lengths`` tokens (the partial last page counted): ``ceil(lengths / P)``."""
    return (lengths + page_size - 1) // page_size


def select_pages(scores: jax.Array, n: jax.Array, budget: jax.Array) -> jax.Array:
    """Block top-k: the pages a query attends to, as a mask over page slots.

    scores ``[..., M]`` float32 (slot j = the sequence's j-th page), n ``[...]`` pages in use,
    budget ``[...]`` pages allowed, reserved included -> bool ``[..., M]``.

    Dense (all of ``0 .. n-1``) when ``n <= budget``; otherwise page 0, pages n-2 and n-1, and
    the ``budget - 3`` highest-scoring of pages ``1 .. n-3``, ties to the lower page index.
    Budgets below 3 act as 3 (callers reject them where they are concrete).
    """
    m = scores.shape[-1]
    n = jnp.asarray(n, jnp.int32)[..., None]
    budget = jnp.maximum(jnp.asarray(budget, jnp.int32), MIN_BUDGET_PAGES)[..., None]
    j = lax.broadcasted_iota(jnp.int32, scores.shape, scores.ndim - 1)
    in_use = j < n
    eligible = (j >= RESERVED_FIRST) & (j < n - RESERVED_LAST)
    reserved = in_use & ~eligible
    # Rank by (ineligible, -score, index): one lexicographic sort makes the tie rule explicit and
    # identical in every caller. -0.0 becomes 0.0, which the sort would otherwise order before
    # 0.0 although they compare equal (and the threshold below take both).
    neg = _no_negative_zero(-lax.stop_gradient(scores).astype(jnp.float32))
    s_inel, s_neg, s_idx = lax.sort(((~eligible).astype(jnp.int32), neg, j), num_keys=3)
    k = budget - MIN_BUDGET_PAGES                                  # top-k count, >= 0
    pos = jnp.clip(k - 1, 0, m - 1)
    t_neg = jnp.take_along_axis(s_neg, pos, axis=-1)
    t_idx = jnp.take_along_axis(s_idx, pos, axis=-1)
    t_inel = jnp.take_along_axis(s_inel, pos, axis=-1)
    # j is among the k best iff (−s_j, j) <= the k-th best pair, lexicographically.
    within = (neg < t_neg) | ((neg == t_neg) & (j <= t_idx))
    chosen = eligible & (k > 0) & (t_inel == 0) & within
    return jnp.where(n <= budget, in_use, reserved | chosen)
