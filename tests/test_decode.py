"""Prefill + decode steps through the paged cache against the model's full dense forward."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import max_rel_err
from sparrow_jax.attention.allocator import PageAllocator
from sparrow_jax.attention.decode import (decode_step, decode_step_jit, next_token_logits,
                                          next_token_logprobs, prefill, prefill_jit)
from sparrow_jax.attention.paged_cache import append_token, fork, init_cache
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.qwen3 import init_model

P = 4
TINY = ModelConfig.preset("tiny")
# Two layers compile in half the time of tiny's four; every test but the first uses it.
CFG = ModelConfig(vocab_size=TINY.vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16)


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


@pytest.fixture(scope="module")
def tiny():
    return init_model(TINY, seed=0)


def _prompts(lengths, seed):
    rng = np.random.default_rng(seed)
    toks = np.zeros((len(lengths), max(lengths)), np.int32)
    for i, n in enumerate(lengths):
        toks[i, :n] = rng.integers(1, CFG.vocab_size, n)
    return toks


def _full_logits(model, seqs):
    """The reference: the model's dense causal forward over each whole sequence (right padded:
    a causal query never sees the padding after it)."""
    width = max(len(s) for s in seqs)
    toks = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        toks[i, :len(s)] = s
    return np.asarray(model(jnp.asarray(toks)), np.float64)


def _prefill_and_fork(model, prompt_lengths, n, max_new, *, chunk_size, seed=0, pool=200,
                      page_size=P):
    alloc = PageAllocator(pool, page_size, seed=seed).allocate(prompt_lengths, n, max_new)
    toks = _prompts(prompt_lengths, seed)
    cache = init_cache(model.config, pool, alloc.prefill_page_table, page_size=page_size,
                       dtype=jnp.float32)
    hidden, cache = prefill_jit(model, cache, jnp.asarray(toks), jnp.asarray(alloc.prompt_lengths),
                                chunk_size=chunk_size)
    cache = fork(cache, alloc.page_table, alloc.prompt_index, alloc.copy_src, alloc.copy_dst)
    seqs = [list(toks[i, :prompt_lengths[i]]) for i in alloc.prompt_index]
    return alloc, cache, hidden[alloc.prompt_index], seqs


def _decode_random_tokens(model, cache, hidden, seqs, steps, *, seed):
    """``steps`` decode steps on random tokens (appended to ``seqs``) -> (next-token logits
    after the prompt and after each step, last hidden, cache)."""
    logits = [np.asarray(next_token_logits(model, hidden))]
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tokens = rng.integers(1, model.config.vocab_size, len(seqs)).astype(np.int32)
        for s, t in zip(seqs, tokens):
            s.append(t)
        hidden, cache = decode_step_jit(model, cache, jnp.asarray(tokens))
        logits.append(np.asarray(next_token_logits(model, hidden)))
    return logits, hidden, cache


def test_prefill_and_decode_match_full_forward_with_shared_prompts(tiny):
    model = tiny
    # Prompt lengths: mid-page (6), on a page boundary (8), shorter than a page (3); 3 samples
    # each fed different tokens after the shared prompt; pages scattered in the pool.
    lengths, n, steps = [6, 8, 3], 3, 7
    alloc, cache, hidden, seqs = _prefill_and_fork(model, lengths, n, steps, chunk_size=4)
    assert not (np.diff(alloc.page_table[0, :3]) == 1).all()
    logits, hidden, cache = _decode_random_tokens(model, cache, hidden, seqs, steps, seed=1)
    assert cache.lengths.tolist() == [len(s) for s in seqs]
    full = _full_logits(model, seqs)
    for row, s in enumerate(seqs):
        start = len(s) - steps - 1          # the last prompt position
        got = np.stack([lg[row] for lg in logits])
        assert max_rel_err(got, full[row, start:start + steps + 1]) < 1e-5, row
    # Samples of one prompt diverge only after the prompt.
    assert max_rel_err(logits[0][0], logits[0][1]) == 0.0
    assert max_rel_err(logits[-1][0], logits[-1][1]) > 1e-3
    lp = np.asarray(next_token_logprobs(model, hidden, temperature=0.7), np.float64)
    ref = full[np.arange(len(seqs)), [len(s) - 1 for s in seqs]] / 0.7
    ref = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - ref.max(-1, keepdims=True)
    np.testing.assert_allclose(lp, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("page_size,chunk", [(8, 16), (16, 16), (16, None)])
def test_longer_sequences_match_full_forward(tiny, page_size, chunk):
    lengths, n, steps = [37, 32, 17], 2, 20
    alloc, cache, hidden, seqs = _prefill_and_fork(tiny, lengths, n, steps, chunk_size=chunk,
                                                   page_size=page_size, seed=9)
    logits, _, _ = _decode_random_tokens(tiny, cache, hidden, seqs, steps, seed=10)
    full = _full_logits(tiny, seqs)
    for row, s in enumerate(seqs):
        start = len(s) - steps - 1
        got = np.stack([lg[row] for lg in logits])
        assert max_rel_err(got, full[row, start:start + steps + 1]) < 1e-5, row


def test_chunked_prefill_equals_one_shot(model):
    lengths = [13, 8, 5]
    alloc = PageAllocator(60, P, seed=2).allocate(lengths, 1, 0)
    toks = jnp.asarray(_prompts(lengths, 3))
    out = {}
    for chunk in (None, 8):
        cache = init_cache(CFG, 60, alloc.page_table, page_size=P, dtype=jnp.float32,
                           scorer="quest")
        out[chunk] = prefill_jit(model, cache, toks, jnp.asarray(lengths), chunk_size=chunk)
    (h1, c1), (h8, c8) = out[None], out[8]
    assert max_rel_err(h8, h1) < 1e-5
    ref = _full_logits(model, [list(np.asarray(toks[i, :n])) for i, n in enumerate(lengths)])
    assert max_rel_err(next_token_logits(model, h8),
                       ref[np.arange(3), np.array(lengths) - 1]) < 1e-5
    used = alloc.page_table[alloc.page_table != 0]
    for name in ("k_pages", "v_pages"):
        a, b = (np.asarray(getattr(c, name))[:, :, used] for c in (c1, c8))
        assert max_rel_err(b, a) < 1e-5, name
    for name in ("centroids", "kmin", "kmax"):
        assert max_rel_err(np.asarray(getattr(c8, name))[:, :, used],
                           np.asarray(getattr(c1, name))[:, :, used]) < 1e-5, name
    for name in ("partial_sum", "partial_min", "partial_max"):
        assert max_rel_err(getattr(c8, name), getattr(c1, name)) < 1e-5, name
    assert c8.lengths.tolist() == lengths


def test_inactive_rows_do_not_write_or_grow(model):
    alloc, cache, hidden, seqs = _prefill_and_fork(model, [5, 9], 1, 4, chunk_size=None, seed=4)
    rng = np.random.default_rng(5)
    for active in ([True, True], [True, False], [False, True], [True, True]):
        tokens = rng.integers(1, CFG.vocab_size, 2).astype(np.int32)
        before = np.asarray(cache.k_pages).copy()
        hidden, cache = decode_step_jit(model, cache, jnp.asarray(tokens),
                                        active=jnp.asarray(active))
        for row, (s, t, a) in enumerate(zip(seqs, tokens, active)):
            if a:
                s.append(t)
            else:   # its pages are as they were
                pages = alloc.page_table[row][alloc.page_table[row] != 0]
                np.testing.assert_array_equal(np.asarray(cache.k_pages)[:, :, pages],
                                              before[:, :, pages])
    assert cache.lengths.tolist() == [len(s) for s in seqs] == [8, 12]
    full = _full_logits(model, seqs)
    assert max_rel_err(next_token_logits(model, hidden),
                       full[[0, 1], [7, 11]]) < 1e-5


def test_decode_step_donates_the_cache(model):
    _, cache, _, _ = _prefill_and_fork(model, [4], 1, 2, chunk_size=None)
    old = cache.k_pages
    _, new = decode_step_jit(model, cache, jnp.asarray([3], jnp.int32))
    assert all(x.is_deleted() for x in old)
    assert not any(x.is_deleted() for x in new.k_pages)


@nnx.jit(static_argnames=("scorer", "dense_layers"))
def _sparse_reference_step(model, cache, tokens, budget, scorer, dense_layers):
    """The decode step with sparse layers given summaries recomputed by sparse_decode from the
    pages (centroids=None / summaries=None) instead of the cache's running summaries."""
    from sparrow_jax.attention.paged_dense import paged_attention
    from sparrow_jax.attention.sparse import sparse_decode

    pos = cache.lengths
    cache = cache.replace(lengths=pos + 1)
    active = jnp.ones_like(pos, bool)

    def attend(layer, q, k, v, c):
        c = append_token(c, layer, k[:, 0], v[:, 0], pos, active)
        args = (q[:, 0], c.k_pages[layer], c.v_pages[layer], c.page_table, c.lengths)
        if layer in dense_layers:
            return paged_attention(*args)[:, None], c
        return sparse_decode(*args, budget, page_size=P, scorer=scorer,
                             impl="reference")[:, None], c

    hidden, _ = model.forward(tokens[:, None], pos[:, None], attend=attend, state=cache)
    return hidden[:, 0]


@pytest.mark.parametrize("scorer", ["centroid", "quest"])
def test_sparse_layers_use_the_cache_summaries(model, scorer):
    pytest.importorskip("sparrow_jax.attention.sparse")
    lengths = [41, 30]
    alloc = PageAllocator(60, P, seed=6).allocate(lengths, 1, 3)
    toks = _prompts(lengths, 7)
    cache = init_cache(CFG, 60, alloc.page_table, page_size=P, dtype=jnp.float32, scorer=scorer)
    _, cache = prefill_jit(model, cache, jnp.asarray(toks), jnp.asarray(lengths), chunk_size=16)
    seqs = [list(toks[i, :n]) for i, n in enumerate(lengths)]
    rng = np.random.default_rng(8)
    budget = jnp.asarray([5, 4], jnp.int32)          # of 11 and 8 pages: sparse
    for i in range(2):
        tokens = jnp.asarray(rng.integers(1, CFG.vocab_size, 2).astype(np.int32))
        for s, t in zip(seqs, np.asarray(tokens)):
            s.append(t)
        want = _sparse_reference_step(model, cache, tokens, budget, scorer, dense_layers=(0,))
        if i == 0:   # while the cache is still the dense prefill's: budgets >= pages are dense
            wide = jnp.asarray([20, 20], jnp.int32)
            h_wide = _sparse_reference_step(model, cache, tokens, wide, scorer, dense_layers=(0,))
            full = _full_logits(model, seqs)[[0, 1], [n for n in lengths]]
            assert max_rel_err(next_token_logits(model, h_wide), full) < 1e-5
        hidden, cache = decode_step_jit(model, cache, tokens, budget_pages=budget,
                                        scorer=scorer, impl="reference", dense_layers=(0,))
        assert max_rel_err(hidden, want) < 1e-5
        if i == 0:
            assert max_rel_err(next_token_logits(model, hidden), full) > 1e-4   # sparse differs


def test_bad_input_is_rejected(model):
    alloc = PageAllocator(20, P).allocate([5, 3], 1, 2)
    cache = init_cache(CFG, 20, alloc.page_table, page_size=P, dtype=jnp.float32)
    toks = jnp.asarray(_prompts([5, 3], 0))
    with pytest.raises(ValueError, match="multiple of the page size 4"):
        prefill(model, cache, toks, jnp.asarray([5, 3]), chunk_size=6)
    with pytest.raises(ValueError, match="do not fit the page table"):
        prefill(model, cache, jnp.zeros((2, 9), jnp.int32), jnp.asarray([5, 3]))
    with pytest.raises(ValueError, match=r"prompt_lengths must have shape \(2,\)"):
        prefill(model, cache, toks, jnp.asarray([5]))
    with pytest.raises(ValueError, match=r"tokens must have shape \(2,\)"):
        decode_step(model, cache, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="unknown scorer"):
        decode_step(model, cache, jnp.zeros((2,), jnp.int32), scorer="exact")
    with pytest.raises(ValueError, match="built with scorer='quest'"):
        decode_step(model, cache, jnp.zeros((2,), jnp.int32), scorer="quest",
                    budget_pages=jnp.asarray([3, 3]))
