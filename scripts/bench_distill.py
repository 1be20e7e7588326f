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
- ``ratio``: lora_update_s / dense_phase_s (target: <= 0.60 at 8K, issue 16);
- ``lora_update_all_dense_s`` (``--floor``): the LoRA update with every layer attending
  densely through cuDNN, i.e. what everything but the sparse attention costs.

``--impls`` names the teacher-forced attention implementations to time (the first one also
times the LoRA update; e.g. ``pallas,xla`` puts the flash kernel beside the XLA chunks in one
run); ``--tuning block_q=128,block_k=64,...`` sets the kernel's TeacherForcedTuning.

Both updates use the same remat setting (``--no-remat`` turns it off for both). The student's
log-probs are checked against a dense-budget run of itself at the first length (a sparse
forward at a budget covering every page must equal the dense forward): ``check_max_abs``;
``--no-check`` skips it.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. python3 scripts/bench_distill.py \\
        --lengths 8192 --impls pallas,xla --out $OUT/distill_8k.json
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. python3 scripts/bench_distill.py \\
        --lengths 32768 --repeats 2 --no-check --out $OUT/distill_32k.json

CPU smoke test: ``--preset tiny --lengths 128 --rows 2 --prompt-len 32 --repeats 1``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.attention.teacher_forced import resolve_impl
from sparrow_jax.benchmarking import write_record
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.lora import LoRAParam, attach_lora
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
    p.add_argument("--impls", default="auto", help="teacher-forced attention impls, comma "
                   "separated: auto, pallas, xla")
    p.add_argument("--tuning", default="", help="TeacherForcedTuning fields, e.g. "
                   "block_q=128,block_k=64")
    p.add_argument("--floor", action="store_true", help="also time the LoRA update with every "
                   "layer dense (cuDNN): the cost of everything but the sparse attention")
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


def _tuning(spec: str):
    """``block_q=128,warps=8`` -> TeacherForcedTuning (None when empty)."""
    if not spec:
        return None
    from pallas_kernels.teacher_forced_gpu import TeacherForcedTuning

    fields = dict(item.split("=") for item in spec.split(","))
    return TeacherForcedTuning(**{k: int(v) for k, v in fields.items()})


def _student_fns(model, rule, *, remat):
    """The student's summed log-probs, jitted: forward alone, and its gradient into the
    adapters; each a function of (tokens, prompt_lengths, budget_pages)."""
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)

    def total(m, *xs):
        return jnp.sum(student_logprobs(m, *xs, temperature=1.0, rule=rule))

    def merged(lora_, rest_, remat_):
        m = nnx.merge(graphdef, lora_, rest_)
        m.remat = remat_
        return m

    # Remat changes nothing without a backward pass (and nnx.remat needs NNX's transforms).
    fwd = jax.jit(lambda lora_, rest_, *xs: total(merged(lora_, rest_, False), *xs))
    # NNX's grad, so the model's nnx.remat sees its variables at the expected trace level.
    fwd_bwd = jax.jit(lambda lora_, rest_, *xs: nnx.grad(total, argnums=nnx.DiffState(
        0, LoRAParam))(merged(lora_, rest_, remat), *xs))
    return (lambda *xs: fwd(lora, rest, *xs)), (lambda *xs: fwd_bwd(lora, rest, *xs))


def _dense_budget_check(model, rule, args, cfg) -> float:
    """max |student log-probs at a budget holding every page - the all-dense forward's|."""
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)
    dense_budgets = jnp.zeros_like(args[2])          # 0: every step dense
    dense_rule = dataclasses.replace(rule, dense_layers=tuple(range(cfg.num_hidden_layers)))
    got, want = (jax.jit(lambda l_, r_, *xs, rule_=rule_: student_logprobs(
        nnx.merge(graphdef, l_, r_), *xs, temperature=1.0, rule=rule_))(
        lora, rest, args[0], args[1], dense_budgets) for rule_ in (rule, dense_rule))
    return float(jnp.abs(got - want).max())


def main(argv=None) -> dict:
    a = parse_args(argv)
    cfg = ModelConfig.preset(a.preset)
    on_cpu = jax.default_backend() == "cpu"
    dtype = {"auto": jnp.float32 if on_cpu else jnp.bfloat16, "float32": jnp.float32,
             "bfloat16": jnp.bfloat16}[a.dtype]
    dcfg = DistillConfig()
    model = attach_lora(init_model(cfg, seed=0, dtype=dtype), dcfg.lora, jax.random.key(1))
    schedule = BudgetSchedule.from_spec(a.schedule, a.page_size)
    tuning = _tuning(a.tuning)
    impls = [x for x in a.impls.split(",") if x]
    optim = OptimConfig(learning_rate=1e-6)
    rng = np.random.default_rng(0)
    results = []
    for r in (int(x) for x in a.lengths.split(",")):
        ucfg = UpdateConfig(micro_batch_size=a.rows, length_multiple=a.page_size,
                            remat=not a.no_remat)
        tokens, prompts, lengths, budgets, logp, adv = _batch(rng, a.rows, a.prompt_len, r,
                                                              cfg.vocab_size, schedule)
        topk = rng.integers(0, cfg.vocab_size, (a.rows, r, 1)).astype(np.int32)
        plan = [[np.arange(a.rows)]]
        args = tuple(jnp.asarray(x) for x in (tokens, prompts, budgets))
        row = {"response_len": r, "rows": a.rows}
        for n, impl in enumerate(impls):
            rule = SparseRule(page_size=a.page_size, impl=impl, tuning=tuning)
            fwd, fwd_bwd = _student_fns(model, rule, remat=not a.no_remat)
            name = resolve_impl(impl, cfg.head_dim)
            row[f"tf_forward_s_{name}"] = _median_time(
                lambda: jax.block_until_ready(fwd(*args)), a.repeats)
            row[f"tf_forward_backward_s_{name}"] = _median_time(
                lambda: jax.block_until_ready(fwd_bwd(*args)), a.repeats)
            print(json.dumps(row), flush=True)
            if n:
                continue
            row["impl"] = name
            policy = PolicyUpdater(ucfg, optim)
            distill = DistillUpdater(dcfg, ucfg, optim, rule)
            p_state, d_state = policy.init(model), distill.init(model)

            def dense_phase():
                batch = UpdateBatch(tokens, prompts, lengths, logp.copy(), logp, adv, topk)
                policy.update(model, p_state, batch, plan, 1.0, 0, fuse_top_k=1)

            dbatch = DistillBatch(tokens, prompts, lengths, budgets, logp, logp, adv)
            row["dense_phase_s"] = _median_time(dense_phase, a.repeats)
            row["lora_update_s"] = _median_time(
                lambda: distill.update(model, d_state, dbatch, plan, 1.0, 0), a.repeats)
            row["ratio"] = round(row["lora_update_s"] / row["dense_phase_s"], 3)
            if a.floor:
                # The same update with every layer attending densely through cuDNN: what the
                # rest of the model costs, a floor for any sparse attention no faster than it.
                floor = DistillUpdater(dcfg, ucfg, optim, dataclasses.replace(
                    rule, dense_layers=tuple(range(cfg.num_hidden_layers))))
                f_state = floor.init(model)
                row["lora_update_all_dense_s"] = _median_time(
                    lambda: floor.update(model, f_state, dbatch, plan, 1.0, 0), a.repeats)
            if not results and not a.no_check:
                row["check_max_abs"] = _dense_budget_check(model, rule, args, cfg)
            print(json.dumps(row), flush=True)
        results.append(row)
    return write_record(a.out, preset=a.preset, dtype=jnp.dtype(dtype).name,
                        schedule=a.schedule, remat=not a.no_remat, results=results)


if __name__ == "__main__":
    main()
