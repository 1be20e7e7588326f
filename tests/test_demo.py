"""The demo's pieces: configs/demo.yaml, the committed checkpoints/demo model, and the trainer's
engine rollouts ending at the model's EOS."""

from pathlib import Path

import jax
import numpy as np

from sparrow_jax.data import EOS, NeedleConfig, NeedleTask
from sparrow_jax.rl.config import load_train_config

ROOT = Path(__file__).resolve().parent.parent


def test_demo_config_is_sparse_grpo_from_the_demo_model():
    cfg = load_train_config(ROOT / "configs" / "demo.yaml")
    assert (ROOT / cfg.model.path / "config.json").is_file()
    assert cfg.data.task == "needle" and cfg.reward == "needle"
    assert cfg.rollout.samples_per_prompt == 8
    assert cfg.rollout.engine.dense_layers == (0,)
    page = cfg.rollout.engine.page_size
    schedule = cfg.budget_schedule
    needle = cfg.data.needle
    # Every decode step of the shortest prompt already has more pages than the budget.
    lengths = np.arange(needle.min_prompt_len + 1,
                        needle.max_prompt_len + cfg.rollout.max_new_tokens + 1)
    pages = -(-lengths // page)
    assert np.all(np.asarray(schedule.budget_pages(lengths)) < pages)


def test_demo_checkpoint_is_small_deep_and_ends_at_eos():
    from sparrow_jax.models.hf_io import load_qwen3

    folder = ROOT / "checkpoints" / "demo"
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size < 8 * 2**20
    model, cfg = load_qwen3(folder)
    assert cfg.eos_token_ids == (EOS,)
    assert cfg.vocab_size == NeedleConfig().vocab_size
    assert cfg.num_hidden_layers >= 2


def test_engine_rollouts_stop_at_the_model_eos(tmp_path):
    """The trainer's rollout function takes the EOS ids from the model when the config's
    ``rollout.eos_ids`` names none: responses end at their first EOS."""
    import dataclasses

    from sparrow_jax.models.hf_io import load_qwen3
    from sparrow_jax.rl.trainer import engine_rollout_fn, responses_of

    cfg = load_train_config(ROOT / "configs" / "demo.yaml")
    assert cfg.rollout.eos_ids is None
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_new_tokens=6))
    model, _ = load_qwen3(ROOT / cfg.model.path)
    prompts, _ = NeedleTask().sample(np.random.default_rng(0), 2)
    rollout = engine_rollout_fn(cfg, cfg.budget_schedule)(
        model, prompts, jax.random.key(0), 4)
    responses = responses_of(rollout)
    assert any(EOS in r for r in responses)
    for r in responses:
        assert EOS not in r[:-1], r
