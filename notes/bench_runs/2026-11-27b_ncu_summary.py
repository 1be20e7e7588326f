"""Summary of the Nsight Compute profile of the sparse step (scripts/ncu_step.py; see
BENCHMARKS.md "Run T"): per kernel, the metrics below from ncu's details page, and for the
selection kernel the share of warp-state samples in each part of its SASS (the part bounds are
instruction indices read off the batch-32 listing: the 2048-slot branch).

    python3 notes/bench_runs/2026-11-27b_ncu_summary.py DIR > notes/bench_runs/2026-11-27b_ncu_summary.json

DIR holds details_b{8,32}.csv and select_sass_b{8,32}.csv (ncu -i REP --page details --csv;
--page source --csv --print-source sass -k regex:select); the SASS listings (1.3 MB each) are
not kept.
"""
import csv
import json
import sys

METRICS = ["Duration", "DRAM Throughput", "Memory Throughput", "SM Frequency",
           "Achieved Occupancy", "Theoretical Occupancy", "Registers Per Thread",
           "Executed Instructions", "Warp Cycles Per Issued Instruction", "No Eligible",
           "L2 Hit Rate", "Waves Per SM"]
PARTS = [(0, 540, "launch, lengths, branch, key and table loads issued"),
         (540, 589, "first count (waits on the key loads)"),
         (589, 657, "threshold rounds (one block-wide count each)"),
         (657, 798, "ties: need, equal count"),
         (798, 1780, "chosen / reserved masks"),
         (1780, 2000, "prefix sum, total, last page"),
         (2000, 2440, "layout conversions of the scattered stores, stores")]

out = {}
d = sys.argv[1]
for b in (8, 32):
    rows = list(csv.reader(open(f"{d}/details_b{b}.csv")))
    idx = {h: i for i, h in enumerate(rows[0])}
    kernels = {}
    for r in rows[1:]:
        if r[idx["Metric Name"]] in METRICS:
            k = kernels.setdefault(r[idx["Kernel Name"]], {"grid": r[idx["Grid Size"]],
                                                         "block": r[idx["Block Size"]]})
            k[r[idx["Metric Name"]]] = f'{r[idx["Metric Value"]]} {r[idx["Metric Unit"]]}'
    body = list(csv.reader(open(f"{d}/select_sass_b{b}.csv")))[2:]
    total = sum(int(r[2] or 0) for r in body)
    kernels["sparse_decode_select"]["sample_share_by_part"] = {
        name: round(sum(int(r[2] or 0) for r in body[a:z]) / total, 3) for a, z, name in PARTS}
    kernels["sparse_decode_select"]["rounds_per_warp"] = round(
        int(body[589][5]) / int(body[0][5]), 2)
    out[f"batch_{b}"] = kernels
json.dump(out, sys.stdout, indent=1)
