"""The GRPO trainer on a device mesh (``TrainConfig.mesh``) against the same run on one device:
the real rollout engine (``generate(mesh=)``), the recompute and the update on the mesh, and a
checkpoint saved on one mesh resumed on another.

XLA fixes the CPU device count when JAX starts, so when this process has one device the runs
happen in a subprocess with 8 simulated CPU devices (``python tests/test_trainer_mesh.py``
prints their JSON report); on a multi-device host they run here, on the devices found.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import run_on_simulated_devices
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
        "model": {"hf_config": HF_CONFIG, "seed": 1},
        "data": {"task": "reverse", "reverse": {"num_values": 8, "min_len": 2, "max_len": 4},
                 "num_train": 16, "num_eval": 4, "prompts_per_step": 4},
        "rollout": {"samples_per_prompt": 4, "max_new_tokens": 6, "temperature": 1.0,
                    "engine": {"page_size": 4, "dense_layers": [0]}},
        "schedule": {"kind": "fixed", "pages": 3, "page_size": 4},
        "update": {"mini_batches": 1, "micro_batch_size": 8, "length_multiple": 16,
                   "remat": False},
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
def _run(run_dir: Path, mesh, *, steps=STEPS, resume=False) -> dict:
    """One run of the trainer (the engine's rollouts, recorded): its metrics lines and tokens."""
    from sparrow_jax.rl import trainer as trainer_mod

    over = {"steps": steps} if mesh is None else {"steps": steps, "mesh": dict(
        zip(("data", "fsdp", "tensor"), mesh))}
    cfg = from_dict(TrainConfig, _config(run_dir, **over))
    inner, tokens = trainer_mod.engine_rollout_fn(cfg, cfg.budget_schedule), []

    def rollout_fn(model, prompts, key, n, **extra):
        out = inner(model, prompts, key, n, **extra)
        tokens.append(np.asarray(out.tokens).tolist())
        return out

    trainer_mod.train(cfg, resume=resume, rollout_fn=rollout_fn)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"metrics": [{k: v for k, v in r.items() if not k.startswith(("time_", "tokens_per"))}
                        for r in lines], "tokens": tokens}


def run_checks() -> dict:
    """One device for 3 steps; mesh (2, 4, 1) for 2 steps (checkpoint 2); that checkpoint
    resumed on (2, 2, 2) for step 2. On fewer than 8 devices: (n, 1, 1) and (1, n, 1)."""
    n = jax.device_count()
    first, second = ((2, 4, 1), (2, 2, 2)) if n == 8 else ((n, 1, 1), (1, n, 1))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ref = _run(tmp / "one", None)
        a = _run(tmp / "mesh", first, steps=2)
        b = _run(tmp / "mesh", second, resume=True)
    return {"devices": n, "meshes": [first, second], "reference": ref, "first": a,
            "resumed": b}


@pytest.fixture(scope="module")
def report():
    if jax.device_count() > 1:
        return run_checks()
    return json.loads(run_on_simulated_devices(__file__).strip().splitlines()[-1])


def _assert_same_metrics(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert set(g) == set(w), (sorted(set(g) ^ set(w)))
        for k in w:
            # the absolute floor is for values near 0 that are sums of opposite signs (loss)
            np.testing.assert_allclose(g[k], w[k], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {w['step']} {k}")


def test_trainer_on_a_mesh_equals_one_device(report):
    ref, a = report["reference"], report["first"]
    assert a["tokens"] == ref["tokens"][:2]
    _assert_same_metrics(a["metrics"], ref["metrics"][:2])
    # the run learns something: the policy moved between the steps' rollouts
    assert ref["metrics"][0]["loss"] != ref["metrics"][1]["loss"]


def test_checkpoint_of_one_mesh_resumes_on_another(report):
    ref, b = report["reference"], report["resumed"]
    assert b["tokens"] == ref["tokens"][2:]
    # the resumed run's metrics file holds steps 0-1 of the first mesh, then step 2 of this one
    _assert_same_metrics(b["metrics"], ref["metrics"])


if __name__ == "__main__":
    print(json.dumps(run_checks()))
