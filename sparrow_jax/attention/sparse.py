"""Sparse decode attention for one layer over a paged KV cache (docs/design.md, sections 2-3).

The reference implementation here defines the semantics; the Pallas kernels for GPU
(``impl="pallas"``) and for TPU (``impl="pallas_tpu"``) and the Triton kernels for GPU
(``impl="triton"``, through jax-triton, imported only when chosen) match it, and all check
their arguments in :mod:`sparrow_jax.attention.sparse_args`. ``impl="auto"`` picks per platform
(:func:`resolve_impl`). Both are jittable with budgets and lengths as runtime
arrays: the number of pages gathered per sequence and KV head is static (``max_budget_pages``, by
default the page-table width).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import sparse_decode_tpu, sparse_decode_triton
from pallas_kernels.sparse_decode_gpu import kernel_limits, sparse_decode_pallas_checked
from sparrow_jax.attention import selection
from sparrow_jax.attention.sparse_args import check_sparse_decode_args, checked_summaries

IMPLS = ("auto", "reference", "pallas", "pallas_tpu", "triton")


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
      impl: ``"reference"`` (pure JAX, any backend and scorer), ``"pallas"`` (the Pallas
        kernels of :mod:`pallas_kernels.sparse_decode_gpu`; power-of-two page size and
        head_dim >= 16, else ValueError; run interpreted off GPU, slowly, so CPU tests check
        them), ``"pallas_tpu"`` (the Mosaic kernels of :mod:`pallas_kernels.sparse_decode_tpu`;
        page size 16/32/64, head_dim a multiple of 128, else ValueError; run in TPU interpret
        mode off TPU), ``"triton"`` (the Triton kernels of
        :mod:`pallas_kernels.sparse_decode_triton` through jax-triton, GPU only: the
        ``triton`` extra; limits as ``"pallas"``), ``"auto"`` (the kernels for the
        platform where they apply, else the reference: see :func:`resolve_impl`). Every
        kernel set runs both scorers.
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
    check_sparse_decode_args(q, k_pages, v_pages, page_table, lengths, budget_pages,
                             page_size=page_size, max_budget_pages=max_budget_pages)
    summ = checked_summaries(k_pages, scorer, centroids, summaries)
    args = (q, k_pages, v_pages, page_table, lengths, budget_pages)

    def reference(*a):
        return _reference(*a, summ, page_size=page_size, scorer=scorer,
                          max_pages=max_budget_pages or page_table.shape[1])

    def tpu_kernels(*a, interpret=False):
        return sparse_decode_tpu.sparse_decode_tpu_checked(
            *a[:3], summ, *a[3:], page_size=page_size, max_budget_pages=max_budget_pages,
            interpret=interpret)

    chosen = resolve_impl(impl, scorer, q.shape[-1], page_size)
    if chosen == "triton":
        return sparse_decode_triton.sparse_decode_triton_checked(
            q, k_pages, v_pages, summ, page_table, lengths, budget_pages,
            page_size=page_size, max_budget_pages=max_budget_pages)
    if chosen == "pallas":
        return sparse_decode_pallas_checked(
            q, k_pages, v_pages, summ, page_table, lengths, budget_pages,
            page_size=page_size, max_budget_pages=max_budget_pages,
            interpret=jax.default_backend() != "gpu")
    if chosen == "pallas_tpu":
        return tpu_kernels(*args, interpret=jax.default_backend() != "tpu")
    if impl == "auto" and jax.default_backend() != "gpu" and resolve_impl(
            impl, scorer, q.shape[-1], page_size, platform="tpu") == "pallas_tpu":
        # Decided when lowering, per platform: a step compiled or exported for TPU from a CPU or
        # TPU host holds the TPU kernels; lowered for CPU, only the reference is compiled. (On a
        # GPU backend "auto" means the GPU kernels, which cannot lower for TPU.)
        return lax.platform_dependent(*args, tpu=tpu_kernels, default=reference)
    return reference(*args)


def resolve_impl(impl: str, scorer: str, head_dim: int, page_size: int,
                 platform: str | None = None) -> str:
    """The implementation ``sparse_decode(impl=...)`` runs on ``platform`` (default
    ``jax.default_backend()``): ``"pallas"``, ``"pallas_tpu"``, ``"triton"`` (only when named)
    or ``"reference"``.

    ``"auto"`` is the GPU kernels on a GPU where they apply (power-of-two page size and
    head_dim >= 16), the TPU kernels on a TPU where they apply (page size 16/32/64, head_dim a
    multiple of 128), else the reference (CPU, shapes the kernels reject); either scorer. Off GPU,
    ``sparse_decode`` makes the TPU choice when lowering (``lax.platform_dependent``), so a step
    exported for TPU from a CPU host holds the TPU kernels. A named kernel that does not apply
    raises ValueError; off its platform it runs interpreted (slow; for tests).
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    platform = platform or jax.default_backend()
    why = {"pallas": kernel_limits(head_dim, page_size, scorer),
           "triton": kernel_limits(head_dim, page_size, scorer),
           "pallas_tpu": sparse_decode_tpu.kernel_limits(head_dim, page_size, scorer)}
    if impl == "auto":
        impl = {"gpu": "pallas", "tpu": "pallas_tpu"}.get(platform, "reference")
        return impl if impl == "reference" or why[impl] is None else "reference"
    if impl != "reference" and why[impl] is not None:
        raise ValueError(f"sparse_decode(impl={impl!r}): {why[impl]}; use impl='reference' "
                         "(or 'auto', which falls back to it)")
    return impl


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
