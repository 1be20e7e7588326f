"""Probe (session 41): how fast can a kernel of the sparse attention's shape read scattered
pages at all? Times, in one process on one GPU and all as what a call adds to a chain
(``marginal_seconds``), at 32K context (2048 pages a row, GQA 32/8, head_dim 128, page 16,
bf16, pages a random permutation of the pool):

- ``ceiling``: the faster of a sum and a max over 4 GiB float32 (``read_ceiling``).
- ``loads_only``: a Pallas kernel of the attention's grid and loads (grid (B, Hkv, S), S from
  ``default_splits``; 4 pages a block, K and V loaded by list entry as ``_attend`` loads them),
  adding the pages into a float32 tile: no products, no softmax (for whole rows, dense
  decode's splits, ``table_splits``).
- ``xla_gather_sum``: XLA's gather of the same pages fused into a sum.
- ``attention``: the sparse step's attention (``attend_page_lists``, the default tuning) over
  the same lists; ``attention_even``: with even splits (``balanced=False``).
- ``loads_dots``: ``loads_only`` with the attention's two products (16 rows, ones for q)
  in place of the adds: its loads and products without the softmax; ``loads_fma``: four
  heads' products as float32 multiplies and sums instead (no matrix units).

Lists: ``--budget`` pages a (row, KV head) drawn without replacement from the row's pages
(sorted, as the selection's are), or with ``--budget 0`` every page of the row (dense decode's
reading). GB/s counts the listed pages' K and V once.

    python3 notes/bench_runs/2026-11-29b_page_read_ceiling.py --batch 32 --budget 128
    (CPU smoke: --interpret --batch 2 --pages 64 --budget 16)
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attend_gpu import attend_page_lists, default_splits, table_splits
from pallas_kernels.sparse_decode_gpu import GpuDecodeTuning
from sparrow_jax.benchmarking import marginal_seconds, read_ceiling

P, D, HKV, HQ = 16, 128, 8, 32


def _loads_kernel(x_ref, k_ref, v_ref, phys_ref, o_ref, *, block_pages, splits, count, dots):
    s = pl.program_id(2)
    blocks = count // block_pages
    per = (blocks + splits - 1) // splits
    start, stop = s * per, jnp.minimum(s * per + per, blocks)
    bk = block_pages * P

    def body(i, acc):
        phys = phys_ref[pl.ds(i * block_pages, block_pages)]
        k = k_ref[phys].reshape(bk, D)
        v = v_ref[phys].reshape(bk, D)
        if not dots:
            return acc + k.astype(jnp.float32) + v.astype(jnp.float32)
        if dots == "fma":
            # Four query heads' products on the CUDA cores, each a sum over D then over the
            # block's tokens, in float32 registers (no shared-memory operand layouts).
            k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
            row = lax.broadcasted_iota(jnp.int32, (16, D), 0)
            for r in range(4):
                out = jnp.sum(jnp.sum(k32 * (0.01 * (r + 1)), axis=1)[:, None] * v32, axis=0)
                acc = acc + jnp.where(row == r, out[None, :], 0.0)
            return acc
        # The attention's two products on 16 rows, without its softmax or masks.
        q = jnp.ones((16, D), k.dtype)
        logits = plgpu.dot(q, k, trans_b=True)                             # [16, bk]
        return acc + plgpu.dot(logits.astype(v.dtype), v)                  # [16, D]

    shape = (16, D) if dots else (bk, D)      # "fma": the first 4 rows used
    acc = lax.fori_loop(start, stop, body, jnp.zeros(shape, jnp.float32))
    o_ref[...] = jnp.sum(acc, axis=0) + x_ref[...]


def loads_only(x, k_pages, v_pages, lists, *, block_pages, splits, warps, interpret,
               dots=False):
    """x ``[B, Hkv, S, D]`` float32 (the chain's carry), pages ``[Hkv, N, P, D]``, lists
    ``[B, Hkv, L]`` -> ``[B, Hkv, S, D]``: each split's sum of its pages plus x."""
    b, hkv, count = lists.shape
    n_total = k_pages.shape[1]
    pages = pl.BlockSpec((None, n_total, P, D), lambda bi, hi, si: (hi, 0, 0, 0))
    part = pl.BlockSpec((None, None, None, D), lambda bi, hi, si: (bi, hi, si, 0))
    kernel = functools.partial(_loads_kernel, block_pages=block_pages, splits=splits,
                               count=count, dots=dots)
    return pl.pallas_call(
        kernel, grid=(b, hkv, splits),
        in_specs=[part, pages, pages,
                  pl.BlockSpec((None, None, count), lambda bi, hi, si: (bi, hi, 0))],
        out_specs=part, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
        compiler_params=None if interpret else pl.triton.CompilerParams(num_warps=warps),
        interpret=interpret, name="probe_loads_only")(x, k_pages, v_pages, lists)


def xla_gather_sum(x, k_pages, v_pages, lists):
    """x a float32 scalar -> the sum of the listed pages' K and V, scaled down, plus x."""
    take = jax.vmap(lambda pages, idx: pages[idx], in_axes=(0, 1))   # [Hkv, B, L, P, D]
    # x in the indices (always 0), or XLA hoists the sum out of the chain.
    lists = lists + (x > 1e30).astype(lists.dtype)
    total = (jnp.sum(take(k_pages, lists).astype(jnp.float32))
             + jnp.sum(take(v_pages, lists).astype(jnp.float32)))
    return total * 1e-9 + x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--pages", type=int, default=2048, help="pages a row (32K context)")
    ap.add_argument("--budget", type=int, default=128, help="pages a list; 0: every page")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    b, m = args.batch, args.pages
    count = args.budget or m
    rng = np.random.default_rng(0)
    n_total = b * m
    table = rng.permutation(n_total).reshape(b, m).astype(np.int32)
    if args.budget:
        chosen = np.sort(np.stack([np.stack([rng.choice(m, count, replace=False)
                                             for _ in range(HKV)]) for _ in range(b)]), -1)
    else:
        chosen = np.broadcast_to(np.arange(m), (b, HKV, m))
    lists = jnp.asarray(np.take_along_axis(table[:, None, :], chosen, axis=-1), jnp.int32)
    slots = jnp.asarray(chosen, jnp.int32)
    kk, kv, kq = jax.random.split(jax.random.key(1), 3)
    k_pages = jax.random.normal(kk, (HKV, n_total, P, D), jnp.bfloat16)
    v_pages = jax.random.normal(kv, (HKV, n_total, P, D), jnp.bfloat16)
    q = jax.random.normal(kq, (b, HQ, D), jnp.bfloat16)
    nbytes = 2 * b * HKV * count * P * D * 2
    interp = args.interpret
    ceiling = read_ceiling(small=interp, marginal=True)
    print(f"{jax.devices()[0].device_kind}: ceiling {ceiling:.0f} GB/s; batch {b}, lists of "
          f"{count} pages, {nbytes / 1e6:.1f} MB", flush=True)

    # Correctness of the probe kernel against NumPy on the first list's first split.
    # The splits the sparse step's even attention uses; for whole rows, dense decode's.
    splits = (default_splits if args.budget else table_splits)(b, HKV, count, 4)
    x0 = jnp.zeros((b, HKV, splits, D), jnp.float32)
    got = np.asarray(loads_only(x0, k_pages, v_pages, lists, block_pages=4, splits=splits,
                                warps=2, interpret=interp)).sum(axis=2)
    kp, vp = (np.asarray(a.astype(jnp.float32)) for a in (k_pages, v_pages))
    want = (kp[0, np.asarray(lists)[0, 0]] + vp[0, np.asarray(lists)[0, 0]]).sum(axis=(0, 1))
    assert np.allclose(got[0, 0], want, rtol=1e-3, atol=1e-2), "probe kernel is wrong"

    tuning = GpuDecodeTuning().resolve(page_size=P, batch=b, kv_heads=HKV, max_pages=count)
    cnt = jnp.full((b, HKV, 1), count, jnp.int32)
    lengths = jnp.full((b,), m * P, jnp.int32)
    cases = {
        "xla_gather_sum": (xla_gather_sum, (jnp.float32(0), k_pages, v_pages, lists)),
        "attention": (lambda x, *a: attend_page_lists(x, *a, page_size=P, tuning=tuning,
                                                      interpret=interp),
                      (q, k_pages, v_pages, lists, slots, cnt, lengths)),
    }
    even = GpuDecodeTuning(balanced=False).resolve(page_size=P, batch=b, kv_heads=HKV,
                                                   max_pages=count)
    cases["attention_even"] = (
        lambda x, *a: attend_page_lists(x, *a, page_size=P, tuning=even, interpret=interp),
        (q, k_pages, v_pages, lists, slots, cnt, lengths))
    cases["loads_fma_b4w2"] = (
        functools.partial(loads_only, block_pages=4, splits=splits, warps=2,
                          interpret=interp, dots="fma"), (x0, k_pages, v_pages, lists))
    cases["loads_dots_b4w2"] = (
        functools.partial(loads_only, block_pages=4, splits=splits, warps=2,
                          interpret=interp, dots=True), (x0, k_pages, v_pages, lists))
    for bp, w in ((4, 2), (4, 4), (8, 4), (2, 2)):
        if count % bp == 0:
            cases[f"loads_only_b{bp}w{w}"] = (
                functools.partial(loads_only, block_pages=bp, splits=splits, warps=w,
                                  interpret=interp),
                (x0, k_pages, v_pages, lists))
    rows = []
    for name, (fn, fargs) in cases.items():
        t = marginal_seconds(fn, fargs, args.chain, args.repeats)
        row = dict(case=name, batch=b, pages_a_list=count, us=t * 1e6,
                   gb_per_s=nbytes / t / 1e9, frac_ceiling=nbytes / t / 1e9 / ceiling)
        rows.append(row)
        print(f"{name:24s} {t * 1e6:8.1f} us  {row['gb_per_s']:7.0f} GB/s  "
              f"{row['frac_ceiling']:.0%} of the ceiling", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, ceiling_gb_s=ceiling,
                           args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
