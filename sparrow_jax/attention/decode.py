"""Prefill into the paged cache and the decode step, through the model's attention hook.

Both run :meth:`~sparrow_jax.models.qwen3.Qwen3.forward` with an attend function that, for each
layer, writes the layer's K/V (after q/k-norm and RoPE, as the hook receives them) into the
pages and attends over the cache. One prefill per prompt serves its n samples:
:func:`~sparrow_jax.attention.paged_cache.fork` then points the samples' tables at the prompt's
full pages.

Typical use (host side, then jitted steps)::

    alloc = PageAllocator(num_pages, P).allocate(prompt_lengths, n, max_new)
    cache = init_cache(cfg, num_pages, alloc.prefill_page_table, page_size=P)
    hidden, cache = prefill_jit(model, cache, prompt_tokens, alloc.prompt_lengths)
    cache = fork(cache, alloc.page_table, alloc.prompt_index, alloc.copy_src, alloc.copy_dst)
    hidden = hidden[alloc.prompt_index]
    for each step: hidden, cache = decode_step_jit(model, cache, tokens, ...)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from sparrow_jax.attention.paged_cache import (SCORERS, PagedKVCache, prep_and_append_token,
                                               write_chunk)
from sparrow_jax.attention.paged_dense import _MASK_VALUE, gather_pages, paged_attention


def _check_batch(cache: PagedKVCache, name: str, x, shape_tail=()):
    want = (cache.batch, *shape_tail)
    if x.shape != want:
        raise ValueError(f"{name} must have shape {want} (the cache holds {cache.batch} rows), "
                         f"got {x.shape}")


def _prefill_attend(layer, q, k, v, cache: PagedKVCache, *, start: int):
    """Chunk ``start .. start+C-1``: write its K/V, then attend causally over the row's cache
    (earlier chunks and this one, one gather)."""
    cache = write_chunk(cache, layer, k, v, start, cache.lengths)
    b, c, hq, d = q.shape
    h = k.shape[2]
    n_pages = (start + c) // cache.page_size
    table = cache.page_table[:, :n_pages]
    kc = gather_pages(cache.k_pages[layer], table)                     # [B, H, S, D]
    vc = gather_pages(cache.v_pages[layer], table)
    key_pos = jnp.arange(kc.shape[2])
    query_pos = start + jnp.arange(c)
    # Causal, and never the right padding (stale page contents) past a row's length.
    mask = ((key_pos[None, None, :] <= query_pos[None, :, None])
            & (key_pos[None, None, :] < cache.lengths[:, None, None]))  # [B, C, S]
    qg = q.reshape(b, c, h, hq // h, d).astype(kc.dtype)
    s = jnp.einsum("bchrd,bhsd->bhrcs", qg, kc, preferred_element_type=jnp.float32) * d ** -0.5
    s = jnp.where(mask[:, None, None], s, _MASK_VALUE)
    w = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhrcs,bhsd->bchrd", w.astype(vc.dtype), vc,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, c, hq, d).astype(q.dtype), cache


def prefill(model, cache: PagedKVCache, tokens: jax.Array, prompt_lengths: jax.Array, *,
            chunk_size: int | None = None, lora: bool = False,
            tensor_axis: str | None = None) -> tuple[jax.Array, PagedKVCache]:
    """Dense prefill of right-padded prompts ``tokens [B, T]`` with ``prompt_lengths [B]`` into
    ``cache`` (B rows, lengths 0) -> (final-normed hidden of each row's last prompt token
    ``[B, hidden]``, cache with ``lengths = prompt_lengths``).

    ``chunk_size`` (a multiple of the page size; default: the whole prompt at once) bounds the
    attention scores to ``[B, Hq, chunk, T]``: chunk c attends to the earlier chunks through the
    cache and causally within itself. Padding is neither written nor counted.

    ``tensor_axis``: inside ``shard_map``, the mesh axis the cache's KV heads and the model's
    weights are split over (the cache holds this shard's heads, the weights are in the
    rollout's layout: :meth:`~sparrow_jax.models.qwen3.Qwen3.forward`).
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
    _check_batch(cache, "prompt_lengths", prompt_lengths)
    _check_batch(cache, "tokens", tokens, tokens.shape[1:])
    p = cache.page_size
    t = -(-tokens.shape[1] // p) * p
    if t > cache.max_pages_per_seq * p:
        raise ValueError(f"prompts of {tokens.shape[1]} tokens do not fit the page table's "
                         f"{cache.max_pages_per_seq} pages of {p}")
    chunk = t if chunk_size is None else chunk_size
    if chunk <= 0 or chunk % p:
        raise ValueError(f"chunk_size must be a positive multiple of the page size {p}, "
                         f"got {chunk_size}")
    tokens = jnp.pad(tokens, ((0, 0), (0, t - tokens.shape[1])))
    cache = cache.replace(lengths=prompt_lengths)
    last = None
    for start in range(0, t, chunk):
        c = min(chunk, t - start)
        positions = jnp.broadcast_to(start + jnp.arange(c, dtype=jnp.int32), (cache.batch, c))
        hidden, cache = model.forward(
            tokens[:, start:start + c], positions, state=cache, lora=lora,
            attend=functools.partial(_prefill_attend, start=start), tensor_axis=tensor_axis)
        idx = prompt_lengths - 1 - start
        here = jnp.take_along_axis(hidden, jnp.clip(idx, 0, c - 1)[:, None, None], axis=1)[:, 0]
        in_chunk = ((idx >= 0) & (idx < c))[:, None]
        last = here if last is None else jnp.where(in_chunk, here, last)
    return last, cache


def _decode_attend(layer, q, k, v, cache: PagedKVCache, *, prep, pos, active, budget_pages,
                   dense_layers, scorer, impl, max_budget_pages):
    q, cache = prep_and_append_token(cache, layer, q[:, 0], k[:, 0], v[:, 0], pos, active, prep)
    k_pages, v_pages = cache.k_pages[layer], cache.v_pages[layer]
    # A finished row's output is discarded: let it read one page, not its whole context.
    lengths = jnp.where(active, cache.lengths, jnp.minimum(cache.lengths, 1))
    if budget_pages is None or layer in dense_layers:
        out = paged_attention(q, k_pages, v_pages, cache.page_table, lengths)
    else:
        from sparrow_jax.attention.sparse import sparse_decode

        quest = scorer == "quest"
        out = sparse_decode(
            q, k_pages, v_pages, cache.page_table, lengths, budget_pages,
            page_size=cache.page_size, scorer=scorer, impl=impl,
            centroids=None if quest else cache.centroids[layer],
            summaries=(cache.kmin[layer], cache.kmax[layer]) if quest else None,
            max_budget_pages=max_budget_pages)
    return out[:, None], cache


def decode_step(model, cache: PagedKVCache, tokens: jax.Array, *,
                budget_pages: jax.Array | None = None, dense_layers: tuple[int, ...] = (0, 1),
                scorer: str = "centroid", impl: str = "auto",
                active: jax.Array | None = None, lora: bool = False,
                max_budget_pages: int | None = None,
                tensor_axis: str | None = None) -> tuple[jax.Array, PagedKVCache]:
    """One token per row: ``tokens [B]`` sit at position ``cache.lengths`` -> (final-normed
    hidden ``[B, hidden]``, cache with the token's K/V appended and ``lengths + 1``).

    Layers attend densely when ``budget_pages`` is None or the layer is in ``dense_layers``;
    otherwise through :func:`sparrow_jax.attention.sparse.sparse_decode` with ``budget_pages
    [B]`` (docs/design.md, section 3; ``impl`` as there: "auto" takes the Pallas kernels on GPU;
    ``max_budget_pages``: its static gather width, default the table's).
    Rows where ``active [B]`` is False (finished) neither write the cache
    nor grow; their outputs are meaningless. ``tensor_axis``: as in :func:`prefill`.
    Jit with :data:`decode_step_jit` (cache donated).
    """
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; known: {SCORERS}")
    if scorer == "quest" and budget_pages is not None and cache.kmin is None:
        raise ValueError("scorer 'quest' needs a cache built with scorer='quest' (min/max pages)")
    tokens = jnp.asarray(tokens)
    _check_batch(cache, "tokens", tokens)
    if budget_pages is not None:
        budget_pages = jnp.asarray(budget_pages, jnp.int32)
        _check_batch(cache, "budget_pages", budget_pages)
    active = (jnp.ones((cache.batch,), bool) if active is None
              else jnp.asarray(active, bool))
    _check_batch(cache, "active", active)
    pos = cache.lengths
    cache = cache.replace(lengths=pos + active.astype(jnp.int32))
    attend = functools.partial(_decode_attend, pos=pos, active=active, budget_pages=budget_pages,
                               dense_layers=tuple(dense_layers), scorer=scorer, impl=impl,
                               max_budget_pages=max_budget_pages)
    hidden, cache = model.forward(tokens[:, None], pos[:, None], attend=attend, state=cache,
                                  lora=lora, decode_kernels="auto", tensor_axis=tensor_axis)
    return hidden[:, 0], cache


def next_token_logits(model, hidden: jax.Array) -> jax.Array:
    """hidden ``[B, hidden]`` -> next-token logits ``[B, vocab]`` float32."""
    from sparrow_jax.models.qwen3 import logits_from_hidden

    return logits_from_hidden(hidden, model.head_weight())


def next_token_logprobs(model, hidden: jax.Array, temperature: float = 1.0) -> jax.Array:
    """hidden ``[B, hidden]`` -> ``log_softmax(logits / T)`` ``[B, vocab]`` float32."""
    return jax.nn.log_softmax(next_token_logits(model, hidden) / temperature, axis=-1)


prefill_jit = nnx.jit(prefill, static_argnames=("chunk_size", "lora", "tensor_axis"),
                      donate_argnames=("cache",))
decode_step_jit = nnx.jit(decode_step,
                          static_argnames=("dense_layers", "scorer", "impl", "lora",
                                           "max_budget_pages", "tensor_axis"),
                          donate_argnames=("cache",))
