"""The GRPO trainer end to end on a tiny model, with a dense full-recompute sampler written here
(it fills a Rollout honestly: the recorded log-probs and top-k are the sampling distribution's).

Checks: the recompute equals a full-logits reference; SIGKILL after a checkpoint + resume ends
bit-for-bit equal to an uninterrupted run; a non-finite loss stops training naming the step with
no checkpoint from it; top-p/top-k training configs are rejected.
"""

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.config import ConfigError, ModelConfig, from_dict
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rl.config import TrainConfig
from sparrow_jax.rl.recompute import recompute
from sparrow_jax.rl.update import NonFiniteError
from sparrow_jax.rollout.types import Rollout

HF_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 24,
             "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
             "eos_token_id": 0, "tie_word_embeddings": True}
TOPK = 20


# ------------------------------------------------------------------------------ test sampler
@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _sample_loop(graphdef, state, tokens, prompt_lengths, max_new, temperature, key):
    """Full-recompute sampling: every step runs the dense model over the whole padded batch."""
    model = nnx.merge(graphdef, state)
    s = tokens.shape[0]

    def body(j, carry):
        tokens, done, n, lp, tk_ids, tk_lp = carry
        logits = model(tokens)
        pos = prompt_lengths + j
        step_logits = jnp.take_along_axis(logits, (pos - 1)[:, None, None], axis=1)[:, 0]
        logp = jax.nn.log_softmax(step_logits / temperature, axis=-1)
        tok = jax.random.categorical(jax.random.fold_in(key, j), logp).astype(jnp.int32)
        top_lp, top_ids = jax.lax.top_k(logp, TOPK)
        live = ~done
        tokens = tokens.at[jnp.arange(s), pos].set(jnp.where(live, tok, tokens[jnp.arange(s), pos]))
        lp = lp.at[:, j].set(jnp.where(live, logp[jnp.arange(s), tok], 0.0))
        tk_ids = tk_ids.at[:, j].set(jnp.where(live[:, None], top_ids, 0))
        tk_lp = tk_lp.at[:, j].set(jnp.where(live[:, None], top_lp, 0.0))
        n = n + live
        done = done | (live & (tok == 0))
        return tokens, done, n, lp, tk_ids, tk_lp

    init = (tokens, jnp.zeros(s, bool), jnp.zeros(s, jnp.int32), jnp.zeros((s, max_new)),
            jnp.zeros((s, max_new, TOPK), jnp.int32), jnp.zeros((s, max_new, TOPK)))
    return jax.lax.fori_loop(0, max_new, body, init)


def dense_sampler(max_new_tokens, temperature, *, sleep=0.0, nan_at_call=None):
    calls = []

    def rollout_fn(model, prompts, key, n):
        calls.append(1)
        if sleep:
            time.sleep(sleep)
        rows = [p for p in prompts for _ in range(n)]
        s, t = len(rows), max(map(len, rows)) + max_new_tokens
        tokens = np.zeros((s, t), np.int32)
        for i, p in enumerate(rows):
            tokens[i, :len(p)] = p
        plen = np.array([len(p) for p in rows], np.int32)
        graphdef, state = nnx.split(model)
        tokens, done, n_resp, lp, tk_ids, tk_lp = _sample_loop(
            graphdef, state, jnp.asarray(tokens), jnp.asarray(plen), max_new_tokens,
            temperature, key)
        if nan_at_call is not None and len(calls) == nan_at_call:
            lp = jnp.full_like(lp, jnp.nan)
        return Rollout(tokens=tokens, prompt_lengths=jnp.asarray(plen), response_lengths=n_resp,
                       logprobs=lp, topk_ids=tk_ids, topk_logprobs=tk_lp,
                       budget_pages=jnp.zeros(lp.shape, jnp.int32),
                       finish_reason=jnp.where(done, 0, 2).astype(jnp.int32),
                       prompt_index=jnp.repeat(jnp.arange(len(prompts)), n).astype(jnp.int32))

    return rollout_fn


def _config(run_dir, **over):
    base = {
        "run_dir": str(run_dir), "steps": 6, "seed": 3, "reward": "reverse",
        "model": {"hf_config": HF_CONFIG, "seed": 1},
        "data": {"task": "reverse", "reverse": {"num_values": 8, "min_len": 2, "max_len": 4},
                 "num_train": 16, "num_eval": 4, "prompts_per_step": 2},
        "rollout": {"samples_per_prompt": 4, "max_new_tokens": 6, "temperature": 1.0},
        "update": {"mini_batches": 2, "epochs": 2, "micro_batch_size": 2, "length_multiple": 16},
        "optim": {"learning_rate": 1e-2, "warmup_steps": 2},
        "mismatch": {"top_k": TOPK, "min_count": 4},
        "checkpoint_every": 2, "keep_checkpoints": 2, "eval_every": 3, "eval_samples": 2,
        "tensorboard": False, "progress": False,
    }
    for k, v in over.items():
        base[k] = {**base[k], **v} if isinstance(v, dict) and k in base else v
    return base


# ------------------------------------------------------------------------------ child process
def _child(config_json, resume, sleep):
    from sparrow_jax.rl.trainer import train

    cfg = from_dict(TrainConfig, json.loads(Path(config_json).read_text()))
    res = train(cfg, resume=resume,
                rollout_fn=dense_sampler(cfg.rollout.max_new_tokens, cfg.rollout.temperature,
                                         sleep=sleep))
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(res.model, nnx.Param))
    np.savez(Path(cfg.run_dir) / "final.npz",
             **{jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves})


def _spawn(cfg_path, resume, sleep, env):
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_trainer; "
            f"test_trainer._child({str(cfg_path)!r}, {resume}, {sleep})")
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_sigkill_then_resume_is_bit_exact(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    full, killed = tmp_path / "full", tmp_path / "killed"
    for d in (full, killed):
        d.mkdir()
        (d / "cfg.json").write_text(json.dumps(_config(d)))
    proc = _spawn(full / "cfg.json", False, 0.0, env)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out

    proc = _spawn(killed / "cfg.json", False, 0.5, env)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "2").is_dir():  # orbax renames a finished checkpoint
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "final.npz").exists()
    proc = _spawn(killed / "cfg.json", True, 0.0, env)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out

    a, b = np.load(full / "final.npz"), np.load(killed / "final.npz")
    assert sorted(a) == sorted(b) and len(a) > 0
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)

    # the logs agree too (timings aside), one line per step
    def lines(d):
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time", "tokens"))}
                for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines(killed)] == list(range(6))
    assert [r["step"] for r in lines(killed) if "eval_mean_at_k" in r] == [2, 5]
    assert lines(full) == lines(killed)


def test_non_finite_loss_stops_naming_step_without_checkpoint(tmp_path):
    from sparrow_jax.rl.trainer import train

    cfg = from_dict(TrainConfig, _config(tmp_path, checkpoint_every=1, steps=5))
    with pytest.raises(NonFiniteError, match="training step 2"):
        train(cfg, rollout_fn=dense_sampler(6, 1.0, nan_at_call=3))
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [1, 2]  # state before step 1 and before step 2; nothing after the bad step


def test_recompute_matches_full_logits_reference():
    model = init_model(ModelConfig.from_hf_dict(HF_CONFIG), seed=5)
    prompts = [[1, 5, 6, 3], [1, 7, 3], [1, 4, 4, 5, 6, 3]]
    temp = 0.7
    rollout = dense_sampler(5, temp)(model, prompts, jax.random.key(0), 2)
    dense = recompute(model, rollout, temp, micro_batch_size=4, top_k=TOPK, chunk_size=7,
                      length_multiple=16)
    tokens = np.asarray(rollout.tokens)
    logits = np.asarray(model(jnp.asarray(tokens)), np.float64) / temp
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    pl, rl = np.asarray(rollout.prompt_lengths), np.asarray(rollout.response_lengths)
    actor_ids = np.asarray(rollout.topk_ids)
    for b in range(tokens.shape[0]):
        for j in range(rl[b]):
            row = logp[b, pl[b] + j - 1]
            np.testing.assert_allclose(dense.logprobs[b, j], row[tokens[b, pl[b] + j]], atol=2e-5)
            np.testing.assert_allclose(dense.actor_topk_logprobs[b, j], row[actor_ids[b, j]],
                                       atol=2e-5)
            np.testing.assert_allclose(np.sort(dense.topk_logprobs[b, j]),
                                       np.sort(row)[-TOPK:], atol=2e-5)
            np.testing.assert_allclose(row[np.asarray(dense.topk_ids[b, j])],
                                       dense.topk_logprobs[b, j], atol=2e-5)
            np.testing.assert_allclose(dense.entropy[b, j], -(np.exp(row) * row).sum(), atol=2e-5)
        assert not np.any(np.asarray(dense.logprobs)[b, rl[b]:])
    # the sampler is the dense policy itself, so its recorded log-probs agree
    mask = np.asarray(rollout.response_mask)
    np.testing.assert_allclose(np.asarray(dense.logprobs)[mask],
                               np.asarray(rollout.logprobs)[mask], atol=2e-5)


@pytest.mark.parametrize("over", [{"top_p": 0.9}, {"top_k": 5}])
def test_training_rejects_truncated_sampling(tmp_path, over):
    with pytest.raises(ConfigError, match="temperature only"):
        from_dict(TrainConfig, _config(tmp_path, rollout=over))


def test_yaml_config_round_trip(tmp_path):
    import yaml

    from sparrow_jax.rl.config import load_train_config

    data = _config(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    cfg = load_train_config(tmp_path / "c.yaml")
    assert cfg == from_dict(TrainConfig, data)
    assert cfg.update.loss.tis_cap == 3.0 and cfg.optim.weight_decay == 0.01  # the paper's defaults
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**data, "update": {"micro_batch": 2}}))
    with pytest.raises(ConfigError, match="bad.yaml: unknown key in update: 'micro_batch'"):
        load_train_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="mini-batches"):
        from_dict(TrainConfig, _config(tmp_path, update={"mini_batches": 3}))


@pytest.mark.slow
def test_grpo_raises_reward_on_reverse_task(tmp_path):
    """40 steps on a 1-layer model: the reward of the last steps beats the first ones."""
    from sparrow_jax.rl.trainer import train

    cfg = from_dict(TrainConfig, _config(
        tmp_path, steps=40, checkpoint_every=100, eval_every=0,
        data={"prompts_per_step": 8, "num_train": 256,
              "reverse": {"num_values": 4, "min_len": 1, "max_len": 2}},
        rollout={"samples_per_prompt": 8, "max_new_tokens": 4},
        update={"mini_batches": 1, "epochs": 1, "micro_batch_size": 64},
        optim={"learning_rate": 3e-3, "warmup_steps": 0}))
    history = train(cfg, rollout_fn=dense_sampler(4, 1.0)).history
    first = np.mean([h["reward_mean"] for h in history[:8]])
    last = np.mean([h["reward_mean"] for h in history[-8:]])
    assert last > first + 0.05, (first, last)
