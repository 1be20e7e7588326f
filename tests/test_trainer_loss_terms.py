"""The GRPO loss's optional terms in the trainer (docs/design.md, section 7). The KL pull
(``update.loss.kl_coef``): the reference is the run's initial weights, its log-probs a dense
forward of them, and the step's ``kl`` metric the token-mean k3 of the policy that sampled the
step against it, here recomputed from full logits in float64; a resumed run rebuilds the same
reference. The entropy bonus (``update.loss.entropy_coef``): in the loss the update
differentiates, at the policy's own entropy."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
from flax import nnx

from conftest import tiny_train_config
from sparrow_jax.config import from_dict
from sparrow_jax.rl.config import TrainConfig

# An easy reverse task (1-2 values of 4) at 8 samples a prompt: groups hold different rewards
# from the first step on, so the policy moves
KL = {"data": {"task": "reverse", "reverse": {"num_values": 4, "min_len": 1, "max_len": 2},
               "num_train": 16, "num_eval": 2, "prompts_per_step": 4},
      "update": {"micro_batch_size": 16, "length_multiple": 16, "loss": {"kl_coef": 0.5}},
      "optim": {"learning_rate": 1e-2}}


def _config(run_dir, **over) -> TrainConfig:
    cfg = tiny_train_config(run_dir, **{**KL, **over})
    cfg["rollout"]["samples_per_prompt"] = 8
    cfg["model"]["dtype"] = "float32"   # on every backend (a GPU's default is bfloat16)
    return from_dict(TrainConfig, cfg)


def _np_logprobs(model, rollout, temperature: float) -> np.ndarray:
    """``[S, R]`` log-probs of the sampled response tokens under ``model``, from its full
    logits in float64 (zero past each response)."""
    tokens = np.asarray(rollout.tokens)
    logits = np.asarray(model(jnp.asarray(tokens)), np.float64) / temperature
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    pl, rl = np.asarray(rollout.prompt_lengths), np.asarray(rollout.response_lengths)
    out = np.zeros(np.asarray(rollout.logprobs).shape)
    for b in range(len(tokens)):
        for j in range(rl[b]):
            out[b, j] = logp[b, pl[b] + j - 1, tokens[b, pl[b] + j]]
    return out


def test_kl_metric_is_k3_against_the_initial_weights(tmp_path):
    from sparrow_jax.rl import trainer as trainer_mod

    cfg = _config(tmp_path / "run", steps=3)
    rollouts = []
    inner = trainer_mod.engine_rollout_fn(cfg, cfg.budget_schedule)

    def rollout_fn(model, prompts, key, n, **extra):
        rollouts.append(inner(model, prompts, key, n, **extra))
        return rollouts[-1]

    trainer_mod.prepare_run(cfg)
    trainer = trainer_mod.Trainer(cfg, rollout_fn)
    initial = nnx.clone(trainer.model)
    temperature = cfg.rollout.temperature
    kls, losses = [], []
    for step in range(cfg.steps):
        before = nnx.clone(trainer.model)
        metrics = trainer.train_step()
        rollout = rollouts[-1]
        mask = np.asarray(rollout.response_mask)
        k = _np_logprobs(initial, rollout, temperature) - _np_logprobs(before, rollout,
                                                                       temperature)
        want = float(np.sum((np.exp(k) - k - 1) * mask) / mask.sum())
        kls.append(metrics["kl"])
        losses.append(metrics["loss"])
        if step == 0:   # the policy is its reference: no KL beyond two programs' rounding
            assert metrics["kl"] < 1e-7, metrics["kl"]
        else:
            np.testing.assert_allclose(metrics["kl"], want, rtol=1e-4, err_msg=f"step {step}")
    assert kls[1] > 1e-3, kls   # the policy moved away
    # The term is in the loss the update differentiates: the same run with next to no weight on
    # it samples the same step 1 (the term's gradient is zero at step 0, where the policy is its
    # reference) and its loss differs by the term alone.
    loose = _config(tmp_path / "loose", steps=2, update={**KL["update"], "loss": {
        "kl_coef": 1e-9}})
    trainer_mod.prepare_run(loose)
    other = trainer_mod.train(loose).history[1]
    np.testing.assert_allclose(other["kl"], kls[1], rtol=1e-5)
    np.testing.assert_allclose(losses[1] - other["loss"], 0.5 * kls[1], rtol=1e-4)


def test_resume_rebuilds_the_reference_from_the_initial_weights(tmp_path):
    from sparrow_jax.rl import trainer as trainer_mod

    def metrics(run_dir):
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(("time_", "tokens_per"))}
                for r in rows]

    trainer_mod.train(_config(tmp_path / "whole", steps=3))
    trainer_mod.train(_config(tmp_path / "split", steps=2))
    trainer_mod.train(_config(tmp_path / "split", steps=3), resume=True)
    whole, split = metrics(tmp_path / "whole"), metrics(tmp_path / "split")
    assert [r["step"] for r in split] == [0, 1, 2] and whole[2]["kl"] > 1e-5
    for k, v in whole[2].items():
        np.testing.assert_allclose(split[2][k], v, rtol=1e-6, atol=1e-9, err_msg=k)


def test_entropy_bonus_is_in_the_update_loss(tmp_path):
    """Step 0 of the same run with and without the bonus samples the same batch (the update
    comes after): the losses differ by ``entropy_coef x`` the update's token-mean entropy, and
    that entropy is the dense recompute's (the ``entropy`` metric)."""
    from sparrow_jax.rl import trainer as trainer_mod

    def step0(name, coef):
        cfg = _config(tmp_path / name, steps=1, update={**KL["update"], "loss": {
            "entropy_coef": coef}})
        trainer_mod.prepare_run(cfg)
        return trainer_mod.train(cfg).history[0]

    plain, bonus = step0("plain", 0.0), step0("bonus", 0.25)
    assert "kl" not in plain and plain["update_entropy"] > 0.1
    np.testing.assert_allclose(bonus["update_entropy"], plain["update_entropy"], rtol=1e-6)
    np.testing.assert_allclose(bonus["update_entropy"], plain["entropy"], rtol=1e-5)
    np.testing.assert_allclose(plain["loss"] - bonus["loss"], 0.25 * plain["update_entropy"],
                               rtol=1e-4)
