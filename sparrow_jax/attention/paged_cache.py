"""The paged KV cache of docs/design.md, section 2 and its pure update functions.

Layout (head-major, as JAX's Pallas paged attention, one array per layer): ``k_pages, v_pages``:
tuples of ``layers`` arrays ``[kv_heads, num_pages, P, head_dim]`` (the ``[layers, kv_heads,
num_pages, P, head_dim]`` of docs/design.md, section 2, the layer axis as a tuple); a sequence's
token at position ``pos`` lives in physical page ``page_table[b, pos // P]``, slot ``pos % P``.
``cache.k_pages[layer]`` is that layer's array, and ``np.asarray(cache.k_pages)`` the stacked
``[layers, ...]`` view. Why not one stacked array: a kernel (a Pallas custom call) handed
``stacked[layer]`` gets a *copy* of the slice, so every decode step would copy the whole cache once
(measured: ~60 ms a step for a 68 GB cache on the H100, BENCHMARKS.md "Rollout"); separate buffers
go to the kernels as they are and are updated in place.

Page summaries: ``centroids`` (mean of a page's keys) and, for the Quest scorer, elementwise
``kmin``/``kmax``, per layer like the pages. They are written once, when a page fills; the partial
page is never scored. Until then each sequence keeps a running sum (float32) / min / max of its
partial page in ``partial_*`` ``[layers, batch, kv_heads, head_dim]``: one partial page per
sequence, so there is no float32 copy of the pool. Summaries are taken from the keys *as stored*
(cast to the cache dtype), so they equal a recomputation from the pages.

Writes that must not happen (inactive rows, padding) are sent to page index ``num_pages`` with
``mode="drop"``: one scatter per array, no branches, updated in place under donation. On a GPU a
decode step's write is one kernel instead (:mod:`pallas_kernels.paged_append_gpu`: four small
XLA kernels a layer cost ~10 us at 19 rows on the H100), the same bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels.paged_append_gpu import (append_token_pallas, kernel_limits,
                                             prep_append_token_pallas)
from sparrow_jax.attention.allocator import NULL_PAGE
from sparrow_jax.config import ModelConfig

SCORERS = ("centroid", "quest")


@struct.dataclass
class PagedKVCache:
    """Shapes: L layers, H kv heads, N physical pages, P page size, D head dim, B sequences,
    M max pages per sequence."""

    k_pages: tuple[jax.Array, ...]    # L x [H, N, P, D] cache dtype
    v_pages: tuple[jax.Array, ...]    # L x [H, N, P, D] cache dtype
    page_table: jax.Array     # [B, M] int32
    lengths: jax.Array        # [B] int32: tokens in cache, the current one included
    centroids: tuple[jax.Array, ...]  # L x [H, N, D] cache dtype; final once the page is full
    partial_sum: jax.Array    # [L, B, H, D] float32: sum of the keys of the partial page
    kmin: tuple[jax.Array, ...] | None = None   # L x [H, N, D] (scorer "quest")
    kmax: tuple[jax.Array, ...] | None = None   # L x [H, N, D]
    partial_min: jax.Array | None = None  # [L, B, H, D] cache dtype
    partial_max: jax.Array | None = None  # [L, B, H, D]
    page_size: int = struct.field(pytree_node=False, default=16)

    @property
    def num_layers(self) -> int:
        return len(self.k_pages)

    @property
    def num_pages(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.page_table.shape[1]

    @property
    def scorer(self) -> str:
        return "centroid" if self.kmin is None else "quest"


def init_cache(config: ModelConfig, num_pages: int, page_table, *, page_size: int = 16,
               dtype=jnp.bfloat16, scorer: str = "centroid") -> PagedKVCache:
    """An empty cache (``lengths`` 0) over ``num_pages`` pages for the rows of ``page_table
    [B, M]`` (from :class:`~sparrow_jax.attention.allocator.PageAllocator`)."""
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; known: {SCORERS}")
    page_table = jnp.asarray(page_table, jnp.int32)
    if page_table.ndim != 2:
        raise ValueError(f"page_table must be [batch, max_pages_per_seq], got {page_table.shape}")
    if not isinstance(page_table, jax.core.Tracer):   # traced: built under jit (a sharded pool)
        table = np.asarray(page_table)
        if table.size and (table.min() < 0 or table.max() >= num_pages):
            raise ValueError(f"page_table entries must lie in [0, {num_pages}), got "
                             f"[{table.min()}, {table.max()}]")
    layers, heads, d = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    b = page_table.shape[0]

    # Every array its own buffer: a donated cache must not hand one buffer over twice.
    def pages():
        return tuple(jnp.zeros((heads, num_pages, page_size, d), dtype) for _ in range(layers))

    def summaries():
        return tuple(jnp.zeros((heads, num_pages, d), dtype) for _ in range(layers))

    def summary():
        return summaries() if quest else None

    def partial():
        return jnp.zeros((layers, b, heads, d), dtype) if quest else None

    quest = scorer == "quest"
    return PagedKVCache(
        k_pages=pages(), v_pages=pages(), page_table=page_table,
        lengths=jnp.zeros((b,), jnp.int32), centroids=summaries(),
        partial_sum=jnp.zeros((layers, b, heads, d), jnp.float32),
        kmin=summary(), kmax=summary(), partial_min=partial(), partial_max=partial(),
        page_size=page_size)


def _set(arrays: tuple, layer: int, value: jax.Array) -> tuple:
    """``arrays`` with entry ``layer`` replaced."""
    return arrays[:layer] + (value,) + arrays[layer + 1:]


def append_token(cache: PagedKVCache, layer: int, k: jax.Array, v: jax.Array, pos: jax.Array,
                 write: jax.Array, *, impl: str = "auto") -> PagedKVCache:
    """Writes one token per row for ``layer``: k, v ``[B, H, D]`` at positions ``pos [B]``
    where ``write [B]`` (bool) and the position lies inside the page table, and updates the
    partial-page accumulators; a page's summaries are written when its last slot is.
    ``lengths`` is the caller's to advance.

    ``impl``: ``"xla"`` (the reference: scatters), ``"pallas"`` (one kernel,
    :mod:`pallas_kernels.paged_append_gpu`; power-of-two heads and head_dim; interpreted off
    GPU) or ``"auto"`` (the kernel on a GPU where it applies)."""
    p, n = cache.page_size, cache.num_pages
    page, slot = _page_slot(cache, pos, write)       # page n: dropped below
    write = page < n
    if _append_impl(impl, cache) == "pallas":
        return _with_written(cache, layer, append_token_pallas(
            page, slot, k, v, *_kernel_cache(cache, layer), layer=layer, page_size=p,
            interpret=jax.default_backend() != "gpu"))
    heads = jnp.arange(k.shape[1])[:, None]          # [H, 1] against [1, B] indices
    kh = jnp.swapaxes(k, 0, 1).astype(cache.k_pages[layer].dtype)   # [H, B, D]
    vh = jnp.swapaxes(v, 0, 1).astype(cache.v_pages[layer].dtype)
    k_pages = _set(cache.k_pages, layer, cache.k_pages[layer].at[
        heads, page[None], slot[None]].set(kh, mode="drop"))
    v_pages = _set(cache.v_pages, layer, cache.v_pages[layer].at[
        heads, page[None], slot[None]].set(vh, mode="drop"))

    start = (slot == 0)[:, None, None]               # a fresh page: forget the last page's sums
    keep = write[:, None, None]
    stored = jnp.swapaxes(kh, 0, 1)                  # [B, H, D] as stored
    new_sum = jnp.where(start, 0.0, cache.partial_sum[layer]) + stored.astype(jnp.float32)
    partial_sum = cache.partial_sum.at[layer].set(
        jnp.where(keep, new_sum, cache.partial_sum[layer]))
    full_page = jnp.where(write & (slot == p - 1), page, n)[None]    # [1, B]
    dtype = cache.centroids[layer].dtype
    centroids = _set(cache.centroids, layer, cache.centroids[layer].at[heads, full_page].set(
        jnp.swapaxes(new_sum / p, 0, 1).astype(dtype), mode="drop"))
    out = cache.replace(k_pages=k_pages, v_pages=v_pages, centroids=centroids,
                        partial_sum=partial_sum)
    if cache.kmin is None:
        return out
    new_min = jnp.where(start, stored, jnp.minimum(cache.partial_min[layer], stored))
    new_max = jnp.where(start, stored, jnp.maximum(cache.partial_max[layer], stored))
    return out.replace(
        partial_min=cache.partial_min.at[layer].set(
            jnp.where(keep, new_min, cache.partial_min[layer])),
        partial_max=cache.partial_max.at[layer].set(
            jnp.where(keep, new_max, cache.partial_max[layer])),
        kmin=_set(cache.kmin, layer, cache.kmin[layer].at[heads, full_page].set(
            jnp.swapaxes(new_min, 0, 1), mode="drop")),
        kmax=_set(cache.kmax, layer, cache.kmax[layer].at[heads, full_page].set(
            jnp.swapaxes(new_max, 0, 1), mode="drop")))


def prep_and_append_token(cache: PagedKVCache, layer: int, q: jax.Array, k: jax.Array,
                          v: jax.Array, pos: jax.Array, write: jax.Array, prep, *,
                          impl: str = "auto") -> tuple[jax.Array, PagedKVCache]:
    """q ``[B, Hq, D]``, k, v ``[B, H, D]`` as projected; ``prep`` the layer's
    :class:`~sparrow_jax.models.qk_prep.QKPrep` (cos, sin ``[B, 1, D]``) -> (q normed and
    rotated, the cache after :func:`append_token` of k normed and rotated, and v).

    With the kernel (``impl`` as :func:`append_token`; it also needs power-of-two query heads)
    the norms, RoPE and the write are one launch a layer instead of six (and it sums
    ``prep.partials`` itself where the decode GEMM left them); without it ``prep`` runs as XLA
    ops and the write as :func:`append_token` with ``impl``."""
    if _append_impl(impl, cache, q_heads=q.shape[1]) == "pallas":
        if prep.partials is not None:
            qkv, dtype = prep.partials, q.dtype
        else:
            qkv = jnp.concatenate([q, k.astype(q.dtype), v.astype(q.dtype)], axis=1)
            dtype = None
        q, *written = prep_append_token_pallas(
            *_page_slot(cache, pos, write), qkv, prep.q_weight, prep.k_weight, prep.cos[:, 0],
            prep.sin[:, 0], *_kernel_cache(cache, layer), layer=layer,
            page_size=cache.page_size, eps=prep.eps, dtype=dtype,
            interpret=jax.default_backend() != "gpu")
        return q, _with_written(cache, layer, written)
    q, k = prep(q[:, None], k[:, None])
    return q[:, 0], append_token(cache, layer, k[:, 0], v, pos, write, impl=impl)


def _page_slot(cache: PagedKVCache, pos: jax.Array, write: jax.Array):
    """The physical page (``num_pages`` where nothing is written) and slot of each row's token."""
    p, n = cache.page_size, cache.num_pages
    logical = pos // p
    write = write & (logical < cache.max_pages_per_seq)   # past the table: nowhere to write
    page = jnp.take_along_axis(cache.page_table, logical[:, None], axis=1, mode="clip")[:, 0]
    return jnp.where(write, page, n), pos % p


def _kernel_cache(cache: PagedKVCache, layer: int) -> tuple:
    """The write kernels' cache arguments for ``layer``: partial_sum, K and V pages, centroids
    and, for a Quest cache, (partial_min, partial_max, kmin, kmax)."""
    quest = () if cache.kmin is None else (cache.partial_min, cache.partial_max,
                                           cache.kmin[layer], cache.kmax[layer])
    return (cache.partial_sum, cache.k_pages[layer], cache.v_pages[layer],
            cache.centroids[layer], quest)


def _with_written(cache: PagedKVCache, layer: int, written) -> PagedKVCache:
    """``cache`` holding the write kernels' outputs (as :func:`_kernel_cache` orders them)."""
    sums, kp, vp, cent, *quest = written
    out = cache.replace(k_pages=_set(cache.k_pages, layer, kp),
                        v_pages=_set(cache.v_pages, layer, vp),
                        centroids=_set(cache.centroids, layer, cent), partial_sum=sums)
    if not quest:
        return out
    pmin, pmax, kmin, kmax = quest
    return out.replace(partial_min=pmin, partial_max=pmax, kmin=_set(cache.kmin, layer, kmin),
                       kmax=_set(cache.kmax, layer, kmax))


def _append_impl(impl: str, cache: PagedKVCache, q_heads: int | None = None) -> str:
    if impl not in ("auto", "xla", "pallas"):
        raise ValueError(f"append_token: unknown impl {impl!r}; expected auto, xla or pallas")
    h, _, _, d = cache.k_pages[0].shape
    why = kernel_limits(h, d, q_heads)
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" and why is None else "xla"
    if impl == "pallas" and why is not None:
        raise ValueError(f"append_token(impl='pallas'): {why}")
    return impl


def write_chunk(cache: PagedKVCache, layer: int, k: jax.Array, v: jax.Array, start: int,
                lengths: jax.Array) -> PagedKVCache:
    """Prefill write for ``layer``: k, v ``[B, C, H, D]`` hold positions ``start .. start+C-1``
    (``start`` and ``C`` multiples of P, so each page lies in one chunk); positions at or past
    ``lengths [B]`` (right padding) are not written. Full pages get their summaries; the page
    holding a row's last token, if partial, goes to the partial accumulators."""
    p, n = cache.page_size, cache.num_pages
    b, c, h, d = k.shape
    if start % p or c % p:
        raise ValueError(f"prefill chunks must start and end on page boundaries (page size {p}),"
                         f" got start {start}, size {c}")
    first = start // p
    n_chunk_pages = c // p
    if first + n_chunk_pages > cache.max_pages_per_seq:
        raise ValueError(f"prefill chunk ends at token {start + c} but the page table holds "
                         f"{cache.max_pages_per_seq} pages of {p}")
    pos = start + jnp.arange(c)
    valid = pos[None, :] < lengths[:, None]                            # [B, C]
    page = cache.page_table[:, first + jnp.arange(c) // p]             # [B, C]
    page = jnp.where(valid, page, n)
    slot = jnp.broadcast_to(pos % p, (b, c))
    heads = jnp.arange(h)[:, None, None]
    kh = jnp.moveaxis(k, 2, 0).astype(cache.k_pages[layer].dtype)      # [H, B, C, D]
    vh = jnp.moveaxis(v, 2, 0).astype(cache.v_pages[layer].dtype)
    k_pages = _set(cache.k_pages, layer, cache.k_pages[layer].at[
        heads, page[None], slot[None]].set(kh, mode="drop"))
    v_pages = _set(cache.v_pages, layer, cache.v_pages[layer].at[
        heads, page[None], slot[None]].set(vh, mode="drop"))

    stored = jnp.moveaxis(kh, 0, 2).reshape(b, n_chunk_pages, p, h, d)   # [B, n, P, H, D]
    mask = valid.reshape(b, n_chunk_pages, p)[..., None, None]
    count = valid.reshape(b, n_chunk_pages, p).sum(-1)                  # [B, n]
    sums = jnp.where(mask, stored.astype(jnp.float32), 0.0).sum(2)      # [B, n, H, D]
    table = cache.page_table[:, first:first + n_chunk_pages]
    full_page = jnp.where(count == p, table, n)                         # [B, n]
    is_partial = (count > 0) & (count < p)                              # at most one per row
    has_partial = is_partial.any(1)[:, None, None]
    sel = is_partial[..., None, None]
    idx = (jnp.arange(h)[:, None, None], full_page[None])               # [H, B, n]

    def put_summary(summary, values):                                   # values [B, n, H, D]
        s = summary[layer]
        return _set(summary, layer, s.at[idx].set(jnp.moveaxis(values, 2, 0).astype(s.dtype),
                                                  mode="drop"))

    def put_partial(partial, values):                                   # values [B, n, H, D]
        picked = jnp.where(sel, values, 0).sum(1).astype(partial.dtype)
        return partial.at[layer].set(jnp.where(has_partial, picked, partial[layer]))

    out = cache.replace(k_pages=k_pages, v_pages=v_pages,
                        centroids=put_summary(cache.centroids, sums / p),
                        partial_sum=put_partial(cache.partial_sum, sums))
    if cache.kmin is None:
        return out
    big = jnp.asarray(jnp.finfo(stored.dtype).max, stored.dtype)
    mins = jnp.where(mask, stored, big).min(2)
    maxs = jnp.where(mask, stored, -big).max(2)
    return out.replace(kmin=put_summary(cache.kmin, mins), kmax=put_summary(cache.kmax, maxs),
                       partial_min=put_partial(cache.partial_min, mins),
                       partial_max=put_partial(cache.partial_max, maxs))


def fork(cache: PagedKVCache, page_table, prompt_index, copy_src, copy_dst) -> PagedKVCache:
    """From a cache prefilled per prompt (rows = prompts) to one row per sample.

    ``page_table [S, M]`` (the samples' tables: shared full prompt pages, own pages after),
    ``prompt_index [S]`` (each sample's prompt row), ``copy_src/copy_dst [C]``: physical pages
    to copy (each prompt's partial last page into the other samples' first own page). The
    samples inherit the prompt's length and partial-page accumulators. Arguments as in
    :class:`~sparrow_jax.attention.allocator.Allocation`.
    """
    page_table = jnp.asarray(page_table, jnp.int32)
    prompt_index = jnp.asarray(prompt_index, jnp.int32)
    src = jnp.asarray(copy_src, jnp.int32)
    dst = jnp.asarray(copy_dst, jnp.int32)
    if page_table.shape[0] != prompt_index.shape[0]:
        raise ValueError(f"page_table has {page_table.shape[0]} rows but prompt_index "
                         f"{prompt_index.shape[0]}")
    if src.shape != dst.shape:
        raise ValueError(f"copy_src {src.shape} and copy_dst {dst.shape} differ in shape")

    def copy(pages):
        return tuple(x.at[:, dst].set(x[:, src]) for x in pages)

    def rows(x):
        return None if x is None else jnp.take(x, prompt_index, axis=1)

    return cache.replace(
        k_pages=copy(cache.k_pages), v_pages=copy(cache.v_pages), page_table=page_table,
        lengths=cache.lengths[prompt_index], partial_sum=rows(cache.partial_sum),
        partial_min=rows(cache.partial_min), partial_max=rows(cache.partial_max))


__all__ = ["PagedKVCache", "init_cache", "append_token", "prep_and_append_token", "write_chunk",
           "fork", "NULL_PAGE", "SCORERS"]
