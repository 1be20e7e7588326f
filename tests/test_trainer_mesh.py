"""The GRPO trainer on a device mesh (``TrainConfig.mesh``) against the same run on one device:
the real rollout engine (``generate(mesh=)``, and continuous refill with a queue and pool per
row shard), the recompute and the update on the mesh, and a checkpoint saved on one mesh
resumed on another.

XLA fixes the CPU device count when JAX starts, so when this process has one device the runs
happen in a subprocess with 8 simulated CPU devices (``python tests/test_trainer_mesh.py``
prints their JSON report); on a multi-device host they run here, on the devices found.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import jax
import pytest

from conftest import run_on_simulated_devices
from mesh_runs import check_run, recording
from sparrow_jax.config import ConfigError, from_dict
from sparrow_jax.rl.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
STEPS = 3
HF_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 24,
             "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "eos_token_id": 0, "tie_word_embeddings": True}


def _config(run_dir, **over) -> dict:
    base = {
        "run_dir": str(run_dir), "steps": STEPS, "seed": 3, "reward": "reverse",
        # float32 compute on every backend (the GPU default is bfloat16): see mesh_runs
        "model": {"hf_config": HF_CONFIG, "seed": 1, "dtype": "float32"},
        "data": {"task": "reverse", "reverse": {"num_values": 8, "min_len": 2, "max_len": 4},
                 "num_train": 16, "num_eval": 4, "prompts_per_step": 4},
        "rollout": {"samples_per_prompt": 4, "max_new_tokens": 6, "temperature": 1.0,
                    "engine": {"page_size": 4, "dense_layers": [0]}},
        "schedule": {"kind": "fixed", "pages": 3, "page_size": 4},
        # the KL term on: its reference copy is laid out and recomputed on the mesh too
        "update": {"mini_batches": 1, "micro_batch_size": 8, "length_multiple": 16,
                   "remat": False, "loss": {"kl_coef": 0.1}},
        "optim": {"learning_rate": 1e-2},
        "mismatch": {"top_k": 8, "min_count": 4},
        "checkpoint_every": 2, "keep_checkpoints": 2, "eval_every": 0,
        "tensorboard": False, "progress": False,
    }
    base.update(over)
    return base


def test_mesh_key_loads_and_names_bad_values(tmp_path):
    cfg = from_dict(TrainConfig, _config(tmp_path, mesh={"data": 2, "tensor": 2}))
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (2, -1, 2)
    assert from_dict(TrainConfig, _config(tmp_path)).mesh is None
    with pytest.raises(ConfigError, match="mesh.fsdp must be a positive int or -1, got 0"):
        from_dict(TrainConfig, _config(tmp_path, mesh={"fsdp": 0}))


# ------------------------------------------------------------------------------ the runs
def _run(run_dir: Path, mesh, *, steps=STEPS, resume=False, refill_slots=None) -> dict:
    """One run of the trainer (the engine's rollouts, recorded): its metrics lines and, per
    rollout, its tokens, sampled log-probs, top-k and each draw's Gumbel noise."""
    from sparrow_jax.rl import trainer as trainer_mod

    over = {"steps": steps} if mesh is None else {"steps": steps, "mesh": dict(
        zip(("data", "fsdp", "tensor"), mesh))}
    if refill_slots is not None:
        base = _config(run_dir)["rollout"]
        over["rollout"] = {**base, "refill_slots": refill_slots}
    cfg = from_dict(TrainConfig, _config(run_dir, **over))
    rollouts = []
    trainer_mod.train(cfg, resume=resume, rollout_fn=recording(
        trainer_mod.engine_rollout_fn(cfg, cfg.budget_schedule), rollouts))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"metrics": [{k: v for k, v in r.items() if not k.startswith(("time_", "tokens_per"))}
                        for r in lines], "rollouts": rollouts}


def run_checks() -> dict:
    """One device for 3 steps; mesh (2, 4, 1) for 2 steps (checkpoint 2); that checkpoint
    resumed on (2, 2, 2) for step 2; continuous refill on (2, 2, 2) for 2 steps, 2 slots per
    row shard (fewer than its 4 rows). On fewer than 8 devices: (n, 1, 1), then a mesh with
    ``tensor`` = 2 ((1, 1, 2) on two), the axis whose gradients a GPU once got wrong where a
    CPU did not (docs/design.md, resume)."""
    n = jax.device_count()
    first, second = ((2, 4, 1), (2, 2, 2)) if n == 8 else (
        (n, 1, 1), (1, n // 2, 2) if n % 2 == 0 else (1, n, 1))
    shards = second[0] * second[1]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ref = _run(tmp / "one", None)
        a = _run(tmp / "mesh", first, steps=2)
        b = _run(tmp / "mesh", second, resume=True)
        c = _run(tmp / "refill", second, steps=2, refill_slots=2 * shards)
        # refused on the first mesh: the second may have a single row shard
        bad = _refused(tmp / "bad", first, refill_slots=2 * first[0] * first[1] + 1)
    return {"devices": n, "platform": jax.default_backend(), "meshes": [first, second],
            "reference": ref, "first": a, "resumed": b, "refill": c, "refused": bad}


def _refused(run_dir: Path, mesh, refill_slots: int) -> str:
    """The ConfigError of a trainer whose refill slots do not split over the mesh's shards."""
    from sparrow_jax.rl import trainer as trainer_mod

    cfg = from_dict(TrainConfig, _config(run_dir, mesh=dict(zip(("data", "fsdp", "tensor"), mesh)),
                                         rollout={**_config(run_dir)["rollout"],
                                                  "refill_slots": refill_slots}))
    try:
        trainer_mod.Trainer(cfg)
    except ConfigError as e:
        return str(e)
    return "accepted"


@pytest.fixture(scope="module")
def report():
    if jax.device_count() > 1:
        return run_checks()
    return json.loads(run_on_simulated_devices(__file__).strip().splitlines()[-1])


def test_trainer_on_a_mesh_equals_one_device(report):
    ref, a = report["reference"], report["first"]
    assert len(a["rollouts"]) == len(a["metrics"]) == 2
    compared = check_run(a["metrics"], a["rollouts"], ref, report["platform"], "first mesh")
    assert report["platform"] != "cpu" or compared == 2
    # the run learns something: the policy moved between the steps' rollouts
    assert ref["metrics"][0]["loss"] != ref["metrics"][1]["loss"]


def test_checkpoint_of_one_mesh_resumes_on_another(report):
    ref, a, b = report["reference"], report["first"], report["resumed"]
    # the resumed run rolled out step 2 only; its metrics file holds steps 0-1 of the first
    # mesh, then step 2 of this one
    assert len(b["rollouts"]) == 1 and len(b["metrics"]) == STEPS
    compared = check_run(b["metrics"], a["rollouts"] + b["rollouts"], ref, report["platform"],
                         "resumed")
    assert report["platform"] != "cpu" or compared == STEPS


def test_refill_rollouts_on_a_mesh_train_as_one_device(report):
    ref, c = report["reference"], report["refill"]
    assert len(c["rollouts"]) == len(c["metrics"]) == 2
    compared = check_run(c["metrics"], c["rollouts"], ref, report["platform"], "refill")
    assert report["platform"] != "cpu" or compared == 2
    shards = report["meshes"][0][0] * report["meshes"][0][1]
    assert report["refused"] == (f"rollout.refill_slots={2 * shards + 1} does not split over the "
                                 f"{shards} row shards (data x fsdp) rollouts sample on"), report


if __name__ == "__main__":
    print(json.dumps(run_checks()))
