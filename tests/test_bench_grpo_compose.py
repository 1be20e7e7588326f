"""scripts/bench_grpo.py's composition of a GRPO step from a refill-model rollout and measured
training, against a hand-worked example."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_grpo():
    spec = importlib.util.spec_from_file_location("bench_grpo", REPO / "scripts/bench_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(schedule, recompute, update, tokens):
    return dict(schedule=schedule, mean_after_first=dict(
        time_recompute=recompute, time_update=update, response_tokens=tokens))


MODEL = dict(tokens=1000, max_new=32768, rows=4, slots=2,
             modes={"sparse": {"refill": {"seconds": 50.0}},
                    "dense": {"refill": {"seconds": 140.0}}})


def test_one_schedule_prices_both_modes(bench_grpo):
    """Training 1 + 9 s for 200 tokens = 0.05 s a token, x 1000 tokens = 50 s on each mode:
    sparse 50 + 50 = 100 s, dense 140 + 50 = 190 s, 1.9x."""
    out = bench_grpo.compose([run("paper:qwen3-1.7b", 1.0, 9.0, 200)], MODEL, "m.json")
    assert out["training_s_per_token"] == pytest.approx(0.05)
    assert out["modes"]["sparse"]["step_s"] == pytest.approx(100.0)
    assert out["modes"]["dense"]["step_s"] == pytest.approx(190.0)
    assert out["sparse_over_dense"] == pytest.approx(1.9)


def test_several_runs_average_their_training(bench_grpo):
    """0.05 and 0.03 s a token -> 0.04: training 40 s, (140 + 40) / (50 + 40) = 2.0x."""
    out = bench_grpo.compose([run("paper:qwen3-1.7b", 0.0, 10.0, 200),
                              run("dense", 0.0, 6.0, 200)], MODEL, "m.json")
    assert out["modes"]["sparse"]["training_s"] == pytest.approx(40.0)
    assert out["sparse_over_dense"] == pytest.approx(2.0)


@pytest.mark.parametrize("content,match", [
    ("{", "m.json: "),
    (json.dumps({"tokens": 1}), "missing"),
    (json.dumps({**MODEL, "modes": {"sparse": {}}}), "a refill run")])
def test_a_bad_rollout_model_is_refused_before_any_run(bench_grpo, tmp_path, capsys, content,
                                                      match):
    path = tmp_path / "m.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as e:
        bench_grpo.main(["--tiny", "--rollout-model", str(path)])
    assert f"--rollout-model {path}" in str(e.value) and match in str(e.value)
    assert "step 0" not in capsys.readouterr().out
