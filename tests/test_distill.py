"""DistillSparse on a tiny model: LoRA never reaches a dense output; the student (teacher-forced
sparse forward, LoRA on) reproduces the rollout's log-probs; the loss against a float64 NumPy
reference; a few adapter steps raise the actor's acceptance rate against the dense policy."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.attention.teacher_forced import TeacherForcedBudgets, make_teacher_forced_attend
from sparrow_jax.config import ConfigError, ModelConfig
from sparrow_jax.mismatch import acceptance_rate
from sparrow_jax.models.lora import LoRAConfig, LoRAParam, attach_lora
from sparrow_jax.models.qwen3 import init_model, logits_from_hidden
from sparrow_jax.rl.config import OptimConfig, UpdateConfig
from sparrow_jax.rl.distill import (DistillBatch, DistillConfig, DistillUpdater, SparseRule,
                                    distill_loss, position_budgets, student_logprobs)
from sparrow_jax.rl.losses import LossConfig
from sparrow_jax.rl.recompute import recompute, response_rows
from sparrow_jax.rl.update import UpdateBatch, mini_batch_gradients, split_model
from sparrow_jax.rollout.engine import RolloutConfig, generate
from sparrow_jax.schedule import BudgetSchedule

P = 4
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
RULE = SparseRule(page_size=P, scorer="centroid", dense_layers=(0,), query_chunk=16)
# One compiled shape per pass: every micro-batch pads to 64 tokens.
UCFG = UpdateConfig(micro_batch_size=4, length_multiple=64, remat=False)
TEMP = 1.0
ROWS = 8


def _model(lora_noise: float = 0.0, cfg: ModelConfig = CFG):
    """The tiny model, its head scaled so the distributions are peaked (a near-uniform softmax
    would hide every mismatch), with a rank-4 adapter; ``lora_noise`` makes B non-zero."""
    model = init_model(cfg, seed=0)
    for w in (model.embed_tokens, model.lm_head):
        w[...] = w[...] * 60
    attach_lora(model, LoRAConfig(rank=4), jax.random.key(1))
    if lora_noise:
        for i, (_, v) in enumerate(nnx.state(model, LoRAParam).flat_state()):
            v[...] = v[...] + lora_noise * jax.random.normal(jax.random.key(10 + i), v.shape)
    return model


def _rollout(model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n).tolist() for n in (13, 24, 9, 19)]
    cfg = RolloutConfig(n=2, max_new_tokens=32, page_size=P, dense_layers=RULE.dense_layers,
                        logprob_top_k=4, prompt_multiple=8, pool_multiple=8)
    return generate(model, prompts, cfg, jax.random.key(2),
                    schedule=BudgetSchedule.fixed(3, page_size=P), lora=True)


@pytest.fixture(scope="module")
def noisy():
    model = _model(lora_noise=0.05)
    return model, _rollout(model)


def _student(model, ro, rule=RULE):
    fn = jax.jit(lambda st, *a: student_logprobs(nnx.merge(graphdef, st), *a, temperature=TEMP,
                                                 rule=rule))
    graphdef, state = nnx.split(model)
    return np.asarray(fn(state, ro.tokens, ro.prompt_lengths, ro.budget_pages))


def test_student_matches_rollout(noisy):
    model, ro = noisy
    mask = np.asarray(ro.response_mask)
    budgets = np.asarray(ro.budget_pages)
    total = np.asarray(ro.prompt_lengths)[:, None] + np.arange(budgets.shape[1])[None, :]
    assert ((budgets == 3) & (-(-total // P) > 6))[mask].mean() > 0.5   # mostly sparse steps
    got = _student(model, ro)
    np.testing.assert_allclose(got[mask], np.asarray(ro.logprobs)[mask], atol=2e-5)
    # Neither the dense policy nor the sparse actor without its adapter is that function.
    dense = recompute(model, ro, TEMP, top_k=4, length_multiple=64).logprobs
    assert np.abs(dense - np.asarray(ro.logprobs))[mask].mean() > 0.1
    plain = _student(init_model(CFG, seed=0), ro)   # no adapter at all
    assert np.abs(plain - got)[mask].mean() > 0.1


def test_student_through_the_kernel_matches_rollout():
    """The teacher-forced flash kernel (the GPU default; interpreted on CPU) as the student:
    head_dim 16, the kernel's smallest."""
    cfg = dataclasses.replace(CFG, head_dim=16)
    model = _model(lora_noise=0.05, cfg=cfg)
    ro = _rollout(model)
    mask = np.asarray(ro.response_mask)
    got = _student(model, ro, dataclasses.replace(RULE, impl="pallas"))
    np.testing.assert_allclose(got[mask], np.asarray(ro.logprobs)[mask], atol=2e-5)
    plain = _student(init_model(cfg, seed=0), ro)    # no adapter: not the same function
    assert np.abs(plain - got)[mask].mean() > 0.1


def test_position_budgets_hand_worked():
    # prompt 3, R 4: response token j >= 1 came from position 3 + j - 1; token 0 from prefill.
    got = position_budgets(jnp.asarray([[0, 5, 0, 4]]), jnp.asarray([3]), 9, page_size=2)
    np.testing.assert_array_equal(np.asarray(got), [[5, 5, 5, 5, 5, 4, 5, 5, 5]])
    got = position_budgets(jnp.asarray([[0, 3, 4, 6]]), jnp.asarray([3]), 9, page_size=2)
    np.testing.assert_array_equal(np.asarray(got), [[5, 5, 5, 3, 4, 6, 5, 5, 5]])


def test_dense_outputs_ignore_lora(noisy):
    """Random non-zero adapters: logits, recomputed statistics and the policy gradient are
    bit-identical to the same model without adapters."""
    model, ro = noisy
    plain = init_model(CFG, seed=0)
    for w in (plain.embed_tokens, plain.lm_head):
        w[...] = w[...] * 60
    tokens = jnp.asarray(ro.tokens)
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(plain(tokens)))
    assert not np.allclose(np.asarray(model(tokens, lora=True)), np.asarray(plain(tokens)))
    stats = [recompute(m, ro, TEMP, top_k=4, length_multiple=64) for m in (model, plain)]
    for a, b in zip(*stats):
        np.testing.assert_array_equal(a, b)
    batch = UpdateBatch(np.asarray(ro.tokens), np.asarray(ro.prompt_lengths),
                        np.asarray(ro.response_lengths), stats[0].logprobs,
                        np.asarray(ro.logprobs), np.linspace(-1, 1, ROWS).astype(np.float32))
    grads = [dict(mini_batch_gradients(*split_model(m), batch, np.arange(ROWS), UCFG,
                                       TEMP)[0].flat_state()) for m in (model, plain)]
    assert grads[0].keys() == grads[1].keys()
    # The two gradient programs differ in their (unused) adapter inputs: on CPU they compile to
    # the same arithmetic; a GPU compiles each with its own fusions and autotuned kernels, which
    # may round differently in the last bits (seen on the H100: 2e-9 absolute).
    same = (np.testing.assert_array_equal if jax.default_backend() == "cpu" else
            functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-8))
    for k in grads[0]:
        same(np.asarray(grads[0][k][...]), np.asarray(grads[1][k][...]))
    assert max(float(np.abs(np.asarray(g[...])).max()) for g in grads[0].values()) > 0


def _loss_np(new, old, sparse, dense, adv, mask, n, cap=3.0, low=0.2, high=0.28, dual=3.0,
             lam=0.001):
    """docs/design.md, sections 7 and 8, in float64."""
    a = adv[:, None]
    w = np.minimum(np.exp(old - sparse), cap)
    ratio = np.exp(new - old)
    pg = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - low, 1 + high))
    pg = np.where(a < 0, np.minimum(pg, -a * dual), pg)
    k = np.clip(dense - new, -20, 20)
    k3 = np.clip(np.exp(k) - k - 1, -10, 10)
    return float(np.sum(mask * (w * pg + lam * k3)) / n)


def test_loss_matches_float64_reference():
    new = np.array([[-1.0, -2.0, -0.5, -3.0], [-0.2, -4.0, -1.5, -2.0]])
    old = new + np.array([[0.0, 0.3, -0.4, 0.1], [0.5, -0.2, 0.0, 0.0]])  # ratios off 1
    sparse = old + np.array([[0.1, -2.0, 0.3, 0.0], [-1.5, 0.2, 0.0, 0.4]])  # w capped once
    dense = new + np.array([[0.5, -0.3, 30.0, 0.0], [-25.0, 1.0, 2.5, 9.0]])  # k clipped twice
    adv = np.array([1.3, -0.7])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float64)
    n = 9.0    # the mini-batch's count (more than this micro-batch's 7)
    for lam in (0.001, 0.5):
        got, metrics = distill_loss(*(jnp.asarray(x, jnp.float32) for x in (
            new, old, sparse, dense, adv, mask)), n, LossConfig(), lam)
        want = _loss_np(new, old, sparse, dense, adv, mask, n, lam=lam)
        np.testing.assert_allclose(float(got), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["distill_logp_gap"]),
                               np.sum(np.abs(old - sparse) * mask) / n, rtol=1e-6)

    # The gradient in logp_student (old held fixed) against central differences in float64.
    def f(x):
        return distill_loss(x, *(jnp.asarray(v, jnp.float32) for v in (
            old, sparse, dense, adv, mask)), n, LossConfig(), 0.5)[0]
    grad = np.asarray(jax.grad(f)(jnp.asarray(new, jnp.float32)))
    eps, num = 1e-6, np.zeros_like(new)
    for idx in np.ndindex(new.shape):
        d = np.zeros_like(new)
        d[idx] = eps
        num[idx] = (_loss_np(new + d, old, sparse, dense, adv, mask, n, lam=0.5)
                    - _loss_np(new - d, old, sparse, dense, adv, mask, n, lam=0.5)) / (2 * eps)
    np.testing.assert_allclose(grad, num, rtol=1e-4, atol=1e-6)


@functools.partial(jax.jit, static_argnums=(0,))
def _alpha(graphdef, state, tokens, prompt_lengths, budget_pages):
    """Exact acceptance rate ``[S, R]`` of the LoRA actor (teacher-forced) vs the dense
    policy."""
    model = nnx.merge(graphdef, state)
    r = budget_pages.shape[1]
    attend = make_teacher_forced_attend(page_size=P, dense_layers=RULE.dense_layers,
                                        chunk_size=RULE.query_chunk)
    budgets = TeacherForcedBudgets(position_budgets(budget_pages, prompt_lengths,
                                                    tokens.shape[1], P), prompt_lengths)
    hq, _ = model.forward(tokens, attend=attend, state=budgets, lora=True)
    hp, _ = model.forward(tokens)
    w = model.head_weight()
    return acceptance_rate(logits_from_hidden(response_rows(hp, prompt_lengths, r), w),
                           logits_from_hidden(response_rows(hq, prompt_lengths, r), w), TEMP)


def _mean_alpha(model, ro) -> float:
    alpha = _alpha(*nnx.split(model), ro.tokens, ro.prompt_lengths, ro.budget_pages)
    return float(np.asarray(alpha)[np.asarray(ro.response_mask)].mean())


def test_distill_steps_raise_acceptance_rate(noisy):
    """Three adapter steps on the actor's own rollouts (the fixture's; a second generate would
    cost a compile) raise its mean acceptance rate against the dense policy on them.
    Advantages 0 and a large lambda_kl isolate the pull toward the dense policy."""
    model = _model(lora_noise=0.05)
    ro = noisy[1]
    dense = recompute(model, ro, TEMP, top_k=4, length_multiple=64).logprobs
    batch = DistillBatch.of(ro, dense, np.zeros(ROWS, np.float32))
    up = DistillUpdater(DistillConfig(rank=4, lambda_kl=1.0, lr_multiple=5.0), UCFG,
                        OptimConfig(learning_rate=1e-4, max_grad_norm=None), RULE)
    before = split_model(model)[1]
    opt_state = up.init(model)
    alpha0 = _mean_alpha(model, ro)
    history = []
    for step in range(3):
        opt_state, metrics = up.update(model, opt_state, batch, [[np.arange(ROWS)]], TEMP, step)
        history.append(metrics)
    alpha1 = _mean_alpha(model, ro)
    assert history[0]["distill_logp_gap"] < 2e-5          # the student starts at the rollout
    assert history[-1]["distill_k3"] < history[0]["distill_k3"]
    assert alpha1 > alpha0 + 0.03, (alpha0, alpha1)        # seeded: 0.40 -> 0.46
    jax.tree.map(np.testing.assert_array_equal, before, split_model(model)[1])  # dense frozen


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="distill.lambda_kl"):
        DistillConfig(lambda_kl=-1.0)
    with pytest.raises(ConfigError, match="distill.targets"):
        DistillConfig(targets=("lm_head",))
    with pytest.raises(ConfigError, match="distill.rank"):
        DistillConfig(rank=0)
    optim = DistillConfig().optim(OptimConfig(learning_rate=1e-6))
    assert optim.learning_rate == pytest.approx(5e-6)
