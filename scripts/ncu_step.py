"""The sparse decode step (one layer, 32K, budget 2048, GQA 32/8, page 16, bf16; the inputs of
``bench_decode.py``) run a few times with CUDA graphs off, for Nsight Compute to profile its
kernels one launch at a time:

    ncu --clock-control none -k regex:sparse_decode --launch-skip 3 --launch-count 3 \
        --set full -o step python3 scripts/ncu_step.py --batch 8
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_gpu_enable_command_buffer=").strip()

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import P, decode_inputs  # noqa: E402

from pallas_kernels.sparse_decode_gpu import sparse_decode_pallas  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    b, ctx = args.batch, args.context
    n_total = b * (ctx // P)
    q, k_pages, v_pages, centroids, table, lengths = decode_inputs(
        b, ctx, np.random.default_rng(0).permutation(n_total))
    budgets = jnp.full((b,), args.budget // P, jnp.int32)
    step = jax.jit(lambda q_: sparse_decode_pallas(
        q_, k_pages, v_pages, table, lengths, budgets, centroids=centroids, page_size=P,
        max_budget_pages=args.budget // P))
    for _ in range(args.calls):
        q = step(q).astype(jnp.bfloat16)
    jax.block_until_ready(q)
    print("done", b, ctx, flush=True)


if __name__ == "__main__":
    main()
