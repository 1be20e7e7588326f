"""Bad input through the CLI, table-driven: every case exits non-zero with one message naming the
culprit (file, key, value) and no traceback, before any training or sampling starts."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import hf_case

from sparrow_jax.cli import main
from sparrow_jax.rl.config import load_train_config

ROOT = Path(__file__).resolve().parent.parent
DEMO = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
MODEL = Path(hf_case("tied_gqa1")["path"])


def _train_yaml(tmp_path, edit):
    data = json.loads(json.dumps(DEMO))
    data["model"]["path"] = str(ROOT / data["model"]["path"])
    data["run_dir"] = str(tmp_path / "run")
    edit(data)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _model_folder(tmp_path, config_edit=None, weights=None):
    folder = tmp_path / "model"
    shutil.copytree(MODEL, folder)
    if config_edit:
        cfg = json.loads((folder / "config.json").read_text())
        config_edit(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights(
            (folder / "model.safetensors").read_bytes()))
    return folder


def _set(*path_and_value):
    *keys, value = path_and_value

    def edit(d):
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
    return edit


# (name, argv builder taking tmp_path, text the one-line message must hold)
TRAIN_CASES = [
    ("misspelt reward", _set("reward", "needel"), ["run.yaml", "reward 'needel'", "'needle'"]),
    ("misspelt key", _set("optim", "learning_rat", 1.0), ["run.yaml", "'learning_rat'",
                                                          "'learning_rate'"]),
    ("string number", _set("optim", "learning_rate", "fast"), ["run.yaml",
                                                               "optim.learning_rate", "'fast'"]),
    ("num_eval 0", _set("data", "num_eval", 0), ["run.yaml", "data.num_eval", "0"]),
    ("decreasing table", _set("schedule", {"kind": "table", "table": [8, 4]}),
     ["run.yaml", "schedule", "non-decreasing", "8 then 4"]),
    ("engine typo", _set("rollout", "engine", "page_sise", 4), ["rollout.engine",
                                                                "'page_sise'", "'page_size'"]),
    ("engine top_p", _set("rollout", "engine", "top_p", 0.5), ["rollout.engine.top_p", "0.5",
                                                               "temperature only"]),
    ("engine page size 0", _set("rollout", "engine", "page_size", 0), ["rollout.engine",
                                                                       "page_size", "0"]),
    ("schedule page size", _set("rollout", "engine", "page_size", 32),
     ["schedule.page_size", "16", "32"]),
    ("steps not an int", _set("steps", 2.5), ["run.yaml", "steps", "2.5"]),
    ("bool as text", _set("tensorboard", "yes"), ["tensorboard", "'yes'"]),
    ("unknown paper schedule", _set("schedule", {"paper": "qwen3-1.8b"}),
     ["schedule.paper", "'qwen3-1.8b'", "'qwen3-1.7b'"]),
    ("unknown task", _set("data", "task", "needles"), ["data.task", "'needles'"]),
    ("missing model folder", _set("model", "path", "/no/such/model"), ["/no/such/model"]),
]


@pytest.mark.parametrize("name, edit, expected", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_config_errors(tmp_path, capsys, name, edit, expected):
    rc = main(["train", "--config", str(_train_yaml(tmp_path, edit)), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("sparrow train: error: "), err
    for text in expected:
        assert text in err, (text, err)
    assert not (tmp_path / "run" / "checkpoints").exists()


MODEL_CASES = [
    ("garbage weights", None, lambda b: b"not a safetensors file at all",
     ["model.safetensors", "not a readable safetensors file"]),
    ("truncated weights", None, lambda b: b[:len(b) // 2],
     ["model.safetensors", "not a readable safetensors file"]),
    ("rope_theta text", lambda c: c.pop("rope_parameters") and c.update(rope_theta="x"), None,
     ["config.json", "rope_theta", "'x'"]),
    ("rope_parameters text", _set("rope_parameters", "rope_theta", "x"), None,
     ["config.json", "rope_parameters.rope_theta", "'x'"]),
    ("negative max positions", _set("max_position_embeddings", -5), None,
     ["config.json", "max_position_embeddings", "-5"]),
    ("float layer count", _set("num_hidden_layers", 2.5), None,
     ["config.json", "num_hidden_layers", "2.5"]),
    ("invalid json", None, None, ["config.json", "not valid JSON"]),
]


@pytest.mark.parametrize("name, config_edit, weights, expected", MODEL_CASES,
                         ids=[c[0] for c in MODEL_CASES])
def test_model_folder_errors(tmp_path, capsys, name, config_edit, weights, expected):
    folder = _model_folder(tmp_path, config_edit, weights)
    if name == "invalid json":
        (folder / "config.json").write_text("{nope")
    rc = main(["generate", "--model", str(folder), "--prompt-ids", "1,2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    for text in expected:
        assert text in err, (text, err)


CLI_CASES = [
    (["generate", "--preset", "tiny", "--prompt-ids", "1", "--page-size", "0"],
     ["--page-size", "positive integer, got 0"]),
    (["generate", "--preset", "tiny", "--prompt-ids", "1", "--temperature", "-1"],
     ["--temperature", "-1"]),
    (["generate", "--preset", "tiny", "--prompt-ids", "1", "-n", "zero"], ["-n", "'zero'"]),
    (["train", "--config", "configs/demo.yaml", "--steps", "0"], ["--steps", "got 0"]),
    (["bench", "--batches", "0"], ["--batches", "positive integer, got 0"]),
]


@pytest.mark.parametrize("argv, expected", CLI_CASES, ids=[" ".join(c[0][:1] + c[0][-2:])
                                                           for c in CLI_CASES])
def test_command_line_errors(capsys, argv, expected):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    for text in expected:
        assert text in err, (text, err)


def test_option_file_values_are_checked_like_options(tmp_path, capsys):
    path = tmp_path / "gen.yaml"
    path.write_text("preset: tiny\nprompt_ids: '1'\nmax_new_tokens: ten\n")
    assert main(["generate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "gen.yaml" in err and "max_new_tokens" in err and "'ten'" in err, err


def test_yaml_exponent_numbers_are_numbers(tmp_path):
    """PyYAML reads ``1e-4`` (no dot) as a string; configs take it as the number it means."""
    path = _train_yaml(tmp_path, _set("optim", "learning_rate", "1e-4"))
    path.write_text(path.read_text().replace("'1e-4'", "1e-4"))
    assert "learning_rate: 1e-4" in path.read_text()
    assert load_train_config(path).optim.learning_rate == 1e-4


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    listed = out.split("COMMAND", 2)[-1]
    for name in ("generate", "train", "plot", "calibrate", "bench"):
        assert name in listed
    assert "not built" not in out


@pytest.mark.parametrize("command, config_help", [("generate", "file of option values"),
                                                  ("train", "TrainConfig")])
def test_long_running_subcommands_take_no_progress(capsys, command, config_help):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "--no-progress" in out and config_help in out
