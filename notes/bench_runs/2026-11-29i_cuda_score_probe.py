"""Probe (session 48): the streaming CUDA scoring's stage size, warps and stages in flight.

The kernel (the library's CUDA scoring of commit 2d10e06, removed after: give its source with
``--source``, from the repository's root
``git show 2d10e06:./pallas_kernels/sparse_score_cuda.cu > /tmp/score.cu``) streams each
warp's run of 16-slot stages (4 KB of centroids) through a ring of ``STAGES`` shared-memory
slots, 8 warps a block, a block an SM. This builds it with other ``SLOTS`` / ``WARPS`` /
``STAGES`` (each an FFI target of its own) and times the scoring alone at each batch against
the Pallas scoring, every variant in one process, as bench_decode's ``part_score`` times it
(what a call adds to a chain, or device time from a trace with ``--trace``). Each variant's
keys are checked against the Pallas kernel's: the same slots marked ineligible, scores within
float32 rounding. ``:nowrite`` and ``:late`` patch the kernel's key stores away, or into one
coalesced write every 32 stages (whether the writes between the reads cost the DRAM time);
``--xla-score`` times the scoring written in XLA, ``--xla-sum`` XLA reading the same bytes.

    python3 notes/bench_runs/2026-11-29i_cuda_score_probe.py --source /tmp/score.cu \
        --batches 32 8 1 [--sorted | --contiguous] [--xla-sum] [--xla-score]
    python3 notes/bench_runs/2026-11-29i_cuda_score_probe.py --source /tmp/score.cu \
        --batches 32 8 --variants s16w8t4,s16w8t4:nowrite,s16w8t4:late --xla-score --xla-sum
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import tempfile
from pathlib import Path

if "--trace" in sys.argv:   # read when the backend starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_enable_command_buffer=").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_decode import HKV, P, decode_inputs  # noqa: E402

from pallas_kernels.cuda_build import build_library, find_nvcc  # noqa: E402
from pallas_kernels.paged_attend_gpu import sm_count  # noqa: E402
from pallas_kernels.sparse_decode_gpu import GpuDecodeTuning, score_keys  # noqa: E402
from sparrow_jax.attention.selection import num_pages, order_key  # noqa: E402
from sparrow_jax.benchmarking import chained, marginal_seconds, profile_calls  # noqa: E402

LINE = "constexpr int SLOTS = 16, WARPS = 8, STAGES = 4;"


STORE = ("      keys[(first + i) * SLOTS + p] = slot >= 1 && slot < n - 2 ? order_key(total) : "
         "INT_MIN;\n")
# Patches of the keys' stores: "nowrite" stores none (a condition that never holds keeps the
# scores computed), "late" holds a warp's keys in shared memory and writes them out every
# KEEP stages and at the end of its run, coalesced, so the reads are not broken by writes.
PATCHES = {
    "nowrite": [(STORE, "      if (total == 1234.5f) keys[(first + i) * SLOTS + p] = n;\n")],
    "late": [
        ("constexpr int WARP_BYTES = STAGES * (STAGE_BYTES + SLOTS * 4);",
         "constexpr int KEEP = 32;\n"
         "constexpr int WARP_BYTES = STAGES * (STAGE_BYTES + SLOTS * 4) + KEEP * SLOTS * 4;"),
        (STORE, "      s_keys[(i % KEEP) * SLOTS + p] = slot >= 1 && slot < n - 2 ? "
                "order_key(total) : INT_MIN;\n"),
        ("    __syncwarp();   // the stage's slot is copied into again by the next issue\n",
         "    __syncwarp();   // the stage's slot is copied into again by the next issue\n"
         "    if (i % KEEP == KEEP - 1 || i == count - 1) {\n"
         "      const int held = (i % KEEP + 1) * SLOTS;\n"
         "      int* to = keys + (first + i - i % KEEP) * SLOTS;\n"
         "      for (int j = lane; j < held; j += 32) to[j] = s_keys[j];\n"
         "      __syncwarp();\n"
         "    }\n"),
        ("  const uint32_t ring_table = ring + STAGES * STAGE_BYTES;\n",
         "  const uint32_t ring_table = ring + STAGES * STAGE_BYTES;\n"
         "  int* s_keys = reinterpret_cast<int*>(mine + STAGES * (STAGE_BYTES + SLOTS * 4));\n"),
    ],
}


def patched(src: str, slots: int, warps: int, stages: int, patch: str = "") -> str:
    assert LINE in src, "the source's constants moved"
    src = src.replace(LINE, f"constexpr int SLOTS = {slots}, WARPS = {warps}, STAGES = {stages};")
    for old, new in PATCHES.get(patch, []):
        assert src.count(old) == 1, f"{patch}: the source moved at {old!r}"
        src = src.replace(old, new)
    return src


def variant_target(source: Path, slots: int, warps: int, stages: int, patch: str = "") -> str:
    src = patched(source.read_text(), slots, warps, stages, patch)
    name = f"s{slots}w{warps}t{stages}{patch}"
    tmp = Path(tempfile.gettempdir()) / f"sparse_score_{name}.cu"
    tmp.write_text(src)
    built = build_library(tmp, find_nvcc())
    log = re.findall(r"Used \d+ registers|\d+ bytes spill stores",
                     built.with_suffix(".log").read_text())
    target = f"sparrow_score_{name}"
    handler = ctypes.CDLL(str(built)).SparrowSparseScore
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="CUDA")
    print(f"{name}: built, ptxas {log}", flush=True)
    return target


def score(target, q, cent, table, lengths, blocks):
    b, hkv, m = q.shape[0], cent.shape[0], table.shape[1]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((b, hkv, m), jnp.int32))
    return call(q, cent, table, lengths, page_size=np.int64(P), blocks=np.int64(blocks))


def xla_score(q, cent, table, lengths):
    """The scoring's keys in XLA: each slot's centroid gathered, times the mean of its KV
    head's queries, summed in float32 (one reduction fusion if XLA fuses the gather)."""
    b, hq, d = q.shape
    hkv, m = cent.shape[0], table.shape[1]
    qbar = jnp.sum(q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d), axis=2) / (hq // hkv)
    pages = jnp.take(cent, table, axis=1).astype(jnp.float32)           # [Hkv, B, M, D]
    score = jnp.sum(pages * jnp.swapaxes(qbar, 0, 1)[:, :, None, :], axis=-1)
    n = num_pages(lengths, P)
    slot = jnp.arange(m)
    eligible = (slot[None] >= 1) & (slot[None] < n[:, None] - 2)        # [B, M]
    keys = jnp.where(eligible[None], order_key(score), jnp.int32(-2 ** 31))
    return jnp.swapaxes(keys, 0, 1)


def scores_of(keys):
    keys = np.asarray(keys, np.int32)
    bits = np.where(keys < 0, keys ^ np.int32(0x7FFFFFFF), keys).astype(np.int32)
    return bits.view(np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", type=Path, help="the kernel's .cu file (for --variants)")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 8, 1])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--variants", default="s16w8t4,s16w8t6,s16w16t3,s32w8t3,s32w4t6,s16w4t4x2",
                    help="sSwWtT[xN][:PATCH]: SLOTS, WARPS, STAGES, N blocks an SM, and a "
                         "patch of the keys' stores (nowrite, late)")
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--sorted", action="store_true",
                    help="each row's pages in increasing pool order (the reads' locality)")
    ap.add_argument("--contiguous", action="store_true",
                    help="row b's pages b * M .. b * M + M - 1: each (row, KV head)'s centroids "
                         "one contiguous run")
    ap.add_argument("--xla-score", action="store_true",
                    help="also time the scoring written in XLA (a gather, products, a sum)")
    ap.add_argument("--xla-sum", action="store_true",
                    help="also time XLA summing the whole centroid array (the same bytes)")
    ap.add_argument("--once", action="store_true",
                    help="each case called once, untimed (for Nsight Compute)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    specs = []
    for v in filter(None, args.variants.split(",")):
        *numbers, patch = re.fullmatch(r"s(\d+)w(\d+)t(\d+)(?:x(\d+))?(?::(\w+))?", v).groups()
        s, w, t, x = (int(g or 1) for g in numbers)
        specs.append((v, variant_target(args.source, s, w, t, patch or ""), x))
    rows = []
    for b in args.batches:
        m = args.context // P
        q, _, _, cent, table, lengths = decode_inputs(
            b, args.context, np.random.default_rng(0).permutation(b * m))
        nbytes = b * HKV * (m - 3) * 128 * 2
        if args.sorted:
            table = jnp.sort(table, axis=1)
        if args.contiguous:
            table = jnp.arange(b * m, dtype=jnp.int32).reshape(b, m)
        tuning = GpuDecodeTuning().resolve(page_size=P, batch=b, kv_heads=HKV,
                                                         max_pages=128)
        ref = np.asarray(score_keys(q, cent, table, lengths, page_size=P, tuning=tuning))
        cases = [("pallas", lambda q_, c_, t_, l_: score_keys(q_, c_, t_, l_, page_size=P,
                                                              tuning=tuning))]
        for name, target, x in specs:
            cases.append((name, lambda q_, c_, t_, l_, _t=target, _n=x * sm_count():
                          score(_t, q_, c_, t_, l_, _n)))
        if args.xla_score:
            cases.append(("xla_score", lambda q_, c_, t_, l_: xla_score(q_, c_, t_, l_)))
        if args.xla_sum:
            # The same bytes read by XLA: every centroid once, summed (a same-size ceiling;
            # scaled by a query element so that the chain's calls stay distinct).
            cases.append(("xla_sum", lambda q_, c_, t_, l_: jnp.full(
                (b, HKV, m), jnp.sum(c_ * q_[0, 0, 0], dtype=jnp.float32) > 1e30, jnp.int32)))
        for name, fn in cases:
            keys = np.asarray(jax.jit(fn)(q, cent, table, lengths))
            if name == "xla_sum":
                keys = ref
            if args.once:
                continue
            ok = ref != np.int32(-2 ** 31)
            row = dict(batch=b, variant=name, bytes=nbytes,
                       same_ineligible=bool(np.array_equal(keys == -2 ** 31, ~ok)),
                       max_score_diff=float(np.max(np.abs(scores_of(keys)[ok]
                                                          - scores_of(ref)[ok]))))

            def step(q_, c_, t_, l_, fn=fn):
                return q_ + (fn(q_, c_, t_, l_)[:, :, 1].sum() == -1).astype(q_.dtype)
            if args.trace:
                run = chained(step, args.chain)
                jax.block_until_ready(run(q, cent, table, lengths))
                lines = profile_calls(run, (q, cent, table, lengths), args.chain)
                busiest = max(lines.values(), key=lambda e: e["total_us"])
                row["device_us"] = {e["name"][:40]: round(e["us"], 2) for e in busiest["top"]}
            else:
                row["us"] = 1e6 * marginal_seconds(step, (q, cent, table, lengths), args.chain,
                                                   args.repeats)
                row["gb_per_s"] = nbytes / row["us"] / 1e3
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=jax.devices()[0].device_kind,
                                                  argv=sys.argv[1:], rows=rows), indent=1))


if __name__ == "__main__":
    main()
