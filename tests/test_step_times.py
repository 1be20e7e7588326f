"""Measured step times (sparrow_jax/step_times.py) against hand-worked sums."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparrow_jax.schedule import BudgetSchedule
from sparrow_jax.step_times import load_step_times, measured_speedup

P = 4
# Dense: 1 + 0.01 * context ms; sparse: 1 + 0.001 * context + 0.01 * read ms, read = min(context,
# budget * P) tokens. Three sparse points determine the law exactly.
DENSE = [{"context": 10, "step_ms": 1.1}, {"context": 110, "step_ms": 2.1}]
SPARSE = [{"context": 40, "budget_pages": 3, "step_ms": 1.16},      # read 12
          {"context": 100, "budget_pages": 5, "step_ms": 1.3},      # read 20
          {"context": 120, "budget_pages": 10, "step_ms": 1.52}]    # read 40


def _write(tmp_path, data, name="steps.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_measured_speedup_by_hand(tmp_path):
    times = load_step_times(_write(tmp_path, {"batch": 19, "dense": DENSE, "sparse": SPARSE}))
    # Lengths 101..103 at 5 pages (6..7 pages in use: sparse, 20 tokens read):
    # sparse 1.301 + 1.302 + 1.303 = 3.906 ms, dense 2.01 + 2.02 + 2.03 = 6.06 ms.
    out = measured_speedup(times, BudgetSchedule.fixed(5, page_size=P), 100, 3, page_size=P)
    assert out["dense_s"] == pytest.approx(6.06e-3) and out["schedule_s"] == pytest.approx(3.906e-3)
    assert out["speedup"] == pytest.approx(6.06 / 3.906, abs=1e-4)
    assert out["fit_residual"] < 1e-9 and out["batch"] == 19 and not out["extrapolated"]
    # Lengths 17..20 hold at most 5 pages: the budget covers them, the steps are dense.
    out = measured_speedup(times, BudgetSchedule.fixed(5, page_size=P), 16, 4, page_size=P)
    assert out["speedup"] == pytest.approx(1.0)
    # Past the measured contexts: flagged.
    assert measured_speedup(times, BudgetSchedule.fixed(5, page_size=P), 200, 3,
                            page_size=P)["extrapolated"]


def test_reads_the_rollout_profile_json(tmp_path):
    """scripts/bench_rollout.py --phase profile: rows at their mean_context."""
    def rows(points, **extra):
        return [{"context": p["context"] + 7, "mean_context": p["context"], **p, **extra}
                for p in points]
    data = {"phase": "profile", "batch": 19,
            "modes": {"dense": {"rows": rows(DENSE)}, "sparse": {"rows": rows(SPARSE)}}}
    times = load_step_times(_write(tmp_path, data))
    np.testing.assert_array_equal(times.sparse_context, [40, 100, 120])
    out = measured_speedup(times, BudgetSchedule.fixed(5, page_size=P), 100, 3, page_size=P)
    assert out["speedup"] == pytest.approx(6.06 / 3.906, abs=1e-4)


@pytest.mark.parametrize("data, expected", [
    ({"dense": DENSE}, "sparse: needs a list of at least 3 points"),
    ({"dense": DENSE[:1], "sparse": SPARSE}, "dense: needs a list of at least 2"),
    ({"dense": DENSE, "sparse": [dict(SPARSE[0], step_ms=-1)] + SPARSE[1:]},
     "sparse[0].step_ms: must be a positive number, got -1"),
    ({"dense": DENSE, "sparse": [{k: v for k, v in SPARSE[0].items() if k != "budget_pages"}]
      + SPARSE[1:]}, "sparse[0].budget_pages: must be a positive number, got None"),
    ({"dense": DENSE, "sparse": SPARSE, "batch": 0}, "batch: must be a positive int"),
    ({"modes": {"dense": {"rows": []}}}, "modes.dense.rows: needs a list"),
])
def test_bad_files_are_named(tmp_path, data, expected):
    path = _write(tmp_path, data)
    with pytest.raises(ValueError) as e:
        load_step_times(path)
    assert str(path) in str(e.value) and expected in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_unusable_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="no file"):
        load_step_times(tmp_path / "nope.json")
    (tmp_path / "cut.json").write_text("{")
    with pytest.raises(ValueError, match="cut.json: not a JSON file"):
        load_step_times(tmp_path / "cut.json")
    # Sparse points at one budget, read proportional to context: the law is not determined.
    flat = [{"context": c, "budget_pages": 100, "step_ms": 1.0 + c / 100} for c in (8, 40, 80)]
    times = load_step_times(_write(tmp_path, {"dense": DENSE, "sparse": flat}))
    with pytest.raises(ValueError, match="do not determine"):
        measured_speedup(times, BudgetSchedule.fixed(5, page_size=P), 100, 3, page_size=P)


def test_the_model_predicts_a_measured_h100_profile(tmp_path):
    """The H100 profile of 2026-11-22 (Qwen3-1.7B shape, batch 19, the paper schedule at 11
    contexts, notes/bench_runs/): the three-term fit holds every sparse point within 3%, and
    the speedup it integrates over 0..32K agrees with the benchmark's own interpolated integral
    within 1%."""
    from pathlib import Path

    data = json.loads((Path(__file__).parents[1] / "notes/bench_runs/"
                       "2026-11-22_rollout_D_profile.json").read_text())
    paper = BudgetSchedule.paper("qwen3-1.7b")
    for row in data["modes"]["sparse"]["rows"]:   # the run predates budget_pages in its rows
        row["budget_pages"] = int(paper.budget_pages(int(row["mean_context"])))
    out = measured_speedup(load_step_times(_write(tmp_path, data)), paper, 32, 32768,
                           page_size=16)
    assert out["fit_residual"] < 0.03
    assert out["speedup"] == pytest.approx(data["ratio"], rel=0.01)
