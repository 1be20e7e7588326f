"""The GRPO update on a tiny model: the gradient equals a full-logits reference for 1, 2 and 4
micro-batches; only dense params train; non-finite values stop the update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparrow_jax.config import ModelConfig
from sparrow_jax.models.lora import LoRAConfig, LoRAParam, attach_lora
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rl.config import OptimConfig, UpdateConfig
from sparrow_jax.rl.losses import LossConfig
from sparrow_jax.rl.recompute import recompute
from sparrow_jax.rl.update import (NonFiniteError, PolicyUpdater, UpdateBatch, _add, _apply,
                                   mini_batch_gradients, split_model)
from sparrow_jax.rollout.types import Rollout

CFG = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
TEMP = 0.8


def _batch(seed=0, s=8, t=24, r=10):
    rng = np.random.default_rng(seed)
    p = rng.integers(3, 12, s).astype(np.int32)
    n = rng.integers(1, r + 1, s).astype(np.int32)
    tokens = rng.integers(0, 40, (s, t)).astype(np.int32)
    logp_old = rng.uniform(-4, -0.5, (s, r)).astype(np.float32)
    return UpdateBatch(tokens, p, n, logp_old,
                       (logp_old + rng.normal(0, 0.7, (s, r))).astype(np.float32),
                       rng.normal(0, 1, s).astype(np.float32))


def _reference_loss(model, b: UpdateBatch, loss_cfg: LossConfig):
    """Full [S, T, V] logits, explicit (row, position) index lists and the loss formula
    (docs/design.md, section 7)."""
    logp_all = jax.nn.log_softmax(model(jnp.asarray(b.tokens)) / TEMP, axis=-1)
    rows = np.concatenate([np.full(n, i) for i, n in enumerate(b.response_lengths)])
    slots = np.concatenate([np.arange(n) for n in b.response_lengths])
    pos = b.prompt_lengths[rows] + slots
    lp = logp_all[rows, pos - 1, b.tokens[rows, pos]]
    old = b.logp_old[rows, slots]
    w = np.minimum(np.exp(old - b.logp_sparse[rows, slots]), loss_cfg.tis_cap)
    a = b.advantages[rows]
    ratio = jnp.exp(lp - old)
    pg = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 0.8, 1.28))
    pg = jnp.where(a < 0, jnp.minimum(pg, -a * 3.0), pg)
    return jnp.sum(w * pg) / len(rows)


def _model(seed):
    """A tiny model with a non-trivial LoRA adapter: were LoRA on in a dense pass, the gradients
    below would differ from the LoRA-free reference."""
    model = init_model(CFG, seed=seed)
    attach_lora(model, LoRAConfig(rank=2), jax.random.key(seed))
    for _, v in nnx.state(model, LoRAParam).flat_state():
        v[...] = v[...] + 0.5
    return model


def _reference_grads(model, batch):
    graphdef, params, rest = split_model(model)
    plain = jax.tree.map(lambda x: x, params)

    def loss(p):
        return _reference_loss(nnx.merge(graphdef, p, rest, copy=True), batch, LossConfig())

    return jax.jit(jax.value_and_grad(loss))(plain)


@pytest.fixture(scope="module")
def setup():
    model = _model(1)
    batch = _batch()
    return (model, batch, *split_model(model), _reference_grads(model, batch))


@pytest.mark.parametrize("micro", [8, 4, 2])
def test_gradient_same_for_1_2_4_micro_batches_and_matches_reference(setup, micro):
    model, batch, graphdef, params, rest, (ref_loss, ref) = setup
    assert not any(isinstance(v, LoRAParam) for _, v in params.flat_state())
    cfg = UpdateConfig(micro_batch_size=micro, length_multiple=32)
    grads, metrics, none = mini_batch_gradients(graphdef, params, rest, batch, np.arange(8), cfg,
                                                TEMP)
    assert none is None
    ref_leaves = dict(jax.tree_util.tree_leaves_with_path(ref))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref_leaves[path]), rtol=2e-4,
                                   atol=2e-7, err_msg=str(path))
    np.testing.assert_allclose(metrics["loss"], float(ref_loss), rtol=1e-5)


def test_adamw_step_matches_hand_written_adam_and_leaves_lora():
    """One mini-batch step with no clipping equals a float64 AdamW step on the same gradient."""
    model = _model(3)
    batch = _batch(2)
    ucfg = UpdateConfig(length_multiple=32)
    ocfg = OptimConfig(learning_rate=1e-3, weight_decay=0.01, max_grad_norm=None)
    graphdef, params, rest = split_model(model)
    grads = mini_batch_gradients(graphdef, params, rest, batch, np.arange(8), ucfg, TEMP)[0]
    before = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    lora_before = jax.tree.map(np.asarray, nnx.state(model, LoRAParam))
    up = PolicyUpdater(ucfg, ocfg)
    up.update(model, up.init(model), batch, up.plan(jax.random.key(0), 8), TEMP, step=0)
    after = split_model(model)[1]

    def adam(p, g):  # first step: m = (1-b1) g, v = (1-b2) g^2, bias-corrected -> g / (|g| + eps)
        g = np.asarray(g, np.float64)
        return p - 1e-3 * (g / (np.abs(g) + 1e-8) + 0.01 * p)

    expected = jax.tree.map(adam, before, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6),
                 after, expected)
    jax.tree.map(np.testing.assert_array_equal, lora_before,
                 jax.tree.map(np.asarray, nnx.state(model, LoRAParam)))


def test_non_finite_gradient_stops_before_update():
    model = _model(4)
    batch = _batch(3)
    batch = batch._replace(logp_sparse=np.full_like(batch.logp_sparse, np.nan))
    before = jax.tree.map(np.asarray, split_model(model)[1])
    up = PolicyUpdater(UpdateConfig(length_multiple=32), OptimConfig())
    with pytest.raises(NonFiniteError, match="training step 17"):
        up.update(model, up.init(model), batch, up.plan(jax.random.key(0), 8), TEMP, step=17)
    jax.tree.map(np.testing.assert_array_equal, before,
                 jax.tree.map(np.asarray, split_model(model)[1]))


def test_fused_recompute_equals_separate_recompute():
    """Two epochs of two mini-batches: fusing the first mini-batch's recompute into its forward
    gives the separate recompute's statistics and (to float rounding) the same parameters."""
    rng = np.random.default_rng(5)
    base = _batch(4)
    k = 3
    actor = rng.integers(0, 40, base.logp_old.shape + (k,)).astype(np.int32)
    rollout = Rollout(tokens=jnp.asarray(base.tokens),
                      prompt_lengths=jnp.asarray(base.prompt_lengths),
                      response_lengths=jnp.asarray(base.response_lengths),
                      logprobs=jnp.asarray(base.logp_sparse), topk_ids=jnp.asarray(actor),
                      topk_logprobs=jnp.zeros(actor.shape), budget_pages=jnp.zeros(
                          base.logp_old.shape, jnp.int32), finish_reason=jnp.zeros(8, jnp.int32),
                      prompt_index=jnp.arange(8) // 2)
    ucfg = UpdateConfig(mini_batches=2, epochs=2, micro_batch_size=2, length_multiple=32)
    ocfg = OptimConfig(learning_rate=1e-3)
    results = []
    for fuse in (False, True):
        model = _model(6)
        dense = recompute(model, rollout, TEMP, micro_batch_size=4, top_k=5, length_multiple=32)
        up = PolicyUpdater(ucfg, ocfg)
        plan = up.plan(jax.random.key(1), 8)
        if fuse:
            # as the trainer: the separate pass covers only the rows outside the first mini-batch
            others = np.where(np.isin(np.arange(8), plan[0][0]), 0.0, 1.0)[:, None]
            batch = base._replace(logp_old=(dense.logprobs * others).astype(np.float32),
                                  actor_topk_ids=actor)
        else:
            batch = base._replace(logp_old=dense.logprobs.copy())
        logp_old = batch.logp_old.copy()
        _, metrics, fused = up.update(model, up.init(model), batch, plan, TEMP, step=0,
                                      fuse_top_k=5 if fuse else 0)
        # the caller's batch is left as it was
        np.testing.assert_array_equal(batch.logp_old, logp_old)
        assert (fused is None) == (not fuse)
        if fuse:
            rows = plan[0][0]
            assert fused.topk_ids.shape == dense.topk_ids.shape
            assert fused.actor_topk_logprobs.shape == dense.actor_topk_logprobs.shape
            for got, want in zip(fused, dense):
                np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows],
                                           rtol=1e-5, atol=1e-6)
            # the other rows were left for the separate pass
            assert not np.any(fused.logprobs[plan[0][1]])
        results.append((split_model(model)[1], metrics))
    (p0, m0), (p1, m1) = results
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), p0,
                         split_model(_model(6))[1])
    assert max(jax.tree.leaves(moved)) > 1e-3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=1e-4, atol=1e-6), p0, p1)
    np.testing.assert_allclose(m0["loss"], m1["loss"], rtol=1e-4, atol=1e-7)


def test_optimizer_step_reuses_the_moments_and_gradients_buffers():
    """The optimizer step's outputs alias its donated inputs: the new moments take the old
    ones' buffers and the new parameters the gradients', so the step holds no second copy of
    the state; the micro-batches' gradient sum likewise. An update consumes the optimizer
    state it is given; the parameters, which clones of the model share, stay."""
    model = _model(4)
    up = PolicyUpdater(UpdateConfig(length_multiple=32), OptimConfig())
    _, params, _ = split_model(model)
    state = up.init(model)
    grads = jax.tree.map(jnp.ones_like, params)

    def nbytes(tree):
        return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))
    step = _apply.lower(up.optimizer, params, state, grads).compile().memory_analysis()
    assert step.alias_size_in_bytes == nbytes(state) + nbytes(params)
    assert _add.lower(grads, grads).compile().memory_analysis().alias_size_in_bytes == nbytes(
        params)
    clone = nnx.clone(model)
    up.update(model, state, _batch(3), up.plan(jax.random.key(0), 8), TEMP, step=0)
    assert all(x.is_deleted() for x in jax.tree.leaves(state))
    assert not any(x.is_deleted() for x in jax.tree.leaves(split_model(clone)[1]))
