"""Two processes, one run: ``jax.distributed`` with a localhost coordinator and gloo CPU
collectives (:mod:`sparrow_jax.distributed`), the demo config (``configs/demo.yaml``) for a few
steps, interrupted by a SIGTERM to both processes mid-rollout, which must leave one checkpoint
that two processes resume: the two launches together must equal the run in one process.

Each process is this file run as a script (``python tests/test_multiprocess.py CONFIG OUT``):
``train()`` with the engine's rollouts recorded, its share of each step's responses written to
``OUT`` as JSON. ``SPARROW_TEST_SIGTERM_AT=k`` makes a process send itself SIGTERM as its k-th
rollout starts (a known phase; the handlers are the trainer's own). The same with DistillSparse,
the closed-loop schedule or the loss's KL term on, and with two devices a process and the
weights split over ``tensor`` (``slow``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
STEPS = 3


def _write_config(tmp: Path, run_dir: Path, **over) -> Path:
    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data.update(run_dir=str(run_dir), steps=STEPS, eval_every=0, tensorboard=False,
                progress=False, checkpoint_every=100, **over)
    data["model"]["path"] = str(REPO / data["model"]["path"])
    path = tmp / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(config: Path, processes: int, *, resume=False, sigterm_at=None, devices=1,
            timeout=300) -> list[dict]:
    """Runs the worker in ``processes`` processes of ``devices`` CPU devices each; -> per
    process: exit code, stderr tail and its recorded responses. Launches of one test share a
    persistent compilation cache (beside ``config``): compiling, not training, is most of a
    launch's time."""
    port = _free_port()
    procs = []
    for i in range(processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   JAX_COMPILATION_CACHE_DIR=str(config.parent / "jax_cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
        env.pop("XLA_FLAGS", None)
        if devices > 1:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        if processes > 1:
            env.update(SPARROW_COORDINATOR=f"127.0.0.1:{port}",
                       SPARROW_NUM_PROCESSES=str(processes), SPARROW_PROCESS_ID=str(i))
        if sigterm_at is not None:
            env["SPARROW_TEST_SIGTERM_AT"] = str(sigterm_at)
        out = config.with_suffix(f".{i}.json")
        args = [sys.executable, __file__, str(config), str(out)] + (["--resume"] if resume
                                                                    else [])
        procs.append((subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True), out))
    results = []
    try:
        for p, out in procs:
            _, err = p.communicate(timeout=timeout)
            results.append({"rc": p.returncode, "err": err[-4000:],
                            "responses": json.loads(out.read_text()) if out.exists() else []})
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
    return results


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time_", "tokens_per_s"))}
            for r in rows]


def _merged(results: list[dict]) -> list[list[list[int]]]:
    """Per step: every process's responses, in process order (rows of the whole batch)."""
    steps = len(results[0]["responses"])
    assert all(len(r["responses"]) == steps for r in results), [len(r["responses"])
                                                                for r in results]
    return [sum((r["responses"][s] for r in results), []) for s in range(steps)]


def _assert_same_metrics(got, want):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert set(g) == set(w), sorted(set(g) ^ set(w))
        for k in w:
            # the absolute floor is for values near 0 that are sums of opposite signs (loss)
            np.testing.assert_allclose(g[k], w[k], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {w['step']} {k}")
        # rewards follow from the tokens alone: bit for bit
        assert (g["reward_mean"], g["reward_std"]) == (w["reward_mean"], w["reward_std"])


# ------------------------------------------------------------------------------ one process
def test_initialize_is_a_no_op_for_one_process_and_names_missing_settings(monkeypatch):
    from sparrow_jax import distributed

    for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
                 distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed, "_initialized", False)
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    with pytest.raises(ValueError, match=r"missing \['coordinator', 'process_id'\]"):
        distributed.initialize()
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match="SPARROW_NUM_PROCESSES must be an int, got 'two'"):
        distributed.initialize()
    with pytest.raises(ValueError, match=r"SPARROW_PROCESS_ID must be in \[0, 2\), got 2"):
        distributed.initialize("127.0.0.1:1", 2, 2)
    monkeypatch.delenv(distributed.ENV_NUM_PROCESSES)
    assert distributed.initialize() is False and distributed.is_primary()
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(distributed.allgather_rows(x), x)
    assert distributed.any_process(True) and not distributed.any_process(False)
    assert distributed.max_over_processes(7) == 7


def test_process_share_and_gather_are_the_identity_for_one_process():
    from sparrow_jax.rl.trainer import process_share

    assert process_share(8) == slice(0, 8)


# Options whose state lives beside the weights, each checked the same way (``slow``):
# DistillSparse (the actor's LoRA sampling, its update with AdamW state in the checkpoint, the
# alpha without it every step), the closed-loop schedule (each process moves the same bins
# from the gathered batch; its controller state in the checkpoint; the demo's responses sit at
# 192-264 tokens: bins 3 and 4 of 64, raised while their tail is under 0.95), and the loss's KL
# term (its reference copy on the processes' devices, rebuilt at resume); and a (1, 2, 2) mesh
# over two devices a process, each process's rollout copy split over its two devices
# (``Trainer._local_policy``: blocks of one gather over the run's mesh), against one process
# of four devices on the same mesh. Entries: (config changes, a metric the option writes,
# devices a process of the two).
_DEMO_UPDATE = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["update"]
OPTIONS = {
    "kl": ({"update": {**_DEMO_UPDATE, "loss": {"kl_coef": 0.1}}}, "kl", 1),
    "distill": ({"distill": {"enabled": True, "rank": 4, "eval_every": 1}}, "distill_loss", 1),
    "closed_loop": ({"schedule": {"kind": "table", "table": [5] * 5, "bin_tokens": 64,
                                  "page_size": 16},
                     "closed_loop": {"enabled": True, "min_count": 1, "patience": 1,
                                     "target": 0.95, "margin": 0.0}}, "schedule_new_bin03", 1),
    "tensor": ({"mesh": {"data": 1, "fsdp": 2, "tensor": 2}}, "loss", 2),
}


def _one_process(tmp: Path, devices=1, **over) -> dict:
    tmp.mkdir(exist_ok=True)
    results = _launch(_write_config(tmp, tmp / "run", **over), 1, devices=devices)
    assert results[0]["rc"] == 0, results[0]["err"]
    return {"metrics": _metrics(tmp / "run"), "responses": _merged(results)}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _one_process(tmp_path_factory.mktemp("one"))


def test_two_processes_equal_one_through_a_sigterm_and_resume(tmp_path, one_process):
    _sigterm_then_resume(tmp_path, one_process)


@pytest.mark.slow   # ~3 CPU-minutes each: three more launches
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_options_in_two_processes_equal_one_through_a_sigterm_and_resume(tmp_path, option):
    over, key, devices = OPTIONS[option]
    one = _one_process(tmp_path / "one", devices=2 * devices, **over)
    assert all(key in r for r in one["metrics"]), key   # the option acted at every step
    results = _sigterm_then_resume(tmp_path / "two", one, devices=devices, **over)
    if option == "tensor":   # each process's copy on its own two devices, split over tensor
        assert all("q_proj's decode copy (64, 64) in blocks [(64, 32)]" in r["err"]
                   for r in results), results[0]["err"]


def _sigterm_then_resume(tmp_path: Path, one_process: dict, devices=1, **over) -> list[dict]:
    """Both processes get SIGTERM as step 1's rollout starts: the step is abandoned on both and
    one checkpoint (step 1) written; two processes resume from it. Together the two launches
    must reproduce the one-process run: every step's rows (each process sampled half of them),
    rewards bit for bit, float metrics to 1e-5. -> the resumed launch's results."""
    tmp_path.mkdir(exist_ok=True)
    run_dir = tmp_path / "run"
    config = _write_config(tmp_path, run_dir, **over)
    results = _launch(config, 2, sigterm_at=2, devices=devices)
    assert [r["rc"] for r in results] == [128 + signal.SIGTERM] * 2, [r["err"] for r in results]
    assert all("saved checkpoint 1" in r["err"] for r in results), results[0]["err"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()
                  if p.name.isdigit()) == ["1"]
    assert [r["step"] for r in _metrics(run_dir)] == [0]
    assert all(len(r["responses"][0]) == len(one_process["responses"][0]) // 2
               for r in results)
    assert _merged(results)[:1] == one_process["responses"][:1]

    resumed = _launch(config, 2, resume=True, devices=devices)
    assert [r["rc"] for r in resumed] == [0, 0], resumed[0]["err"] + resumed[1]["err"]
    assert _merged(resumed) == one_process["responses"][1:]
    _assert_same_metrics(_metrics(run_dir), one_process["metrics"])
    # process 0 alone wrote the run folder's files; both wrote the checkpoint after the last step
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "config.yaml",
                                                         "metrics.jsonl"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()
                  if p.name.isdigit()) == ["1", str(STEPS)]
    return resumed


# ------------------------------------------------------------------------------ the worker
def _worker(config_path: str, out_path: str, resume: bool) -> int:
    from sparrow_jax import distributed

    distributed.initialize()    # before anything touches a device
    from sparrow_jax.rl import trainer as trainer_mod
    from sparrow_jax.rl.config import load_train_config
    from sparrow_jax.rl.interrupt import TrainingInterrupted

    config = load_train_config(config_path)
    inner = trainer_mod.engine_rollout_fn(config, config.budget_schedule)
    responses, calls = [], []
    sigterm_at = int(os.environ.get("SPARROW_TEST_SIGTERM_AT", 0))

    def rollout_fn(model, prompts, key, n, **extra):
        calls.append(1)
        if len(calls) == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if extra.get("mesh") is not None and len(calls) == 1:   # the weights' blocks, seen
            kernel = model.layers[0].self_attn.q_proj.kernel[...]
            print(f"worker: q_proj's decode copy {kernel.shape} in blocks "
                  f"{sorted({x.data.shape for x in kernel.addressable_shards})}", file=sys.stderr)
        out = inner(model, prompts, key, n, **extra)
        responses.append(trainer_mod.responses_of(out))
        return out

    try:
        trainer_mod.train(config, resume=resume, rollout_fn=rollout_fn)
        rc = 0
    except TrainingInterrupted as e:
        print(f"worker: {e}", file=sys.stderr)
        rc = e.exit_status
    Path(out_path).write_text(json.dumps(responses))
    return rc


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2], "--resume" in sys.argv[3:]))
