"""scripts/bench_grpo.py's composition of a GRPO step from a refill-model rollout and measured
training, against a hand-worked example."""

from __future__ import annotations

import json

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def bench_grpo():
    return load_script("bench_grpo")


def run(schedule, recompute, update, tokens):
    return dict(schedule=schedule, mean_after_first=dict(
        time_recompute=recompute, time_update=update, response_tokens=tokens))


MODEL = dict(model="qwen3-1.7b", tokens=1000, max_new=32768, rows=4, slots=2,
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


def write(path, data):
    path.write_text(json.dumps(data))
    return str(path)


def split_model(tmp_path, **dense_changes):
    """MODEL as bench_rollout writes it: one file per mode (the dense one changed as asked)."""
    sparse = write(tmp_path / "sparse.json",
                   {**MODEL, "modes": {"sparse": MODEL["modes"]["sparse"]}})
    dense = write(tmp_path / "dense.json",
                  {**MODEL, "modes": {"dense": MODEL["modes"]["dense"]}, **dense_changes})
    return sparse, dense


def test_a_saved_training_run_composes_both_files_without_training(bench_grpo, tmp_path, capsys):
    """The hand-worked case above from two files and a saved run: 1.9x, and no step run."""
    saved = run("paper:qwen3-1.7b", 1.0, 9.0, 200)
    saved["mean_after_first"].update(time_rollout=1.0, wall_s=11.0, tokens_per_s=1.0,
                                     step_tokens_per_s=1.0)
    training = write(tmp_path / "grpo.json", dict(
        device="H100", model="qwen3-1.7b", max_new=32768, rows=2,
        runs=[dict(saved, peak_bytes=0)]))
    out = tmp_path / "out.json"
    bench_grpo.main(["--rollout-model", *split_model(tmp_path), "--training-json", training,
                     "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["composed"]["sparse_over_dense"] == pytest.approx(1.9)
    assert got["device"] == "H100" and "step 0" not in capsys.readouterr().out


@pytest.mark.parametrize("change,match", [
    (dict(rows=8), "rows 8, but 4 in"),
    (dict(modes={"sparse": {"refill": {"seconds": 1.0}}}), "mode 'sparse' is in")])
def test_rollout_models_of_different_mixes_are_refused(bench_grpo, tmp_path, change, match):
    sparse, dense = split_model(tmp_path, **change)
    with pytest.raises(SystemExit) as e:
        bench_grpo.main(["--tiny", "--rollout-model", sparse, dense])
    assert f"--rollout-model {dense}: " in str(e.value) and match in str(e.value)


@pytest.mark.parametrize("content,match", [
    ("[]", "not a bench_grpo.py --out JSON"),
    (json.dumps(dict(model="qwen3-1.7b", max_new=8192, runs=[run("dense", 0, 1, 1)])),
     "max_new 8192, but the rollout model's is 32768")])
def test_a_bad_training_json_is_refused(bench_grpo, tmp_path, content, match):
    path = tmp_path / "grpo.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as e:
        bench_grpo.main(["--rollout-model", *split_model(tmp_path), "--training-json", str(path)])
    assert f"--training-json {path}: " in str(e.value) and match in str(e.value)
