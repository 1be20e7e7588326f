"""DistillSparse cost benchmark (docs/design.md, section 8): the LoRA update against the dense
phase it rides along with, at training lengths.

Per response length, on one synthetic rollout batch (random tokens, the paper's budget schedule
recorded at every step, random advantages), times the median of ``--repeats`` runs after one
warm-up (which compiles):

- ``dense_phase_s``: :meth:`PolicyUpdater.update` with the dense recompute fused into its
  forward (recompute + GRPO update, LoRA off);
- ``lora_update_s``: :meth:`DistillUpdater.update` (student forward with logp_old fused, the
  loss, backward into the adapter, AdamW);
- ``tf_forward_s`` / ``tf_forward_backward_s``: the teacher-forced sparse student forward
  alone, and with its gradient into the adapter;
- ``ratio``: lora_update_s / dense_phase_s (target: <= 0.60 at 8K, issue 16).

Both updates use the same remat setting (``--no-remat`` turns it off for both). The student's
log-probs are checked against a dense-budget run of itself at the first length (a sparse
forward at a budget covering every page must equal the dense forward): ``check_max_abs``;
``--no-check`` skips it.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. python3 scripts/bench_distill.py \\
        --lengths 8192 --out $OUT/distill_8k.json
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. python3 scripts/bench_distill.py \\
        --lengths 32768 --repeats 2 --no-check --out $OUT/distill_32k.json

CPU smoke test: ``--preset tiny --lengths 128 --rows 2 --prompt-len 32 --repeats 1``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.config import ModelConfig
from sparrow_jax.models.lora import attach_lora
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rl.config import OptimConfig, UpdateConfig
from sparrow_jax.rl.distill import (DistillBatch, DistillConfig, DistillUpdater, SparseRule,
                                    student_logprobs)
from sparrow_jax.rl.update import PolicyUpdater, UpdateBatch
from sparrow_jax.schedule import BudgetSchedule


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-1.7b")
    p.add_argument("--lengths", default="8192,32768", help="response lengths (tokens)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--rows", type=int, default=1, help="rows of the batch (= micro-batch size)")
    p.add_argument("--schedule", default="qwen3-1.7b", help="BudgetSchedule.from_spec item")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-remat", action="store_true")
    p.add_argument("--no-check", action="store_true",
                   help="skip the dense-budget check (at 32K its all-pages gather is large)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _median_time(fn, repeats):
    fn()                                  # warm-up: compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _batch(rng, rows, prompt_len, r, vocab, schedule):
    t = prompt_len + r
    tokens = rng.integers(0, vocab, (rows, t)).astype(np.int32)
    prompts = np.full(rows, prompt_len, np.int32)
    lengths = np.full(rows, r, np.int32)
    budgets = np.array(schedule.budget_pages(prompt_len + np.arange(r)[None, :]
                                               + np.zeros((rows, 1), np.int64)), np.int32)
    budgets[:, 0] = 0                                   # token 0: the dense prefill
    logp = rng.uniform(-3, -0.1, (rows, r)).astype(np.float32)
    adv = rng.normal(0, 1, rows).astype(np.float32)
    return tokens, prompts, lengths, budgets, logp, adv


def main(argv=None) -> dict:
    a = parse_args(argv)
    cfg = ModelConfig.preset(a.preset)
    on_cpu = jax.default_backend() == "cpu"
    dtype = {"auto": jnp.float32 if on_cpu else jnp.bfloat16, "float32": jnp.float32,
             "bfloat16": jnp.bfloat16}[a.dtype]
    dcfg = DistillConfig()
    model = attach_lora(init_model(cfg, seed=0, dtype=dtype), dcfg.lora, jax.random.key(1))
    schedule = BudgetSchedule.from_spec(a.schedule, a.page_size)
    rule = SparseRule(page_size=a.page_size)
    optim = OptimConfig(learning_rate=1e-6)
    rng = np.random.default_rng(0)
    results = []
    for r in (int(x) for x in a.lengths.split(",")):
        ucfg = UpdateConfig(micro_batch_size=a.rows, length_multiple=a.page_size,
                            remat=not a.no_remat)
        policy = PolicyUpdater(ucfg, optim)
        distill = DistillUpdater(dcfg, ucfg, optim, rule)
        tokens, prompts, lengths, budgets, logp, adv = _batch(rng, a.rows, a.prompt_len, r,
                                                              cfg.vocab_size, schedule)
        topk = rng.integers(0, cfg.vocab_size, (a.rows, r, 1)).astype(np.int32)
        plan = [[np.arange(a.rows)]]
        p_state, d_state = policy.init(model), distill.init(model)

        def dense_phase():
            batch = UpdateBatch(tokens, prompts, lengths, logp.copy(), logp, adv, topk)
            policy.update(model, p_state, batch, plan, 1.0, 0, fuse_top_k=1)

        dbatch = DistillBatch(tokens, prompts, lengths, budgets, logp, logp, adv)

        def lora_update():
            distill.update(model, d_state, dbatch, plan, 1.0, 0)

        from flax import nnx
        from sparrow_jax.models.lora import LoRAParam
        graphdef, lora, rest = nnx.split(model, LoRAParam, ...)
        args = tuple(jnp.asarray(x) for x in (tokens, prompts, budgets))

        def total(m, *xs):
            return jnp.sum(student_logprobs(m, *xs, temperature=1.0, rule=rule))

        def merged(lora_, rest_, remat):
            m = nnx.merge(graphdef, lora_, rest_)
            m.remat = remat
            return m

        # Remat changes nothing without a backward pass (and nnx.remat needs NNX's transforms).
        fwd = jax.jit(lambda lora_, rest_, *xs: total(merged(lora_, rest_, False), *xs))
        # NNX's grad, so the model's nnx.remat sees its variables at the expected trace level.
        fwd_bwd = jax.jit(lambda lora_, rest_, *xs: nnx.grad(total, argnums=nnx.DiffState(
            0, LoRAParam))(merged(lora_, rest_, not a.no_remat), *xs))
        row = {"response_len": r, "rows": a.rows,
               "tf_forward_s": _median_time(lambda: jax.block_until_ready(fwd(lora, rest, *args)),
                                            a.repeats),
               "tf_forward_backward_s": _median_time(
                   lambda: jax.block_until_ready(fwd_bwd(lora, rest, *args)), a.repeats),
               "dense_phase_s": _median_time(dense_phase, a.repeats),
               "lora_update_s": _median_time(lora_update, a.repeats)}
        row["ratio"] = round(row["lora_update_s"] / row["dense_phase_s"], 3)
        if not results and not a.no_check:
            dense_budgets = np.zeros_like(budgets)          # 0: every step dense
            got = jax.jit(lambda l_, r_, *xs: student_logprobs(
                nnx.merge(graphdef, l_, r_), *xs, temperature=1.0, rule=rule))(
                lora, rest, args[0], args[1], jnp.asarray(dense_budgets))
            dense_rule = SparseRule(page_size=a.page_size, dense_layers=tuple(
                range(cfg.num_hidden_layers)))
            want = jax.jit(lambda l_, r_, *xs: student_logprobs(
                nnx.merge(graphdef, l_, r_), *xs, temperature=1.0, rule=dense_rule))(
                lora, rest, args[0], args[1], jnp.asarray(dense_budgets))
            row["check_max_abs"] = float(jnp.abs(got - want).max())
        print(json.dumps(row), flush=True)
        results.append(row)
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:],
           "preset": a.preset, "dtype": jnp.dtype(dtype).name, "schedule": a.schedule,
           "remat": not a.no_remat, "results": results}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
