"""The step watchdog (sparrow_jax/rl/watchdog.py): a run whose step does not finish within
``step_timeout_s`` ends itself with status 124 and says where it was; a run that keeps stepping
is left alone; the limit is checked when the config loads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import tiny_train_config
from sparrow_jax.config import ConfigError, from_dict
from sparrow_jax.rl.config import TrainConfig
from sparrow_jax.rl.watchdog import EXIT_STATUS, StepWatchdog

REPO = Path(__file__).resolve().parents[1]


def test_a_stuck_loop_is_ended_with_the_step_and_every_thread(tmp_path):
    exits = []
    with open(tmp_path / "err", "w+") as stream:
        with StepWatchdog(0.2, describe=lambda: "in step 7", stream=stream, exit=exits.append):
            deadline = time.monotonic() + 5
            while not exits and time.monotonic() < deadline:
                time.sleep(0.02)
        stream.seek(0)
        text = stream.read()
    assert exits == [EXIT_STATUS] == [124]
    first = text.splitlines()[0]
    assert first.startswith("sparrow: no step finished in ")
    assert "(step_timeout_s=0.2); in step 7;" in first
    assert first.endswith("exiting with status 124: resume from the last checkpoint")
    assert "most recent call first" in text and "test_watchdog.py" in text   # the stacks


def test_a_loop_that_keeps_stepping_is_left_alone(tmp_path):
    exits = []
    with open(tmp_path / "err", "w+") as stream:
        with StepWatchdog(0.3, stream=stream, exit=exits.append) as watchdog:
            for _ in range(20):          # 1 s of steps of 0.05 s
                time.sleep(0.05)
                watchdog.beat()
    assert exits == []


def test_a_process_blocked_in_a_call_exits_124():
    """The default exit ends the process even while its main thread waits in a C call (as in a
    collective that never returns)."""
    code = ("import time; from sparrow_jax.rl.watchdog import StepWatchdog\n"
            "StepWatchdog(0.5, describe=lambda: 'in step 3').__enter__(); time.sleep(60)")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=50)
    assert proc.returncode == 124, proc.stderr
    assert time.monotonic() - t0 < 30
    assert "no step finished in" in proc.stderr and "in step 3" in proc.stderr


@pytest.mark.parametrize("value, message", [
    (0, "step_timeout_s must be a positive number of seconds or null, got 0"),
    (-5, "step_timeout_s must be a positive number of seconds or null, got -5"),
    ("soon", "step_timeout_s: expected a number, got 'soon'"),
    (True, "step_timeout_s: expected a number, got True")])
def test_bad_limits_are_refused_at_load(value, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(TrainConfig, {"step_timeout_s": value})
    assert from_dict(TrainConfig, {"step_timeout_s": 3600}).step_timeout_s == 3600


def test_sparrow_train_past_its_limit_exits_124(tmp_path):
    """A real run whose first step (compilation included) outlasts a 1 s limit: status 124, the
    message names step 0, and no checkpoint was written."""
    cfg = tiny_train_config(tmp_path / "run", step_timeout_s=1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "sparrow_jax.cli", "train", "--config",
                           str(path)], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 124, proc.stderr[-2000:]
    assert "(step_timeout_s=1); in step 0;" in proc.stderr, proc.stderr[-2000:]
    assert not list((tmp_path / "run" / "checkpoints").glob("*/"))
