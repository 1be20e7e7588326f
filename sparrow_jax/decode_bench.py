"""The sparse decode step against dense decode attention, one layer, as ``sparrow bench``
measures it (``scripts/bench_decode.py`` holds the kernel variants and their breakdowns).

A case is every sequence at the full context with its pages scattered in the pool (a random
permutation) and page "topics" in the keys, so that selection is far from uniform, as in real
keys. Each implementation is timed by what one call adds to a chain of calls whose next query
is the previous output (XLA can neither merge nor skip them): chains of ``chain`` and 4 x
``chain`` calls, the difference of their medians over ``repeats`` runs per call between them
(:func:`sparrow_jax.benchmarking.marginal_seconds`), which leaves out what a timed program costs
once (on an H100 ~0.3 ms: 8% of the sparse step's time in a chain of 20 at batch 32). The
sparse step's output is checked against the XLA reference before it is timed.

Bytes each must move: dense reads every K and V, ``2 B L Hkv D s`` (s the element size); the
sparse step reads the centroids of the scored pages and the chosen pages' K and V,
``B Hkv (M - 3) D s + B Hkv K P D 2 s`` (M = L / P pages, K the budget in pages; the three
reserved pages are never scored). "% of ceiling" is those bytes over the time, against the
device's read bandwidth measured in the same run and the same way
(:func:`sparrow_jax.benchmarking.read_ceiling` with ``marginal``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention.paged_dense import paged_attention
from sparrow_jax.attention.sparse import sparse_decode
from sparrow_jax.benchmarking import marginal_seconds


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """One layer's decode attention: heads, head size, page size and cache dtype."""

    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in ("q_heads", "kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads={self.q_heads} must be a multiple of "
                             f"kv_heads={self.kv_heads}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    def check(self, context: int, budget_tokens: int) -> None:
        """ValueError unless ``context`` is whole pages and ``budget_tokens`` whole pages, at
        least the 3 reserved ones and fewer than the context's (else the step is dense)."""
        p = self.page_size
        if context < 1 or context % p:
            raise ValueError(f"context={context} must be a positive multiple of the page size "
                             f"{p}")
        if budget_tokens % p or not 3 * p <= budget_tokens < context:
            raise ValueError(f"budget_tokens={budget_tokens} must be a multiple of the page "
                             f"size {p}, at least 3 pages and below context={context}")

    def dense_bytes(self, batch: int, context: int) -> int:
        return 2 * batch * context * self.kv_heads * self.head_dim * self.itemsize

    def sparse_bytes(self, batch: int, context: int, budget_tokens: int) -> int:
        pages, budget = context // self.page_size, budget_tokens // self.page_size
        per_row = ((pages - 3) * self.head_dim
                   + budget * self.page_size * self.head_dim * 2) * self.itemsize
        return batch * self.kv_heads * per_row


def random_case(shape: DecodeShape, batch: int, context: int, seed: int = 0,
                order: np.ndarray | None = None):
    """-> (q ``[B, Hq, D]``, k_pages, v_pages ``[Hkv, B M, P, D]``, centroids ``[Hkv, B M, D]``,
    page_table ``[B, M]``: ``order``, the pool's pages in the rows' order (default a random
    permutation), lengths ``[B]`` all ``context``)."""
    m = context // shape.page_size
    n_total = batch * m
    dtype = jnp.dtype(shape.dtype)
    kk, kv, kq, kt = jax.random.split(jax.random.key(seed), 4)
    h, p, d = shape.kv_heads, shape.page_size, shape.head_dim
    k_pages = (jax.random.normal(kk, (h, n_total, p, d), dtype)
               + 2 * jax.random.normal(kt, (h, n_total, 1, d), dtype))   # page topics
    v_pages = jax.random.normal(kv, (h, n_total, p, d), dtype)
    # One KV head at a time: a float32 copy of the whole cache may not fit.
    centroids = jnp.stack([jnp.mean(k_pages[i].astype(jnp.float32), axis=1)
                           for i in range(h)]).astype(dtype)
    if order is None:
        order = np.random.default_rng(seed).permutation(n_total)
    table = jnp.asarray(order.reshape(batch, m).astype(np.int32))
    return (jax.random.normal(kq, (batch, shape.q_heads, d), dtype), k_pages, v_pages, centroids,
            table, jnp.full((batch,), context, jnp.int32))


def measure(shape: DecodeShape, batch: int, context: int, budget_tokens: int, *,
            impl: str = "auto", chain: int = 20, repeats: int = 9,
            ceiling_gbs: float | None = None, seed: int = 0) -> dict:
    """The sparse step (``sparse_decode(impl=impl)``) and dense paged attention
    (``paged_attention(impl="auto")``, the engine's dense decode) on one random case -> a row:
    seconds a call of each (marginal), the sparse step's error against the reference in
    float32 products (max abs over max abs), ``x_dense`` (dense time over sparse time), the
    bytes each must move and, given ``ceiling_gbs``, each one's share of it."""
    shape.check(context, budget_tokens)
    q, k_pages, v_pages, centroids, table, lengths = random_case(shape, batch, context, seed)
    pages = budget_tokens // shape.page_size
    budgets = jnp.full((batch,), pages, jnp.int32)
    sparse = functools.partial(sparse_decode, page_size=shape.page_size, centroids=centroids,
                               max_budget_pages=pages)
    got = jax.jit(functools.partial(sparse, impl=impl))(q, k_pages, v_pages, table, lengths,
                                                        budgets)
    with jax.default_matmul_precision("highest"):     # float32 products, not TF32 on GPUs
        want = jax.jit(functools.partial(sparse, impl="reference"))(q, k_pages, v_pages, table,
                                                                    lengths, budgets)
    want = np.asarray(want, np.float32)
    rel_err = float(np.max(np.abs(np.asarray(got, np.float32) - want)) / np.max(np.abs(want)))

    def step_sparse(x, k, v, t, n, bu):
        return sparse(x, k, v, t, n, bu, impl=impl)

    def step_dense(x, k, v, t, n):
        return paged_attention(x, k, v, t, n)

    sparse_s = marginal_seconds(step_sparse, (q, k_pages, v_pages, table, lengths, budgets),
                                chain, repeats)
    dense_s = marginal_seconds(step_dense, (q, k_pages, v_pages, table, lengths), chain,
                               repeats)
    row = dict(batch=batch, context=context, budget_tokens=budget_tokens, impl=impl,
               sparse_s=sparse_s, dense_s=dense_s, x_dense=dense_s / sparse_s, rel_err=rel_err,
               sparse_bytes=shape.sparse_bytes(batch, context, budget_tokens),
               dense_bytes=shape.dense_bytes(batch, context))
    if ceiling_gbs:
        row["sparse_of_ceiling"] = row["sparse_bytes"] / sparse_s / 1e9 / ceiling_gbs
        row["dense_of_ceiling"] = row["dense_bytes"] / dense_s / 1e9 / ceiling_gbs
    return row


__all__ = ["DecodeShape", "random_case", "measure"]
