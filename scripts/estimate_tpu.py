"""Print the TPU decode-step estimate (sparrow_jax.tpu_cost) as a markdown table: dense and sparse
attention per layer at 32K context, budget 2048 tokens, batch 8/32/64, pages 16/32/64, on v5e,
v5p and v6e under two assumed per-copy costs. Estimates, not measurements."""

from __future__ import annotations

import argparse

from sparrow_jax.tpu_cost import estimate_table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget-tokens", type=int, default=2048)
    ap.add_argument("--copies-per-page", default="",
                    help="measured copies per chosen page, e.g. '16:0.4,32:0.6' (default 1)")
    args = ap.parse_args(argv)
    rates = {int(k): float(v) for k, v in
             (kv.split(":") for kv in args.copies_per_page.split(",") if kv)}
    print(estimate_table(context=args.context, budget_tokens=args.budget_tokens,
                         copies_per_page=rates))


if __name__ == "__main__":
    main()
