"""Probe (session 54; run in session 55, kernel run AX): where the CUDA attention's in-block
choice of pages spends its time.

Kernel run AW: at one row the block's choice (``select_part``) cost ~6 us, as the selection
kernel did, so the time was the choice's chain of rounds, not a launch. This builds the
library's ``sparse_attend_cuda.cu`` with ``%globaltimer`` stamps written by each block's thread
0 at the choice's phases, plus a handler that copies them out (as run AR's phases probe,
``2026-11-29h_cuda_phases_probe.py``, does for the lists' attention), runs the step's own
scoring and then the choosing attention on bench_decode's case, and prints each phase's time
since the block's entry to the choice (median and max over the blocks that reached it):

0 the choice entered, 1 the row's keys and pages in shared memory, 2-5 each round of the
threshold search done (2 the first; a round the search did not need has no stamp), 6 ties
and ranks scanned, 7 the part staged, 8 the part's pages streamed, 9 the block's end (the
warps' or the cluster's merge). Its anchors follow the kernel as of 985d899 (run AX ran it
on d1d2ca1's kernel with the anchors of then, which git history keeps).

    python3 notes/bench_runs/2026-11-30c_select_phases_probe.py --batches 1 8 --out ..
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_decode import HKV, P, decode_inputs  # noqa: E402
from pallas_kernels import sparse_attend_cuda as sac  # noqa: E402
from pallas_kernels.cuda_build import build_library, find_nvcc  # noqa: E402
from pallas_kernels.sparse_decode_gpu import GpuDecodeTuning, scored_table  # noqa: E402

# Run AR's phases probe beside this file: its stamps (``rec(k)``: each block's thread 0 writes
# %globaltimer and clock64 for phase k), their reader's handler, and its record.
_spec = importlib.util.spec_from_file_location(
    "phases_probe", Path(__file__).with_name("2026-11-29h_cuda_phases_probe.py"))
phases_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(phases_probe)
MAX_BLOCKS, PHASES = phases_probe.MAX_BLOCKS, phases_probe.PHASES
PRELUDE, READER, TAIL = phases_probe.PRELUDE, phases_probe.READER, phases_probe.TAIL

EDITS = [   # (anchor, replacement): each anchor must occur once
    ("constexpr int LIST_UNITS = 8;\n", "constexpr int LIST_UNITS = 8;\n" + PRELUDE),
    ("  const bool take_all = n <= budget, search = !take_all && k > 0;\n",
     "  const bool take_all = n <= budget, search = !take_all && k > 0;\n  rec(0);\n"),
    ("  // Thread t holds slots [lo, hi)", "  rec(1);\n  // Thread t holds slots [lo, hi)"),
    ("      const int count = search_round(h_r, shift, &prefix, &need);\n",
     "      const int count = search_round(h_r, shift, &prefix, &need);\n      rec(2 + r);\n"),
    ("  const int sure_before = before >> 16, ties_before = before & 0xffff;\n",
     "  const int sure_before = before >> 16, ties_before = before & 0xffff;\n  rec(6);\n"),
    ("  __syncthreads();   // the list staged, and the ring free for the pages\n",
     "  __syncthreads();   // the list staged, and the ring free for the pages\n  rec(7);\n"),
    ("        attend(i, part.x, part.y, a, true);\n",
     "        attend(i, part.x, part.y, a, true);\n        rec(8);\n"),
    ("        finish(i, a, v, static_cast<int64_t>(i) * splits, splits);\n        continue;\n",
     "        finish(i, a, v, static_cast<int64_t>(i) * splits, splits);\n        rec(9);\n"
     "        continue;\n"),
    ("}  // namespace\n", READER + "}  // namespace\n"),
]


def patched_source(edits=EDITS) -> str:
    src = sac.SOURCE.read_text()
    for anchor, new in edits:
        assert src.count(anchor) == 1, anchor
        src = src.replace(anchor, new)
    return src + TAIL


def build(edits=EDITS) -> Path:
    path = Path(tempfile.gettempdir()) / "sparse_attend_select_phases.cu"
    path.write_text(patched_source(edits))
    return build_library(path, find_nvcc())


def register(lib: Path) -> None:
    handle = ctypes.CDLL(str(lib))
    for sym, target in (("SparrowSparseSelectAttend", "sparrow_select_attend_phases"),
                        ("SparrowPhases", "sparrow_read_phases")):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, sym)),
                                    platform="CUDA")


def case(b: int, context: int, budget: int):
    """bench_decode's case at batch ``b``: q, pages, the step's keys and padded table, lengths,
    budgets, the resolved tuning and max_pages."""
    m = context // P
    q, kp, vp, cent, table, lengths = decode_inputs(
        b, context, np.random.default_rng(0).permutation(b * m))
    kb = budget // P
    tuning = GpuDecodeTuning(attend="cuda").resolve(page_size=P, batch=b, kv_heads=HKV,
                                                     max_pages=kb)
    keys, table, _ = scored_table(q, cent, table, lengths, page_size=P, max_pages=kb,
                                  tuning=tuning)
    return q, kp, vp, keys, table, lengths, jnp.full((b,), kb, jnp.int32), tuning, kb


def main(edits=EDITS):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--build-only", action="store_true",
                    help="patch and build the library (a host with nvcc, no GPU needed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lib = build(edits)
    print(f"built {lib}", flush=True)
    if args.build_only:
        return
    register(lib)
    rows = []
    for b in args.batches:
        q, kp, vp, keys, table, lengths, budgets, tuning, kb = case(b, args.context, args.budget)
        want = sac.attend_selected_cuda(q, kp, vp, keys, table, lengths, budgets, page_size=P,
                                        max_pages=kb, splits=tuning.splits)

        @jax.jit
        def step(*a):
            out = jax.ffi.ffi_call("sparrow_select_attend_phases",
                                   jax.ShapeDtypeStruct(q.shape, q.dtype))(
                *a, splits=np.int64(tuning.splits), page_size=np.int64(P),
                max_pages=np.int64(kb))
            return out, phases_probe.read_phases(out)

        for _ in range(5):   # warm; the last call's stamps are read
            out, ph = step(q, kp, vp, keys, table, lengths, budgets)
        blocks = b * HKV * tuning.splits
        ph = np.asarray(ph).astype(np.int64)[:blocks, :, 0]   # %globaltimer, ns
        since = ph - ph[:, :1]
        # A round the search did not need leaves its stamp unwritten (0): such phases count
        # only the blocks that reached them.
        phases = {k: dict(median_us=float(np.median(since[hit, k])) / 1e3,
                          max_us=float(since[hit, k].max()) / 1e3, blocks=int(hit.sum()))
                  for k in range(1, PHASES) if (hit := ph[:, k] > 0).any()}
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))
        row = dict(batch=b, blocks=blocks, splits=tuning.splits, max_abs_diff=err,
                   phases=phases)
        print(json.dumps(row), flush=True)
        rows.append(row)
    phases_probe.stages_probe.write_rows(args.out, rows)


if __name__ == "__main__":
    main()
