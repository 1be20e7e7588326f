"""The rollout engine against the model's full forward, the teacher-forced sparse forward and the
sampling distribution it claims to draw from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import TINY_ENGINE, random_prompts
from sparrow_jax.attention.allocator import PoolExhaustedError
from sparrow_jax.attention.teacher_forced import TeacherForcedBudgets, make_teacher_forced_attend
from sparrow_jax.models.qwen3 import init_model, logits_from_hidden
from sparrow_jax.rollout.engine import RolloutConfig, generate
from sparrow_jax.rollout.types import FinishReason
from sparrow_jax.schedule import BudgetSchedule

P = 4
CFG = TINY_ENGINE
V = CFG.vocab_size
# Prompts ending mid-page, on a page boundary and after several pages.
PROMPT_LENGTHS = (5, 8, 21)


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


def _prompts(lengths=PROMPT_LENGTHS, seed=0):
    return random_prompts(lengths, seed=seed)


def _config(**kw):
    base = dict(n=1, max_new_tokens=12, temperature=0.0, page_size=P, prompt_multiple=16,
                steps_per_call=5, dense_layers=(0,), page_seed=3)
    return RolloutConfig(**{**base, **kw})


def _responses(ro):
    tokens, pl, rl = map(np.asarray, (ro.tokens, ro.prompt_lengths, ro.response_lengths))
    return [tokens[i, pl[i]:pl[i] + rl[i]].tolist() for i in range(len(pl))]


def _greedy_reference(model, prompts, steps):
    """Repeated argmax of the full dense forward (right padded to one width: a causal query never
    sees the padding after it); and each step's log_softmax (float64)."""
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda params, toks: nnx.merge(graphdef, params)(toks))
    width = max(map(len, prompts)) + steps
    out = []
    for prompt in prompts:
        seq, logps = list(prompt), []
        for _ in range(steps):
            toks = np.zeros((1, width), np.int32)
            toks[0, :len(seq)] = seq
            logits = np.asarray(forward(params, jnp.asarray(toks)), np.float64)[0, len(seq) - 1]
            logps.append(logits - logits.max() - np.log(np.exp(logits - logits.max()).sum()))
            seq.append(int(np.argmax(logits)))
        out.append((seq[len(prompt):], np.array(logps)))
    return out


@pytest.fixture(scope="module")
def greedy_refs(model):
    return _greedy_reference(model, _prompts(), 12)


def test_greedy_dense_equals_argmax_of_full_forward(model, greedy_refs):
    ro = generate(model, _prompts(), _config(), jax.random.key(0))
    assert _responses(ro) == [ref for ref, _ in greedy_refs]
    lp = np.asarray(ro.logprobs)
    for i, (ref, logps) in enumerate(greedy_refs):
        np.testing.assert_allclose(lp[i], logps[np.arange(12), ref], atol=2e-5)
        # The recorded top-k is the distribution's top-k, best first.
        order = np.argsort(-logps, axis=1, kind="stable")[:, :20]
        np.testing.assert_array_equal(np.asarray(ro.topk_ids[i]), order)
        np.testing.assert_allclose(np.asarray(ro.topk_logprobs[i]),
                                   np.take_along_axis(logps, order, 1), atol=2e-5)
    assert (np.asarray(ro.finish_reason) == FinishReason.LENGTH).all()
    assert (np.asarray(ro.budget_pages) == 0).all()  # no schedule: dense


def test_sparse_with_budget_beyond_every_sequence_equals_dense(model, greedy_refs):
    """n = 3 samples share each prompt's pages; a budget above any sequence's page count makes
    every sparse layer dense, so each sample is the dense greedy continuation."""
    ro = generate(model, _prompts(), _config(n=3), jax.random.key(0),
                  schedule=BudgetSchedule.fixed(64, page_size=P))
    want = [ref for ref, _ in greedy_refs for _ in range(3)]
    assert _responses(ro) == want
    lp = np.asarray(ro.logprobs)
    for row, i in enumerate(np.asarray(ro.prompt_index)):
        ref, logps = greedy_refs[i]
        np.testing.assert_allclose(lp[row], logps[np.arange(12), ref], atol=2e-5)
    budgets = np.asarray(ro.budget_pages)
    assert (budgets[:, 0] == 0).all() and (budgets[:, 1:] == 64).all()


def test_recorded_logprobs_equal_teacher_forced_sparse_forward(model):
    """Sampled rows decoded with a length-indexed schedule small enough to be sparse: the
    recorded log-probs and top-k are those of the teacher-forced sparse forward with the recorded
    budgets (docs/design.md, section 3)."""
    schedule = BudgetSchedule.from_table([0, 1, 2], bin_tokens=12, page_size=P)  # 3, 4, 5 pages
    prompts = _prompts((14, 23, 30), seed=1)
    ro = generate(model, prompts, _config(n=2, temperature=1.0, max_new_tokens=16),
                  jax.random.key(7), schedule=schedule)
    tokens, pl, rl = map(np.asarray, (ro.tokens, ro.prompt_lengths, ro.response_lengths))
    budgets = np.asarray(ro.budget_pages)
    s, t = tokens.shape
    # Response token j was produced by the query at position pl + j - 1 (length pl + j).
    tf_budgets = np.full((s, t), 3, np.int32)
    for b in range(s):
        for j in range(1, rl[b]):
            tf_budgets[b, pl[b] + j - 1] = budgets[b, j]
            assert budgets[b, j] == schedule.budget_pages(pl[b] + j)
    ran_sparse = -(-(pl[:, None] + np.arange(16)) // P) > budgets
    assert ran_sparse[:, 1:].mean() > 0.9

    attend = make_teacher_forced_attend(page_size=P, dense_layers=(0,), chunk_size=16)
    hidden, _ = model.forward(jnp.asarray(tokens), attend=attend,
                              state=TeacherForcedBudgets(jnp.asarray(tf_budgets),
                                                         jnp.asarray(pl)))
    logp = np.asarray(jax.nn.log_softmax(logits_from_hidden(hidden, model.head_weight()), -1))
    for b in range(s):
        pos = pl[b] - 1 + np.arange(rl[b])
        want = logp[b, pos, tokens[b, pos + 1]]
        np.testing.assert_allclose(np.asarray(ro.logprobs)[b, :rl[b]], want, atol=2e-5)
        np.testing.assert_allclose(np.asarray(ro.topk_logprobs)[b, :rl[b]],
                                   -np.sort(-logp[b, pos], axis=1)[:, :20], atol=2e-5)


def test_eos_and_stop_sequences_end_rows_early(model, greedy_refs):
    refs = [ref for ref, _ in greedy_refs]
    eos = refs[0][3]
    stop = tuple(refs[1][5:7])

    def expected_end(resp):
        for j in range(len(resp)):
            if resp[j] == eos:
                return j + 1, FinishReason.EOS
            if j >= 1 and tuple(resp[j - 1:j + 1]) == stop:
                return j + 1, FinishReason.STOP_SEQUENCE
        return len(resp), FinishReason.LENGTH

    ro = generate(model, _prompts(), _config(eos_ids=(eos,), stop_sequences=(stop,)),
                  jax.random.key(0))
    got = _responses(ro)
    for i, resp in enumerate(refs):
        length, reason = expected_end(resp)
        assert got[i] == resp[:length]
        assert int(ro.finish_reason[i]) == reason
    assert int(ro.finish_reason[0]) == FinishReason.EOS and int(ro.response_lengths[0]) <= 4
    assert int(ro.finish_reason[1]) != FinishReason.LENGTH
    # Nothing is written past a row's end.
    tokens, pl, rl = map(np.asarray, (ro.tokens, ro.prompt_lengths, ro.response_lengths))
    for i in range(len(pl)):
        assert (tokens[i, pl[i] + rl[i]:] == 0).all()
        assert (np.asarray(ro.logprobs)[i, rl[i]:] == 0).all()


def test_top_k_and_top_p_never_emit_excluded_tokens(model):
    ro = generate(model, _prompts(), _config(n=4, temperature=1.5, top_k=3, logprob_top_k=V),
                  jax.random.key(1))
    mask = np.asarray(ro.response_mask)
    tokens, pl = np.asarray(ro.tokens), np.asarray(ro.prompt_lengths)
    emitted = np.stack([tokens[b, pl[b]:pl[b] + 12] for b in range(len(pl))])
    top_ids = np.asarray(ro.topk_ids)
    assert mask.all()
    assert (emitted[..., None] == top_ids[..., :3]).any(-1).all()

    ro = generate(model, _prompts(), _config(n=4, temperature=1.5, top_p=0.4, logprob_top_k=V),
                  jax.random.key(2))
    tokens = np.asarray(ro.tokens)
    emitted = np.stack([tokens[b, pl[b]:pl[b] + 12] for b in range(len(pl))])
    probs = np.exp(np.asarray(ro.topk_logprobs, np.float64))      # sorted, the whole vocabulary
    rank = np.argmax(np.asarray(ro.topk_ids) == emitted[..., None], axis=-1)
    mass_before = np.take_along_axis(np.cumsum(probs, -1) - probs, rank[..., None], -1)[..., 0]
    assert (mass_before < 0.4 + 1e-6).all()
    # The recorded log-prob is the untruncated one even though sampling was truncated.
    np.testing.assert_allclose(np.asarray(ro.logprobs),
                               np.take_along_axis(np.log(probs), rank[..., None], -1)[..., 0],
                               atol=1e-5)


def test_temperature_one_first_token_frequencies_match_softmax(model):
    n = 2048
    ro = generate(model, _prompts((6,)), _config(n=n, temperature=1.0, max_new_tokens=1,
                                                 logprob_top_k=V), jax.random.key(3))
    first = np.asarray(ro.tokens)[:, 6]
    probs = np.zeros(V)
    probs[np.asarray(ro.topk_ids[0, 0])] = np.exp(np.asarray(ro.topk_logprobs[0, 0], np.float64))
    freq = np.bincount(first, minlength=V) / n
    assert abs(probs.sum() - 1) < 1e-5
    assert (np.abs(freq - probs) <= 4.5 * np.sqrt(probs * (1 - probs) / n) + 1e-3).all()


def test_pool_too_small_fails_before_work_with_numbers(model):
    with pytest.raises(PoolExhaustedError, match=r"needs \d+ pages .* 3 usable pages"):
        generate(model, _prompts(), _config(num_pages=4), jax.random.key(0))


def test_bad_requests_are_named(model):
    with pytest.raises(ValueError, match="n must be >= 1"):
        _config(n=0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        _config(prefill_chunk=6)
    with pytest.raises(ValueError, match="eos_ids"):
        generate(model, _prompts(), _config(eos_ids=(V,)), jax.random.key(0))
    with pytest.raises(ValueError, match="dense_layers"):
        generate(model, _prompts(), _config(dense_layers=(2,)), jax.random.key(0))
    with pytest.raises(ValueError, match="out of range"):
        generate(model, [[1, V + 3]], _config(), jax.random.key(0))
    with pytest.raises(ValueError, match="pages of 16 tokens"):
        generate(model, _prompts(), _config(), jax.random.key(0), schedule=BudgetSchedule.fixed(4))
    with pytest.raises(ValueError, match="budget"):
        BudgetSchedule.fixed(2, page_size=P)


def test_similar_batches_reuse_one_compilation(model):
    from sparrow_jax.rollout.decode_loop import run_chunk

    cfg = _config(n=2, temperature=1.0)
    generate(model, _prompts((9, 3)), cfg, jax.random.key(0))
    before = run_chunk._cache_size()
    generate(model, _prompts((4, 12), seed=5), cfg, jax.random.key(1))
    assert run_chunk._cache_size() == before


def test_decode_loop_weights_are_in_the_compute_dtype():
    from sparrow_jax.rollout.engine import model_params

    bf16 = init_model(CFG, seed=1, dtype=jnp.bfloat16)
    masters, cast = nnx.split(bf16)[1], model_params(bf16)[1]
    assert {x.dtype for x in jax.tree.leaves(masters)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(cast)} == {jnp.dtype(jnp.bfloat16)}
    for a, b in zip(jax.tree.leaves(masters), jax.tree.leaves(cast)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16), np.float32),
                                      np.asarray(b, np.float32))


@pytest.mark.skipif(jax.default_backend() == "cpu",
                    reason="XLA:CPU runs no bfloat16 x bfloat16 -> float32 dot (the LM head's); "
                           "runs on a GPU in scripts/test_gpu.sh")
def test_weights_cast_once_give_the_tokens_of_float32_masters(monkeypatch):
    """The decode loop's copy of the weights in the compute dtype (bfloat16) samples what
    running on the float32 masters, which every layer casts at use, samples: here the same
    tokens, and log-probs to bfloat16 rounding (on an H200 the masters' casts fuse into the
    matmuls and the log-probs differed by up to 6e-3, 1.6e-3 relative)."""
    from sparrow_jax.rollout import engine

    bf16 = init_model(CFG, seed=1, dtype=jnp.bfloat16)
    config, key = _config(temperature=1.0, n=2), jax.random.key(4)
    sparse = BudgetSchedule.fixed(3, page_size=P)
    got = generate(bf16, _prompts(), config, key, sparse)
    monkeypatch.setattr(engine, "model_params", lambda model, mesh=None: nnx.split(model))
    want = generate(bf16, _prompts(), config, key, sparse)
    for name in ("tokens", "response_lengths"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                      np.asarray(getattr(want, name)), err_msg=name)
    # bfloat16 keeps 8 bits: logits of ~4 round in steps of 2^-6
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=2e-2)
