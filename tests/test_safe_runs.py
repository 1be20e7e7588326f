"""Runs that cannot be silently corrupted: run folders hold one run, a resume refuses a config that
changes the results, and SIGINT/SIGTERM (in the rollout or in the update) leave a checkpoint from
which ``--resume`` reproduces the uninterrupted run's metrics exactly.

Signals are sent to this process from inside the step (a wrapped sampler or update), so they land
in a known phase; the handlers are the trainer's own.
"""

import json
import os
import signal

import numpy as np
import pytest
import yaml
from test_trainer import _config, dense_sampler

from sparrow_jax.cli import main
from sparrow_jax.config import ConfigError, from_dict
from sparrow_jax.rl import trainer as trainer_mod
from sparrow_jax.rl.config import TrainConfig
from sparrow_jax.rl.interrupt import TrainingInterrupted
from sparrow_jax.rl.run_dir import RunDirError, result_changes
from sparrow_jax.rl.update import PolicyUpdater

STEPS = 4


def _cfg(run_dir, **over):
    return from_dict(TrainConfig, _config(run_dir, **{"steps": STEPS, "eval_every": 0, **over}))


def _sampler():
    return dense_sampler(6, 1.0)


def _metrics(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time_", "tokens_per_s"))}
            for r in rows]


def _steps(run_dir):
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's metrics."""
    run_dir = tmp_path_factory.mktemp("reference")
    trainer_mod.train(_cfg(run_dir), rollout_fn=_sampler())
    return _metrics(run_dir)


def _signal_in_rollout(signum, at_call):
    inner, calls = _sampler(), []

    def rollout_fn(model, prompts, key, n):
        calls.append(1)
        if len(calls) == at_call:
            os.kill(os.getpid(), signum)  # the handler abandons the step right here
        return inner(model, prompts, key, n)

    return rollout_fn


def test_sigterm_in_rollout_saves_the_state_before_the_step(tmp_path, reference, monkeypatch,
                                                            capsys):
    """Through the CLI: exit status 128+15, one line saying how to resume, a checkpoint of the
    state before the abandoned step (step 2), and a resume equal to the uninterrupted run."""
    run_dir = tmp_path / "run"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_config(run_dir, steps=STEPS, eval_every=0)))
    monkeypatch.setattr(trainer_mod, "engine_rollout_fn",
                        lambda config, schedule: _signal_in_rollout(signal.SIGTERM, 3))
    rc = main(["train", "--config", str(path)])
    err = capsys.readouterr().err
    assert rc == 128 + signal.SIGTERM, err
    assert f"resume with: sparrow train --config {path} --resume" in err
    assert "Traceback" not in err
    assert _steps(run_dir)[-1] == 2 and len(_metrics(run_dir)) == 2

    monkeypatch.setattr(trainer_mod, "engine_rollout_fn", lambda config, schedule: _sampler())
    assert main(["train", "--config", str(path), "--resume"]) == 0
    assert _metrics(run_dir) == reference


def test_sigint_in_update_finishes_the_step_then_saves(tmp_path, reference, monkeypatch):
    run_dir = tmp_path / "run"
    update, calls = PolicyUpdater.update, []

    def interrupted_update(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # noted; the update still runs to the end
        return update(self, *args, **kwargs)

    monkeypatch.setattr(PolicyUpdater, "update", interrupted_update)
    with pytest.raises(TrainingInterrupted, match="SIGINT before step 2") as e:
        trainer_mod.train(_cfg(run_dir, checkpoint_every=10), rollout_fn=_sampler())
    assert e.value.exit_status == 130
    assert _steps(run_dir) == [2] and len(_metrics(run_dir)) == 2
    monkeypatch.setattr(PolicyUpdater, "update", update)
    trainer_mod.train(_cfg(run_dir), resume=True, rollout_fn=_sampler())
    assert _metrics(run_dir) == reference


def test_run_folders_hold_one_run(tmp_path, reference):
    run_dir = tmp_path / "run"
    trainer_mod.train(_cfg(run_dir, steps=2), rollout_fn=_sampler())
    # A fresh run into the used folder refuses, naming it and the ways out.
    with pytest.raises(RunDirError, match=f"run folder {run_dir} holds another run "
                       r"\(checkpoints 2; metrics.jsonl\).*--resume.*"
                       "--overwrite.*--run-dir"):
        trainer_mod.train(_cfg(run_dir), rollout_fn=_sampler())
    # A resume under a config that changes the results refuses, naming the keys.
    for over, key in [({"seed": 4}, "seed"), ({"optim": {"learning_rate": 2e-2}},
                                              "optim.learning_rate")]:
        with pytest.raises(RunDirError, match=f"cannot resume .*{key}"):
            trainer_mod.train(_cfg(run_dir, **over), resume=True, rollout_fn=_sampler())
    # More steps and another micro-batch size continue the run.
    trainer_mod.train(_cfg(run_dir, steps=3, update={"micro_batch_size": 4}), resume=True,
                      rollout_fn=_sampler())
    assert [r["step"] for r in _metrics(run_dir)] == [0, 1, 2]
    # The micro-batch size changes only the summation order: the same run, up to rounding (and,
    # on a GPU, where a recompiled sampler may round differently, a flipped near-tie token).
    np.testing.assert_allclose(_metrics(run_dir)[2]["loss"], reference[2]["loss"], rtol=1e-2)
    # --overwrite starts clean: the old checkpoints are gone, the run equals the reference.
    trainer_mod.train(_cfg(run_dir), overwrite=True, rollout_fn=_sampler())
    assert _steps(run_dir) == [2, 4] and _metrics(run_dir) == reference


def test_result_changes_names_what_changes_results():
    a = {"seed": 0, "steps": 5, "update": {"micro_batch_size": 2, "epochs": 1},
         "rollout": {"engine": {"page_size": 16, "steps_per_call": 64}}}
    b = {"seed": 0, "steps": 9, "update": {"micro_batch_size": 8, "epochs": 2},
         "rollout": {"engine": {"page_size": 32, "steps_per_call": 8}}}
    assert result_changes(a, b) == ["rollout.engine.page_size", "update.epochs"]
    assert result_changes(a, {**a, "mesh": {"data": 2}}) == []


def test_resume_without_checkpoint_and_resume_with_overwrite_refuse(tmp_path):
    with pytest.raises(RunDirError, match="no checkpoint in .*without --resume"):
        trainer_mod.train(_cfg(tmp_path / "empty"), resume=True, rollout_fn=_sampler())
    with pytest.raises(ConfigError, match="give one of them"):
        trainer_mod.train(_cfg(tmp_path / "x"), resume=True, overwrite=True)
