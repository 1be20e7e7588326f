"""The GRPO trainer with DistillSparse on (docs/design.md, section 8), on a tiny model with the
real rollout engine (sparse past layer 0): the LoRA step trains only the adapters and leaves the
dense update what it is without distillation; the student starts where the rollout's actor was;
the without-LoRA alpha replays the actor; a SIGINT in the LoRA update, then ``--resume``,
reproduces the uninterrupted run's metrics and weights.
"""

import json
import os
import signal

import jax
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.config import ModelConfig, from_dict, to_dict
from sparrow_jax.models.lora import LoRAParam, attach_lora
from sparrow_jax.rl import trainer as trainer_mod
from sparrow_jax.rl.config import TrainConfig
from sparrow_jax.rl.distill import DistillUpdater
from sparrow_jax.rl.distill_eval import actor_topk
from sparrow_jax.rl.interrupt import TrainingInterrupted
from sparrow_jax.rl.run_dir import result_changes
from sparrow_jax.rl.update import TRAINABLE

STEPS = 4


def _cfg(run_dir, enabled=True, **over):
    cfg = {
        "run_dir": str(run_dir), "steps": STEPS, "seed": 0, "reward": "reverse",
        # float32 on every backend: the checks below are float32's (bit-equal updates, log-probs
        # within 2e-5), where "auto" would compute in bfloat16 on a GPU.
        "model": {"hf_config": {**ModelConfig.preset("tiny").to_hf_dict(), "vocab_size": 24,
                                "num_hidden_layers": 2}, "dtype": "float32"},
        "data": {"task": "reverse", "reverse": {"num_values": 8, "min_len": 6, "max_len": 8},
                 "num_train": 16, "num_eval": 2, "prompts_per_step": 2},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 10,
                    "engine": {"page_size": 4, "dense_layers": [0]}},
        "schedule": {"kind": "fixed", "pages": 3, "page_size": 4},
        "update": {"micro_batch_size": 4, "length_multiple": 32, "remat": False},
        "optim": {"learning_rate": 1e-3},
        "distill": {"enabled": enabled, "rank": 4, "eval_every": 1},
        "mismatch": {"min_count": 1},
        "checkpoint_every": 2, "eval_every": 0,
        "tensorboard": False, "progress": False,
    }
    return from_dict(TrainConfig, {**cfg, **over})


def _metrics(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time_", "tokens_per_s"))}
            for r in rows]


def _leaves(model, filt):
    return {k: np.asarray(v[...]) for k, v in nnx.state(model, filt).flat_state()}


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """Two steps with distillation on (the rollouts recorded, and the policy that sampled the
    second), and step 0 with it off on the same rollout."""
    cfg = _cfg(tmp_path_factory.mktemp("on"))
    engine, rollouts = trainer_mod.engine_rollout_fn(cfg, cfg.budget_schedule), []

    def recording(*args, **kwargs):
        rollouts.append(engine(*args, **kwargs))
        return rollouts[-1]

    on = trainer_mod.Trainer(cfg, recording)
    lora0 = _leaves(on.model, LoRAParam)
    m_on = on.train_step()
    lora1, dense1 = _leaves(on.model, LoRAParam), _leaves(on.model, TRAINABLE)
    off = trainer_mod.Trainer(_cfg(tmp_path_factory.mktemp("off"), False),
                              lambda *args, **kwargs: rollouts[0])
    assert not _leaves(off.model, LoRAParam)
    # Present but never switched on: the same compiled programs as the run with distillation.
    attach_lora(off.model, cfg.distill.lora, jax.random.key(5))
    m_off = off.train_step()
    actor = nnx.clone(on.model)
    on.train_step()
    return {"on": on, "lora0": lora0, "lora1": lora1, "dense1": dense1, "m_on": m_on,
            "off": off, "m_off": m_off, "actor": actor, "rollout": rollouts[1]}


def test_lora_step_trains_only_the_adapters(two_steps):
    m_on, m_off, lora0, lora1 = (two_steps[k] for k in ("m_on", "m_off", "lora0", "lora1"))
    assert m_on["sparse_step_fraction"] > 0.3
    # The dense update is the one without distillation, bit for bit.
    for k in ("reward_mean", "alpha_paper_mean", "loss", "grad_norm"):
        assert m_on[k] == m_off[k], k
    dense_off = _leaves(two_steps["off"].model, TRAINABLE)
    assert two_steps["dense1"].keys() == dense_off.keys()
    for k in dense_off:
        np.testing.assert_array_equal(two_steps["dense1"][k], dense_off[k], err_msg=str(k))
    # The adapters moved: every B away from its zero start.
    assert lora1.keys() == lora0.keys() and len(lora1) == 2 * 7 * 2
    moved = {k for k in lora1 if not np.array_equal(lora1[k], lora0[k])}
    assert {k for k in lora0 if k[-2] == "lora_b"} <= moved
    # The student started as the rollout's actor; with B = 0 the actor without its LoRA is
    # the same function.
    assert m_on["distill_logp_gap"] < 2e-5
    assert np.isfinite(m_on["distill_loss"]) and m_on["distill_k3"] > 0
    for stat in ("mean", "p5"):
        np.testing.assert_allclose(m_on[f"alpha_paper_{stat}_nolora"],
                                   m_on[f"alpha_paper_{stat}"], atol=1e-4)
    assert "distill_loss" not in m_off and "alpha_paper_mean_nolora" not in m_off


def test_actor_replay_with_and_without_lora(two_steps):
    """With trained adapters: the teacher-forced actor with its LoRA reproduces the rollout's
    recorded top-k; without it, it does not."""
    cfg, rollout = two_steps["on"].config, two_steps["rollout"]
    mask = np.asarray(rollout.response_mask)
    args = (two_steps["actor"], rollout, cfg.rollout.temperature, two_steps["on"].distill.rule,
            cfg.update)
    ids, lps = actor_topk(*args, lora=True)
    ref_lp = np.asarray(rollout.topk_logprobs)
    np.testing.assert_allclose(lps[mask], ref_lp[mask], atol=2e-5)
    # Ids agree wherever the recorded log-probs are not tied. (Slots past a response hold
    # -inf, whose differences are NaN: never untied, and outside the mask anyway.)
    with np.errstate(invalid="ignore"):
        untied = np.all(np.abs(np.diff(ref_lp, axis=-1)) > 1e-4, axis=-1) & mask
    assert untied.mean() > 0.5
    np.testing.assert_array_equal(ids[untied], np.asarray(rollout.topk_ids)[untied])
    _, plain = actor_topk(*args, lora=False)
    assert np.abs(plain[mask] - ref_lp[mask]).max() > 1e-3


def test_distill_is_a_result_changing_key():
    a, b = to_dict(_cfg("x", True)), to_dict(_cfg("x", False))
    assert result_changes(a, b) == ["distill.enabled"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    model = trainer_mod.train(_cfg(run_dir)).model
    return _metrics(run_dir), _leaves(model, nnx.Param)


def test_sigint_in_lora_update_then_resume_reproduces_the_run(tmp_path, reference, monkeypatch):
    ref_metrics, ref_params = reference
    assert len(ref_metrics) == STEPS
    assert all(r["distill_logp_gap"] < 2e-5 for r in ref_metrics)
    update, calls = DistillUpdater.update, []

    def interrupted_update(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # noted; the step still runs to its end
        return update(self, *args, **kwargs)

    monkeypatch.setattr(DistillUpdater, "update", interrupted_update)
    with pytest.raises(TrainingInterrupted, match="SIGINT before step 2"):
        trainer_mod.train(_cfg(tmp_path, checkpoint_every=10))
    assert len(_metrics(tmp_path)) == 2
    monkeypatch.setattr(DistillUpdater, "update", update)
    model = trainer_mod.train(_cfg(tmp_path), resume=True).model
    assert _metrics(tmp_path) == ref_metrics
    params = _leaves(model, nnx.Param)
    assert params.keys() == ref_params.keys()
    for k in params:
        np.testing.assert_array_equal(params[k], ref_params[k], err_msg=str(k))
