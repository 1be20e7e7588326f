"""docs/quickstart.ipynb runs top to bottom (its code cells executed in order, as a kernel would,
from the repository root, plots on the Agg backend), and what it prints holds up: the replayed
log-probs equal the recorded ones, its tails are NumPy's percentiles, its schedule is the
smallest budget per bin that reaches the target, and the GRPO step's metrics are finite."""

import json
import math
import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_notebook_runs_and_its_figures_hold():
    import matplotlib

    matplotlib.use("Agg")
    nb = json.loads((ROOT / "docs" / "quickstart.ipynb").read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(cells) >= 6 and all(not c["outputs"] for c in cells)   # committed without outputs
    ns: dict = {}
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for i, cell in enumerate(cells):
            exec(compile("".join(cell["source"]), f"quickstart.ipynb[{i}]", "exec"), ns)
    finally:
        os.chdir(cwd)

    assert ns["gap"] < 2e-4
    mask, positions = ns["mask"], ns["positions"]
    bins = np.minimum(positions // ns["bin_tokens"], ns["num_bins"] - 1)
    column = ns["budgets"].index(2)                          # top-k 2 = 5 pages in all
    for b in range(ns["num_bins"]):
        sel = ns["alpha5"][mask & (bins == b)]
        if sel.size >= 8:
            np.testing.assert_allclose(ns["tails"][b, column], np.percentile(sel, 5), atol=1e-5)
        else:
            assert np.isnan(ns["tails"][b, column])
    table, tails, budgets = ns["schedule"].table, ns["tails"], ns["budgets"]
    for b in ns["measured"]:
        ok = [k for k, t in zip(budgets, tails[b]) if t >= 0.86]
        assert table[b] >= (ok[0] if ok else budgets[-1])
    assert list(table) == sorted(table)
    m = ns["metrics"]
    assert all(math.isfinite(m[k]) for k in ("reward_mean", "loss", "alpha_paper_mean"))
    assert ns["trainer"].step == 1
