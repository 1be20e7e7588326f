"""Probe (session 55, not yet run): where the choosing CUDA attention's block spends the time
after its pages, at one row.

Kernel run AX's phases probe: at one row (8 parts a list, each list's parts one cluster) a
block's pages are streamed 8.0 us after its choice began and the block ends 2.75 us later,
as long as its pages took. This runs the same case with the stamps moved to the block's end
(the choice probe's build, case and reader, ``2026-11-30c_select_phases_probe.py``), each
phase's time since the choice began (median and max over the blocks):

0 the choice entered, 1 the part staged, 2 warp 0's pages streamed (thread 0's warp), 3 every
warp's pages streamed (merge_warps' first barrier), 4 the warps' partials in shared memory,
5 the warps merged, 6 the cluster's partials visible (its first barrier), 7 the block's
share of the output written, 8 the cluster's last barrier passed.

If 2 -> 3 is most of it, the warps' shares are uneven; if 5 -> 6, the cluster waits on its
slowest block; if 6 -> 7, the remote reads (the lse first, then the partials: two round trips,
where one would do).

    python3 notes/bench_runs/2026-11-30e_select_end_probe.py --batches 1 8 --out ..
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "choice_probe", Path(__file__).with_name("2026-11-30c_select_phases_probe.py"))
choice_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(choice_probe)
PRELUDE, READER = choice_probe.PRELUDE, choice_probe.READER

EDITS = [   # (anchor, replacement): each anchor must occur once
    ("constexpr int LIST_UNITS = 8;\n", "constexpr int LIST_UNITS = 8;\n" + PRELUDE),
    ("  const bool take_all = n <= budget, search = !take_all && k > 0;\n",
     "  const bool take_all = n <= budget, search = !take_all && k > 0;\n  rec(0);\n"),
    ("  __syncthreads();   // the list staged, and the ring free for the pages\n",
     "  __syncthreads();   // the list staged, and the ring free for the pages\n  rec(1);\n"),
    ("        attend(i, part.x, part.y, a, true);\n",
     "        attend(i, part.x, part.y, a, true);\n        rec(2);\n"),
    ("  float* s_l = s_m + WARPS * MAX_GROUP;\n  __syncthreads();\n",
     "  float* s_l = s_m + WARPS * MAX_GROUP;\n  __syncthreads();\n  rec(3);\n"),
    ("    if (tig == 0) s_m[warp * group + g] = a.m, s_l[warp * group + g] = a.l;\n"
     "  }\n  __syncthreads();\n",
     "    if (tig == 0) s_m[warp * group + g] = a.m, s_l[warp * group + g] = a.l;\n"
     "  }\n  __syncthreads();\n  rec(4);\n"),
    ("    emit(idx, den > 0.f ? acc / den : 0.f, den > 0.f ? mm + log2f(den) : -INFINITY);\n"
     "  }\n  __syncthreads();\n",
     "    emit(idx, den > 0.f ? acc / den : 0.f, den > 0.f ? mm + log2f(den) : -INFINITY);\n"
     "  }\n  __syncthreads();\n  rec(5);\n"),
    ("  cluster.sync();   // every block's partial written and visible\n",
     "  cluster.sync();   // every block's partial written and visible\n  rec(6);\n"),
    ("  cluster.sync();   // no block leaves, or reuses its ring, while another reads its "
     "partial\n",
     "  rec(7);\n  cluster.sync();   // no block leaves, or reuses its ring, while another "
     "reads its partial\n  rec(8);\n"),
    ("}  // namespace\n", READER + "}  // namespace\n"),
]

if __name__ == "__main__":
    choice_probe.main(EDITS)
