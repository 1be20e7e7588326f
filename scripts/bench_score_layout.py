"""The sparse step's scoring against the layout of the centroids it reads (a probe).

The scoring reads one bf16 centroid a (page, KV head): 256 bytes at 128 dimensions. In the
library's layout, ``[Hkv, N, D]``, a row's pages are scattered over the pool, so each read is a
256-byte piece on its own, and the scoring reads at 63-70% of the ceiling at batches 32-64 on an
H200 (BENCHMARKS.md, kernel run AO) where the attention's 4 KB page reads reach 84-86%. This
script tells whether the pieces' size is what bounds it, timing three ways to score the same
keys, each call's time as it adds to a chain (``--loops marginal`` in bench_decode):

- ``head_major``: the library's scoring (``score_keys``), the pool's pages in random order;
- ``head_major_runs``: the same kernel on a table whose rows are runs of consecutive pages
  (each program's 64 centroids of a head one 16 KB piece; same bytes);
- ``page_major_cCwW``: a scoring of centroids laid out ``[N, Hkv * D]`` (a page's heads side by
  side: 2 KB a page), one program of W warps for C slots of a row and every KV head, random
  order.

Each way's keys are checked against the library's: the same ineligible slots, and scores
equal to float32 rounding (the sums' order follows each kernel's tile shape).

    python3 scripts/bench_score_layout.py --batches 32 8 1 64 --out $OUT/score_layout.json
    python3 scripts/bench_score_layout.py --interpret --warps 4   # a CPU smoke run, small sizes
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attend_gpu import group_queries, pow2
from pallas_kernels.sparse_decode_gpu import GpuDecodeTuning, list_sizes, score_keys
from sparrow_jax.attention.selection import order_key
from sparrow_jax.benchmarking import marginal_seconds, read_ceiling, write_record

HQ, HKV, D, P = 32, 8, 128, 16
INT_MIN = -(2 ** 31)


def _page_major_kernel(q_ref, cent_ref, table_ref, len_ref, key_ref, *, chunk, hkv, group):
    """Grid (B, Mpad / C): q ``[Hq, D]`` (this row), centroids ``[N, Hkv * D]``, table ``[C]``,
    length ``[1]`` -> keys ``[Hkv, C]``; slot j eligible when 1 <= j < n - 2, as the library's
    scoring (rows here are never shorter than the table, so no program is skipped)."""
    c = pl.program_id(1)
    n = (len_ref[0] + P - 1) // P
    slot = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    eligible = (slot >= 1) & (slot < n - 2)
    phys = plgpu.load(table_ref, mask=eligible, other=jnp.int32(0))
    d = q_ref.shape[1]
    col = lax.broadcasted_iota(jnp.int32, (chunk, d), 1)
    rows = jnp.broadcast_to(phys[:, None], (chunk, d))
    mask = jnp.broadcast_to(eligible[:, None], (chunk, d))
    # Every head's loads before any use: a page's 2 KB requested together.
    pages = [plgpu.load(cent_ref.at[rows, col + h * d], mask=mask, other=0)
             for h in range(hkv)]
    for h in range(hkv):
        queries = group_queries(q_ref, h, group, pow2(group)).astype(jnp.float32)
        qbar = jnp.sum(queries, axis=0) / group
        score = jnp.sum(pages[h].astype(jnp.float32) * qbar[None, :], axis=1)
        key_ref[h, :] = jnp.where(eligible, order_key(score), jnp.int32(INT_MIN))


def score_page_major(q, cent_pm, table, lengths, *, chunk, hkv, warps=4, interpret=False):
    """q ``[B, Hq, D]``, centroids ``[N, Hkv * D]``, table ``[B, Mpad]`` (Mpad a multiple of
    ``chunk``), lengths ``[B]`` -> keys ``[B, Hkv, Mpad]`` int32, as ``score_keys``'s."""
    b, hq, d = q.shape
    mpad = table.shape[1]
    return pl.pallas_call(
        functools.partial(_page_major_kernel, chunk=chunk, hkv=hkv, group=hq // hkv),
        grid=(b, mpad // chunk),
        in_specs=[pl.BlockSpec((None, hq, d), lambda bi, ci: (bi, 0, 0)),
                  pl.BlockSpec(cent_pm.shape, lambda bi, ci: (0, 0)),
                  pl.BlockSpec((None, chunk), lambda bi, ci: (bi, ci)),
                  pl.BlockSpec((1,), lambda bi, ci: (bi,))],
        out_specs=pl.BlockSpec((None, hkv, chunk), lambda bi, ci: (bi, 0, ci)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, mpad), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret, name="probe_score_page_major",
    )(q, cent_pm, table, lengths)


def case(b: int, m: int, seed: int):
    """q ``[b, HQ, D]``, centroids ``[HKV, b m, D]`` (bf16), a random table and a table of
    runs ``[b, m]``, lengths ``[b]`` (every row m pages)."""
    kq, kc = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(kq, (b, HQ, D), jnp.bfloat16)
    cent = jax.random.normal(kc, (HKV, b * m, D), jnp.bfloat16)
    order = np.random.default_rng(seed).permutation(b * m).astype(np.int32)
    table = jnp.asarray(order.reshape(b, m))
    runs = jnp.asarray(np.arange(b * m, dtype=np.int32).reshape(b, m))
    return q, cent, table, runs, jnp.full((b,), m * P, jnp.int32)


def scores_from_keys(keys: np.ndarray) -> np.ndarray:
    """The inverse of the order key: int32 keys -> the float32 scores they order (float64)."""
    keys = np.asarray(keys, np.int32)
    bits = np.where(keys < 0, keys ^ np.int32(0x7FFFFFFF), keys).astype(np.int32)
    return bits.view(np.float32).astype(np.float64)


def key_error(got: np.ndarray, want: np.ndarray) -> float:
    """inf where the two mark different slots ineligible, else the largest score difference
    over the largest score magnitude."""
    if not np.array_equal(got == INT_MIN, want == INT_MIN):
        return float("inf")
    ok = want != INT_MIN
    a, b = scores_from_keys(got)[ok], scores_from_keys(want)[ok]
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) if ok.any() else 0.0


def chain_step(keys_fn):
    """``keys_fn(q, *args)`` -> keys, as a chainable ``q -> q`` (a zero from the keys)."""
    def step(q, *args):
        keys = keys_fn(q, *args)
        return q + (keys[:, :, 1].sum() == -1).astype(q.dtype)
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 8, 1, 64])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--chunks", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--interpret", action="store_true",
                    help="Pallas interpret mode, 2 rows of 64 pages (a CPU smoke run)")
    ap.add_argument("--out", default=None, help="raw JSON here")
    args = ap.parse_args(argv)
    for flag, values in (("--chunks", args.chunks), ("--warps", args.warps)):
        for v in values:
            if v < 1 or v & (v - 1):
                ap.error(f"{flag}: {v} is not a power of two")
    batches, context = args.batches, args.context
    if args.interpret:
        batches, context, args.chain, args.repeats = [2], 64 * P, 1, 1
    if context % P:
        ap.error(f"--context: {context} is not a multiple of the page size {P}")
    m = context // P
    ceiling = read_ceiling(small=args.interpret, marginal=True) * 1e9
    print(f"device {jax.devices()[0].device_kind}, read ceiling (marginal) "
          f"{ceiling / 1e9:.0f} GB/s", flush=True)
    tuning = GpuDecodeTuning()
    rows = []
    for b in batches:
        q, cent, table, runs, lengths = case(b, m, seed=b)
        mpad, _ = list_sizes(m, m, tuning.resolve(page_size=P, batch=b, kv_heads=HKV,
                                                  max_pages=m))
        pad = ((0, 0), (0, mpad - m))
        table, runs = jnp.pad(table, pad), jnp.pad(runs, pad)
        cent_pm = cent.transpose(1, 0, 2).reshape(b * m, HKV * D)
        library = functools.partial(score_keys, page_size=P, tuning=tuning,
                                    interpret=args.interpret)
        want = np.asarray(jax.jit(library)(q, (cent,), table, lengths))
        ways = {"head_major": (library, ((cent,), table, lengths), table),
                "head_major_runs": (library, ((cent,), runs, lengths), runs)}
        for c in args.chunks:
            for w in args.warps:
                ways[f"page_major_c{c}w{w}"] = (
                    functools.partial(score_page_major, chunk=c, hkv=HKV, warps=w,
                                      interpret=args.interpret),
                    (cent_pm, table, lengths), table)
        nbytes = b * HKV * (m - 3) * D * 2      # the eligible slots' centroids
        for name, (fn, fn_args, tab) in ways.items():
            got = np.asarray(jax.jit(fn)(q, *fn_args))
            # (The runs table scores other pages: the library's kernel, nothing to check.)
            err = None if name == "head_major_runs" else key_error(got, want)
            seconds = marginal_seconds(chain_step(fn), (q, *fn_args), args.chain, args.repeats)
            row = dict(impl=name, batch=b, context=context, us=seconds * 1e6,
                       gb_per_s=nbytes / seconds / 1e9, frac_ceiling=nbytes / seconds / ceiling,
                       key_error=err)
            rows.append(row)
            shown = "-" if err is None else f"{err:.1e}"
            print(f"b {b:3d} {name:18s} {row['us']:8.1f} us {row['gb_per_s']:7.0f} GB/s "
                  f"{100 * row['frac_ceiling']:5.1f}%  key error {shown}", flush=True)
    write_record(args.out, read_ceiling_marginal_gb_s=ceiling / 1e9, rows=rows)
    bad = [r for r in rows if r["key_error"] is not None and not r["key_error"] < 1e-5]
    if bad:
        print(f"scores differ from the library's: {[(r['impl'], r['batch']) for r in bad]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
