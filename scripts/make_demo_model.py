"""Trains the demo's tiny Qwen3 on the needle task and saves it as an HF folder.

The demo (``scripts/demo.sh``, ``configs/demo.yaml``) starts GRPO from this checkpoint: a model
that already reads the long prompt a little (supervised next-token cross-entropy on the answer
tokens of :class:`sparrow_jax.data.NeedleTask`), stopped early on purpose so that it is decent
but not perfect and reinforcement learning has room to improve it.

    .venv/bin/python scripts/make_demo_model.py            # -> checkpoints/demo/

Prompts are drawn fresh every step from a seeded stream (the GRPO run's prompts come from other
seeds). The folder gets config.json, model.safetensors (float32), generation_config.json (EOS
= ``data.EOS``) and a README.md recording the command and the final metrics.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from sparrow_jax.config import ModelConfig  # noqa: E402
from sparrow_jax.data import BOS, EOS, NeedleConfig, NeedleTask, positional_credit  # noqa: E402
from sparrow_jax.models.hf_io import load_qwen3, save_qwen3  # noqa: E402
from sparrow_jax.models.qwen3 import init_model, logits_from_hidden  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "checkpoints" / "demo"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1000,
                   help="the most steps (and the length of the cosine lr schedule)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=192)
    p.add_argument("--target", type=float, default=0.5,
                   help="stop early once the running mean (last 20 steps) of the probability the "
                        "model gives the right needle values (teacher-forced) reaches this")
    p.add_argument("--short-steps", type=int, default=200,
                   help="curriculum: this many first steps use short prompts (--short-len)")
    p.add_argument("--short-len", type=int, default=64,
                   help="curriculum prompts hold 3/4 of this to this many tokens")
    p.add_argument("--eval-prompts", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=0,
                   help="steps between temperature-1 reward estimates on 64 prompts (0: off)")
    p.add_argument("--no-save", action="store_true", help="train and evaluate only")
    return p.parse_args(argv)


def model_config(a) -> ModelConfig:
    return ModelConfig(
        vocab_size=NeedleConfig().vocab_size, hidden_size=a.hidden,
        intermediate_size=a.intermediate, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        rope_theta=10_000.0, tie_word_embeddings=True, max_position_embeddings=1024,
        bos_token_id=BOS, eos_token_ids=(EOS,))


def make_batch(task: NeedleTask, rng: np.random.Generator, n: int):
    """-> tokens [n, T] (prompt + answer, right-padded with EOS), answer start [n], answer len."""
    prompts, answers = task.sample(rng, n)
    a_len = len(answers[0])
    width = -(-(task.config.max_prompt_len + a_len) // 16) * 16
    tokens = np.full((n, width), EOS, np.int32)
    starts = np.zeros(n, np.int32)
    for i, (p, ans) in enumerate(zip(prompts, answers)):
        tokens[i, :len(p) + a_len] = p + ans
        starts[i] = len(p)
    return tokens, starts, a_len


def answer_logits(model, tokens, starts, a_len):
    """Logits that predict the answer tokens: positions start-1 .. start+a_len-2 -> [B, A, V]."""
    hidden, _ = model.forward(tokens)
    idx = starts[:, None] - 1 + jnp.arange(a_len)[None, :]
    h = jnp.take_along_axis(hidden, idx[:, :, None], axis=1)
    return logits_from_hidden(h, model.head_weight())


def loss_fn(model, tokens, starts, a_len):
    logits = answer_logits(model, tokens, starts, a_len)
    idx = starts[:, None] + jnp.arange(a_len)[None, :]
    targets = jnp.take_along_axis(tokens, idx, axis=1)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    # Teacher-forced probability of each answer token (a cheap proxy of the sampled reward).
    return ce.mean(), jnp.exp(-ce).mean(0)


@nnx.jit(static_argnums=(4,))
def train_step(model, optimizer, tokens, starts, a_len):
    (loss, per_pos), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, tokens, starts,
                                                                       a_len)
    optimizer.update(model, grads)
    return loss, per_pos


@nnx.jit
def _next_logits(model, tokens, pos):
    hidden, _ = model.forward(tokens)
    h = jnp.take_along_axis(hidden, pos[:, None, None], axis=1)[:, 0]
    return logits_from_hidden(h, model.head_weight())


def sample_responses(model, prompts, max_new: int, temperature: float, key) -> list[list[int]]:
    """A simple full-forward sampling loop (no KV cache): fine for a few new tokens."""
    n = len(prompts)
    width = max(map(len, prompts)) + max_new
    width = -(-width // 64) * 64
    tokens = np.full((n, width), EOS, np.int32)
    lengths = np.array([len(p) for p in prompts], np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    out = [[] for _ in range(n)]
    done = np.zeros(n, bool)
    for _ in range(max_new):
        logits = _next_logits(model, jnp.asarray(tokens), jnp.asarray(lengths - 1))
        if temperature == 0:
            nxt = np.asarray(jnp.argmax(logits, -1))
        else:
            key, sub = jax.random.split(key)
            nxt = np.asarray(jax.random.categorical(sub, logits / temperature, -1))
        for i in range(n):
            if not done[i]:
                out[i].append(int(nxt[i]))
                done[i] = nxt[i] == EOS
        tokens[np.arange(n), lengths] = nxt
        lengths = lengths + 1
        if done.all():
            break
    return out


def estimate_reward(model, task, rng, num_prompts, temperature, key, batch=64) -> dict:
    rewards, per_needle = [], []
    a_len = task.config.num_needles + 1
    for start in range(0, num_prompts, batch):
        prompts, answers = task.sample(rng, min(batch, num_prompts - start))
        key, sub = jax.random.split(key)
        for r, ans in zip(sample_responses(model, prompts, a_len + 1, temperature, sub),
                          answers):
            rewards.append(positional_credit(r, ans))
            got = r[:r.index(EOS)] if EOS in r else r
            per_needle.append([int(k < len(got) and got[k] == ans[k]) for k in range(a_len - 1)])
    return {"reward": float(np.mean(rewards)),
            "per_needle": np.mean(per_needle, 0).round(3).tolist()}


def main(argv=None) -> int:
    a = parse_args(argv)
    task = NeedleTask(NeedleConfig())
    cfg = model_config(a)
    model = init_model(cfg, seed=a.seed)
    schedule = optax.warmup_cosine_decay_schedule(0.0, a.lr, min(a.warmup, a.steps // 2),
                                                  a.steps, a.lr * 0.1)
    optimizer = nnx.Optimizer(
        model, optax.chain(optax.clip_by_global_norm(1.0),
                           optax.adamw(schedule, weight_decay=a.weight_decay)), wrt=nnx.Param)
    nparams = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, heads "
          f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} x {cfg.head_dim}, mlp "
          f"{cfg.intermediate_size}, vocab {cfg.vocab_size}: {nparams:,} parameters "
          f"({nparams * 4 / 2**20:.2f} MiB float32)", flush=True)
    print(f"task: {task.config}; context-free ceiling {task.context_free_ceiling():.4f}",
          flush=True)

    from tqdm import tqdm

    rng = np.random.default_rng([a.seed, 100])
    eval_key = jax.random.key(a.seed + 1)
    t0 = time.perf_counter()
    losses, probs = [], []
    short = NeedleTask(dataclasses.replace(task.config, min_prompt_len=a.short_len * 3 // 4,
                                           max_prompt_len=a.short_len))
    bar = tqdm(range(a.steps), desc="pretrain", unit="step", mininterval=2.0)
    steps_done = 0
    for step in bar:
        curriculum = step < a.short_steps
        tokens, starts, a_len = make_batch(short if curriculum else task, rng, a.batch_size)
        loss, p_pos = train_step(model, optimizer, jnp.asarray(tokens), jnp.asarray(starts),
                                 a_len)
        losses.append(float(loss))
        probs.append(float(np.asarray(p_pos)[:-1].mean()))   # the values, EOS excluded
        steps_done = step + 1
        if step % 10 == 0 or step == a.steps - 1:
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}",
                            p_right=f"{np.mean(probs[-20:]):.3f}")
        if (a.target is not None and not curriculum and step >= a.short_steps + 20
                and np.mean(probs[-20:]) >= a.target):
            tqdm.write(f"step {step + 1}: running p_right {np.mean(probs[-20:]):.3f} >= target "
                       f"{a.target}: stopping")
            break
        if a.eval_every and (step + 1) % a.eval_every == 0:
            m = estimate_reward(model, task, np.random.default_rng([a.seed, 300]), 64, 1.0,
                                eval_key)
            tqdm.write(f"step {step + 1}: loss {np.mean(losses[-20:]):.4f}, p_right "
                       f"{np.mean(probs[-20:]):.3f}, temperature-1 "
                       f"reward {m['reward']:.3f} per needle {m['per_needle']}")
    bar.close()
    train_time = time.perf_counter() - t0
    final_loss = float(np.mean(losses[-20:]))
    print(f"trained {steps_done} steps in {train_time:.0f} s; final loss (mean of last 20 steps) "
          f"{final_loss:.4f}, teacher-forced p(right value) {np.mean(probs[-20:]):.3f}", flush=True)

    metrics = {"final_loss": final_loss, "train_seconds": round(train_time, 1),
               "steps": steps_done, "p_right_teacher_forced": float(np.mean(probs[-20:])),
               "parameters": int(nparams),
               "context_free_ceiling": task.context_free_ceiling()}
    for name, temp in (("greedy", 0.0), ("temperature_1", 1.0)):
        m = estimate_reward(model, task, np.random.default_rng([a.seed, 200]), a.eval_prompts,
                            temp, jax.random.key(a.seed + 2))
        metrics[f"reward_{name}"] = m["reward"]
        metrics[f"per_needle_{name}"] = m["per_needle"]
        print(f"reward ({name}, {a.eval_prompts} held-out prompts): {m['reward']:.4f}; per "
              f"needle {m['per_needle']}", flush=True)
    if a.no_save:
        return 0

    out = Path(a.out)
    save_qwen3(model, out, cfg)
    reloaded, _ = load_qwen3(out)
    probe = jnp.asarray(make_batch(task, np.random.default_rng(7), 2)[0])
    np.testing.assert_allclose(np.asarray(reloaded(probe)), np.asarray(model(probe)), rtol=1e-5,
                               atol=1e-5)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_readme(out, a, cfg, metrics, argv)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"saved {out} ({size / 2**20:.2f} MiB)")
    return 0


def write_readme(out: Path, a, cfg: ModelConfig, m: dict, argv) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    cmd = " ".join([".venv/bin/python", "scripts/make_demo_model.py", *map(shlex.quote, args)])
    (out / "README.md").write_text(f"""# demo model

A tiny Qwen3 ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, \
{cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads of {cfg.head_dim}, MLP \
{cfg.intermediate_size}, vocabulary {cfg.vocab_size}, tied embeddings; {m['parameters']:,} \
parameters, float32) pre-trained with supervised next-token cross-entropy on the answer tokens \
of the needle task (`sparrow_jax.data.NeedleTask`, default `NeedleConfig`: prompts of 192-256 \
tokens hiding 3 needles, the answer is their values in order then EOS = {EOS}). Training stops \
early on purpose: the model is decent but not perfect, so GRPO (`configs/demo.yaml`) has room \
to improve it.

Made on CPU (JAX {jax.__version__}) with

```bash
{cmd}
```

(seed {a.seed}; {m['steps']} AdamW steps of {a.batch_size} fresh prompts, peak lr {a.lr}, \
{m['train_seconds']:.0f} s on a 2-core CPU: a curriculum of {a.short_steps} steps on short \
prompts of {a.short_len * 3 // 4}-{a.short_len} tokens, then full-length prompts until the \
running teacher-forced probability of the right needle values reached {a.target}).

| metric | value |
| --- | --- |
| final training loss (mean of the last 20 steps, nats per answer token) | {m['final_loss']:.4f} |
| reward, greedy ({a.eval_prompts} held-out prompts, partial credit) | {m['reward_greedy']:.4f} |
| reward, temperature 1 | {m['reward_temperature_1']:.4f} |
| per-needle accuracy, greedy | {m['per_needle_greedy']} |
| per-needle accuracy, temperature 1 | {m['per_needle_temperature_1']} |
| context-free ceiling (`NeedleTask.context_free_ceiling()`) | {m['context_free_ceiling']:.4f} |

`metrics.json` holds the same numbers. Rewards are sampled with a plain full-forward loop
(dense attention); the GRPO demo's rollouts decode sparsely and score a little differently.
""")


if __name__ == "__main__":
    sys.exit(main())
