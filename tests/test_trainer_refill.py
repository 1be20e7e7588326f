"""The GRPO trainer with continuous-refill rollouts (``rollout.refill_slots``) on a tiny model
with the real engine, sparse past layer 0: refill samples the same tokens per sample as static
batches (tests/test_refill.py), so three steps with 3 slots (fewer than the step's 8 rows)
give the static run's metrics and weights (bit for bit on CPU). On a mesh:
tests/test_trainer_mesh.py."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.config import ConfigError, ModelConfig, from_dict
from sparrow_jax.rl import trainer as trainer_mod
from sparrow_jax.rl.config import TrainConfig
from sparrow_jax.rollout import refill as refill_mod


def _cfg(run_dir, **rollout):
    return from_dict(TrainConfig, {
        "run_dir": str(run_dir), "steps": 3, "seed": 0, "reward": "reverse",
        "model": {"hf_config": {**ModelConfig.preset("tiny").to_hf_dict(), "vocab_size": 24,
                                "num_hidden_layers": 2}},
        "data": {"task": "reverse", "reverse": {"num_values": 8, "min_len": 4, "max_len": 8},
                 "num_train": 16, "num_eval": 2, "prompts_per_step": 2},
        "rollout": {"samples_per_prompt": 4, "max_new_tokens": 10,
                    "engine": {"page_size": 4, "dense_layers": [0]}, **rollout},
        "schedule": {"kind": "fixed", "pages": 3, "page_size": 4},
        "update": {"micro_batch_size": 4, "length_multiple": 32, "remat": False},
        "optim": {"learning_rate": 1e-3},
        "mismatch": {"min_count": 1},
        "checkpoint_every": 3, "eval_every": 0, "tensorboard": False, "progress": False,
    })


def _metrics(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time_", "tokens_per_s"))}
            for r in rows]


@pytest.mark.parametrize("tail", [None, 1])
def test_refill_rollouts_train_as_static_ones(tmp_path, monkeypatch, tail):
    """With ``refill_tail_slots`` too: each step's last rows narrowed onto fewer slots."""
    static, refill = tmp_path / "static", tmp_path / "refill"
    a = trainer_mod.train(_cfg(static))
    calls, run = [], refill_mod.run_refill
    monkeypatch.setattr(refill_mod, "run_refill", lambda *a, **k: calls.append(
        (k["slots"], k["tail_slots"])) or run(*a, **k))
    b = trainer_mod.train(_cfg(refill, refill_slots=3, refill_tail_slots=tail))
    assert calls == [(3, tail)] * 3
    ms, mr = _metrics(static), _metrics(refill)
    assert len(ms) == 3 and [sorted(m) for m in ms] == [sorted(m) for m in mr]
    # The same tokens (so rewards and lengths) on every backend. The behaviour log-probs come
    # from decode steps over 3 rows instead of 8: bit for bit on CPU, whose kernels do not
    # depend on the row count; a GPU's float32 matmuls run in TF32 (10-bit mantissa), its
    # algorithm chosen per shape (measured on an H100: metrics 5e-4 apart).
    tol = 0 if jax.default_backend() == "cpu" else 3e-3
    for m, n in zip(ms, mr):
        for k in ("reward_mean", "reward_std", "response_length_mean", "response_length_max"):
            assert m[k] == n[k], k
        np.testing.assert_allclose([n[k] for k in sorted(n)], [m[k] for k in sorted(m)],
                                   rtol=tol, atol=tol, err_msg=str(sorted(m)))
    xs, ys = (jax.tree.leaves(nnx.state(t.model, nnx.Param)) for t in (a, b))
    if tol == 0:
        for x, y in zip(xs, ys):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
        return
    # On a GPU the TIS weights differ by TF32's noise, and Adam, which moves a weight by about
    # the learning rate a step whatever its gradient's size, turns that into visible differences
    # where gradients are near zero (measured on an H100: 1% of weights over 1e-4 apart, the
    # largest 2e-3). What must hold: each weight within Adam's step bound, and the two runs'
    # updates from the same initial weights the same to 10% (other samples would give updates
    # about as far apart as they are large).
    w0 = jax.tree.leaves(nnx.state(trainer_mod.load_policy(_cfg(static).model)[0], nnx.Param))
    flat = lambda ws: np.concatenate([np.asarray(w, np.float64).ravel() for w in ws])
    x, y, w = flat(xs), flat(ys), flat(w0)
    apart = np.linalg.norm(y - x) / np.linalg.norm(x - w)
    assert np.abs(y - x).max() <= 2 * 3 * 1e-3 and apart < 0.1, (np.abs(y - x).max(), apart)


def test_refill_slots_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="rollout.refill_slots must be an int >= 1"):
        _cfg(tmp_path, refill_slots=0)
    for bad in (dict(refill_slots=3, refill_tail_slots=4), dict(refill_tail_slots=2),
                dict(refill_slots=3, refill_tail_slots=0)):
        with pytest.raises(ConfigError, match="rollout.refill_tail_slots must be an int in"):
            _cfg(tmp_path, **bad)
