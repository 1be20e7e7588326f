"""Paged KV cache: allocator counts and errors, page writes and summaries against float64 NumPy
recomputed from scratch, fork, and dense paged decode attention against a NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.attention.allocator import (NULL_PAGE, PageAllocator, PoolExhaustedError,
                                             pages_needed)
from sparrow_jax.attention.paged_cache import append_token, fork, init_cache, write_chunk
from pallas_kernels.paged_attend_gpu import table_splits
from pallas_kernels.sparse_decode_gpu import GpuDecodeTuning
from sparrow_jax.attention.paged_dense import (pallas_blocks, paged_attention,
                                               paged_attention_pallas,
                                               paged_attention_pallas_jax,
                                               paged_attention_xla)
from sparrow_jax.config import ModelConfig

# A cache-shaped config: only layers, kv heads and head_dim matter here.
CFG = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)


# ---------------------------------------------------------------- allocator


def test_shared_prompt_pages_are_stored_once():
    # P=16. Prompt A: 37 tokens = 2 full pages + 5; each of 4 samples needs ceil(47/16)=3 pages,
    # of which 2 are the shared full pages: 2 + 4*1 = 6. Prompt B: 16 tokens = 1 full page, no
    # partial; ceil(26/16)=2 per sample: 1 + 4*1 = 5. Total 11 (worked by hand).
    alloc = PageAllocator(64, 16, seed=3)
    a = alloc.allocate([37, 16], 4, 10)
    assert pages_needed([37, 16], 4, 10, 16).tolist() == [6, 5]
    assert alloc.num_free == 63 - 11
    assert np.count_nonzero(alloc.refcount) == 11
    assert np.unique(a.page_table[a.page_table != NULL_PAGE]).size == 11
    t = a.page_table
    assert t.shape == (8, 3)
    # A's two full pages: one physical page each, counted by all 4 samples.
    for j in range(2):
        assert len(set(t[:4, j])) == 1 and alloc.refcount[t[0, j]] == 4
    assert len(set(t[:4, 2])) == 4                    # the partial page: one per sample
    assert len(set(t[4:, 0])) == 1 and alloc.refcount[t[4, 0]] == 4
    assert (t[4:, 2] == NULL_PAGE).all()              # B's rows need 2 pages
    # Prefill writes A's partial page into sample 0's page; samples 1..3 get copies. B: none.
    assert a.copy_src.tolist() == [t[0, 2]] * 3 and a.copy_dst.tolist() == t[1:4, 2].tolist()
    assert a.prompt_rows.tolist() == [0, 4] and a.prompt_index.tolist() == [0] * 4 + [1] * 4
    assert (a.prefill_page_table == t[[0, 4]]).all()
    assert NULL_PAGE not in alloc.refcount.nonzero()[0]


def test_release_frees_shared_pages_with_the_last_sharer():
    alloc = PageAllocator(32, 4)
    a = alloc.allocate([9], 3, 3)          # full 2 shared, ceil(12/4)=3 -> 1 own each: 5
    assert alloc.num_free == 31 - 5
    shared = a.page_table[0, :2]
    alloc.release(a.seq_ids[0])
    alloc.release(a.seq_ids[1])
    assert alloc.num_free == 31 - 3 and (alloc.refcount[shared] == 1).all()
    alloc.release(a.seq_ids[2])
    assert alloc.num_free == 31 and not alloc.refcount.any()
    with pytest.raises(KeyError, match="not allocated"):
        alloc.release(a.seq_ids[2])
    b = alloc.allocate([30], 1, 0)         # the freed pages are usable again
    assert alloc.num_free == 31 - 8 and NULL_PAGE not in b.page_table[0]


def test_request_that_cannot_fit_fails_before_any_work():
    alloc = PageAllocator(20, 16)          # 19 usable
    alloc.allocate([100], 1, 0)            # 7 pages
    free, refs = alloc.num_free, alloc.refcount.copy()
    # 3 prompts of 40 tokens, 2 samples, 40 new: 2 + 2*(5-2) = 8 each -> 24 pages.
    with pytest.raises(PoolExhaustedError, match=r"needs 24 pages.*19 usable pages, 12 free"):
        alloc.allocate([40, 40, 40], 2, 40)
    assert alloc.num_free == free and (alloc.refcount == refs).all()
    with pytest.raises(PoolExhaustedError, match="needs 13 pages.*12 free.*release"):
        alloc.allocate([200], 1, 0)
    with pytest.raises(ValueError, match="at least one token"):
        alloc.allocate([0], 1, 4)


def test_shuffled_pool_scatters_pages_and_fixed_width():
    a = PageAllocator(100, 8, seed=0).allocate([20, 3], 2, 30, max_pages_per_seq=9)
    assert a.page_table.shape == (4, 9)
    used = a.page_table[0, :7]
    assert not (np.diff(used) == 1).all()
    with pytest.raises(ValueError, match="max_pages_per_seq=2 is too small"):
        PageAllocator(100, 8).allocate([20], 1, 0, max_pages_per_seq=2)


# ---------------------------------------------------------------- page writes and summaries


def _expected_pool(keys, tables, lengths, p):
    """Independent placement: token t of row b at page tables[b, t // p], slot t % p."""
    out = {}
    for b, n in enumerate(lengths):
        for t in range(n):
            out[(tables[b, t // p], t % p)] = keys[b][t]
    return out


def _check_summaries(cache, keys_per_layer, tables, lengths, p, dtype, quest):
    """Centroids (and Quest min/max) of every full page, and each row's partial-page
    accumulators, against float64 NumPy over the keys as stored."""
    for layer, keys in enumerate(keys_per_layer):
        stored = [np.asarray(jnp.asarray(k, dtype).astype(jnp.float32), np.float64)
                  for k in keys]                                  # [T, H, D] per row
        k_pages = np.asarray(cache.k_pages[layer].astype(jnp.float32), np.float64)
        for (page, slot), key in _expected_pool(stored, tables, lengths, p).items():
            np.testing.assert_array_equal(k_pages[:, page, slot], key)
        cent = np.asarray(cache.centroids[layer].astype(jnp.float32), np.float64)
        tol = 1e-6 if dtype == jnp.float32 else 2 ** -7
        for b, n in enumerate(lengths):
            for j in range(n // p):                               # full pages
                page_keys = stored[b][j * p:(j + 1) * p]
                np.testing.assert_allclose(cent[:, tables[b, j]], page_keys.mean(0),
                                           rtol=tol, atol=tol)
                if quest:
                    np.testing.assert_array_equal(
                        np.asarray(cache.kmin[layer][:, tables[b, j]].astype(jnp.float32)),
                        page_keys.min(0))
                    np.testing.assert_array_equal(
                        np.asarray(cache.kmax[layer][:, tables[b, j]].astype(jnp.float32)),
                        page_keys.max(0))
            tail = stored[b][(n // p) * p:n]
            if len(tail):
                # Published only when full (the pool starts zeroed here).
                assert not cent[:, tables[b, n // p]].any()
                np.testing.assert_allclose(np.asarray(cache.partial_sum[layer, b]), tail.sum(0),
                                           rtol=1e-6, atol=1e-5)
                if quest:
                    np.testing.assert_array_equal(
                        np.asarray(cache.partial_min[layer, b].astype(jnp.float32)), tail.min(0))
                    np.testing.assert_array_equal(
                        np.asarray(cache.partial_max[layer, b].astype(jnp.float32)), tail.max(0))


@pytest.mark.parametrize("dtype,scorer,impl", [
    (jnp.float32, "quest", "xla"), (jnp.bfloat16, "centroid", "xla"),
    (jnp.float32, "centroid", "pallas"), (jnp.bfloat16, "centroid", "pallas"),
    (jnp.bfloat16, "quest", "pallas")])
def test_prefill_write_then_appends_match_summaries_from_scratch(dtype, scorer, impl):
    # impl: the appends through the XLA scatters or the one-kernel write (interpreted off GPU).
    p = 4
    prompt = [6, 8, 1]                          # mid-page, page boundary, one token
    steps = 11
    alloc = PageAllocator(40, p, seed=1).allocate(prompt, 1, steps)
    tables = alloc.page_table
    cache = init_cache(CFG, 40, tables, page_size=p, dtype=dtype, scorer=scorer)
    rng = np.random.default_rng(0)
    h, d, layers = CFG.num_key_value_heads, CFG.head_dim, CFG.num_hidden_layers
    total = max(prompt) + steps
    keys = rng.normal(size=(layers, 3, total, h, d)).astype(np.float32) * 3 + 1
    vals = rng.normal(size=(layers, 3, total, h, d)).astype(np.float32)
    lengths = jnp.asarray(prompt, jnp.int32)
    # Prefill in two chunks of 4 (tokens 0..7, padding past each row's length).
    for layer in range(layers):
        for start in (0, 4):
            sl = slice(start, start + 4)
            cache = write_chunk(cache, layer, jnp.asarray(keys[layer, :, sl]),
                                jnp.asarray(vals[layer, :, sl]), start, lengths)
    _check_summaries(cache, [[keys[l, b, :n] for b, n in enumerate(prompt)]
                             for l in range(layers)], tables, prompt, p, dtype,
                     scorer == "quest")
    # Appends: row 2 sits out steps 3..5 (inactive: nothing written, nothing counted).
    pos = np.array(prompt)
    for step in range(steps):
        active = np.array([True, True, not 3 <= step <= 5])
        for layer in range(layers):
            idx = np.minimum(pos, total - 1)
            k = jnp.asarray(keys[layer, np.arange(3), idx])
            v = jnp.asarray(vals[layer, np.arange(3), idx])
            cache = append_token(cache, layer, k, v, jnp.asarray(pos, jnp.int32),
                                 jnp.asarray(active), impl=impl)
        pos = pos + active
    final = pos.tolist()
    assert final == [prompt[0] + steps, prompt[1] + steps, prompt[2] + steps - 3]
    _check_summaries(cache, [[keys[l, b, :n] for b, n in enumerate(final)]
                             for l in range(layers)], tables, final, p, dtype,
                     scorer == "quest")
    # Values land where the keys do.
    v_pages = np.asarray(cache.v_pages[1].astype(jnp.float32))
    for (page, slot), val in _expected_pool(
            [np.asarray(jnp.asarray(vals[1, b], dtype).astype(jnp.float32)) for b in range(3)],
            tables, final, p).items():
        np.testing.assert_array_equal(v_pages[:, page, slot], val)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_inactive_rows_and_padding_write_nothing(impl):
    p = 4
    alloc = PageAllocator(16, p).allocate([3, 5], 1, 4)
    cache = init_cache(CFG, 16, alloc.page_table, page_size=p, dtype=jnp.float32)
    k = jnp.ones((2, 8, 2, 8))
    cache = write_chunk(cache, 0, k, k, 0, jnp.asarray([3, 5], jnp.int32))
    assert int(jnp.count_nonzero(cache.k_pages[0][0, :, :, 0])) == 3 + 5
    cache = append_token(cache, 0, jnp.full((2, 2, 8), 2.0), jnp.full((2, 2, 8), 2.0),
                         jnp.asarray([3, 5], jnp.int32), jnp.asarray([False, False]), impl=impl)
    assert np.asarray(cache.k_pages).max() == 1.0 and np.asarray(cache.v_pages).max() == 1.0
    # Past the page table (3 pages of 4 here): dropped, not wrapped onto the last page.
    sums = np.asarray(cache.partial_sum)
    cache = append_token(cache, 0, jnp.full((2, 2, 8), 3.0), jnp.full((2, 2, 8), 3.0),
                         jnp.asarray([12, 13], jnp.int32), jnp.asarray([True, True]), impl=impl)
    assert np.asarray(cache.k_pages).max() == 1.0
    np.testing.assert_array_equal(np.asarray(cache.partial_sum), sums)


def test_fork_copies_the_partial_page_and_accumulators():
    p = 4
    a = PageAllocator(50, p, seed=5).allocate([6, 4], 3, 5)
    cache = init_cache(CFG, 50, a.prefill_page_table, page_size=p, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    keys = rng.normal(size=(CFG.num_hidden_layers, 2, 8, 2, 8)).astype(np.float32)
    lengths = jnp.asarray(a.prompt_lengths)
    for layer in range(CFG.num_hidden_layers):
        cache = write_chunk(cache, layer, jnp.asarray(keys[layer]), jnp.asarray(keys[layer]), 0,
                            lengths)
    cache = cache.replace(lengths=lengths)
    forked = fork(cache, a.page_table, a.prompt_index, a.copy_src, a.copy_dst)
    assert forked.lengths.tolist() == [6, 6, 6, 4, 4, 4]
    kp = np.asarray(forked.k_pages)
    for s in range(6):
        b = a.prompt_index[s]
        for t in range(a.prompt_lengths[b]):
            np.testing.assert_array_equal(kp[:, :, a.page_table[s, t // p], t % p],
                                          keys[:, b, t])
        np.testing.assert_allclose(np.asarray(forked.partial_sum[:, s]),
                                   keys[:, b, 4:6].sum(1) if b == 0 else
                                   np.asarray(cache.partial_sum[:, 1]), rtol=1e-6)


def test_init_cache_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown scorer"):
        init_cache(CFG, 8, np.zeros((1, 2), np.int32), scorer="topk")
    with pytest.raises(ValueError, match=r"entries must lie in \[0, 8\)"):
        init_cache(CFG, 8, np.full((1, 2), 8, np.int32))


# ---------------------------------------------------------------- dense paged attention


def _np_paged_attention(q, k_pages, v_pages, table, lengths):
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    b, hq, d = q.shape
    h, _, p, _ = k_pages.shape
    r = hq // h
    out = np.zeros((b, hq, d))
    for i in range(b):
        n = int(lengths[i])
        pos = np.arange(n)
        pages = table[i, pos // p]
        for head in range(hq):
            kv = head // r
            k = k_pages[kv, pages, pos % p]              # [n, D]
            v = v_pages[kv, pages, pos % p]
            s = k @ q[i, head] / np.sqrt(d)
            w = np.exp(s - s.max())
            out[i, head] = (w / w.sum()) @ v
    return out


def _attention_case():
    h, n, p, d = 2, 30, 4, 16
    rng = np.random.default_rng(7)
    k = rng.normal(size=(h, n, p, d)).astype(np.float32)
    v = rng.normal(size=(h, n, p, d)).astype(np.float32)
    q = rng.normal(size=(3, 6, d)).astype(np.float32)
    table = rng.permutation(n)[:21].reshape(3, 7).astype(np.int32)
    lengths = np.array([1, 28, 13], np.int32)
    return q, k, v, table, lengths


def test_paged_attention_xla_matches_numpy():
    q, k, v, table, lengths = _attention_case()
    want = _np_paged_attention(q, k, v, table, lengths)
    got = paged_attention(*(jnp.asarray(x) for x in (q, k, v, table, lengths)), impl="xla")
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)
    auto = jax.jit(paged_attention_xla)(*(jnp.asarray(x) for x in (q, k, v, table, lengths)))
    np.testing.assert_allclose(np.asarray(auto), want, rtol=2e-5, atol=2e-6)


def test_paged_attention_pallas_jax_interpreted_matches_numpy():
    # The table width 7 is padded to fit the kernel's blocks (2 pages x 2 splits -> 8).
    q, k, v, table, lengths = _attention_case()
    want = _np_paged_attention(q, k, v, table, lengths)
    got = paged_attention_pallas_jax(*(jnp.asarray(x) for x in (q, k, v, table, lengths)),
                                     pages_per_compute_block=2, k_splits=2, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("splits", [1, 2, 3, "balanced"])
@pytest.mark.parametrize("q_heads", [6, 2, 10])
def test_paged_attention_pallas_interpreted_matches_numpy(splits, q_heads):
    """The sparse step's attention kernel over whole page tables: a table width (7 pages) no
    multiple of the block (4 pages), rows of 1 token, a partial last page and the full table,
    GQA groups of 3, 1 and 5 heads, splits sharing a row's pages unevenly (3 splits of 2
    blocks) or finding none; and the programs shared out by the rows' pages
    (``balanced``)."""
    q, k, v, table, lengths = _attention_case()
    q = np.random.default_rng(q_heads).normal(size=(3, q_heads, q.shape[-1])).astype(np.float32)
    lengths = np.array([1, 28, 13], np.int32)
    want = _np_paged_attention(q, k, v, table, lengths)
    tuning = (GpuDecodeTuning(block_pages=4, balanced=True) if splits == "balanced" else
              GpuDecodeTuning(block_pages=4, splits=splits))
    got = paged_attention_pallas(*(jnp.asarray(x) for x in (q, k, v, table, lengths)),
                                 tuning=tuning, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)


def test_dense_impl_auto_takes_the_gpu_kernel_where_it_fits():
    from sparrow_jax.attention.paged_dense import resolve_impl

    bf16 = jnp.bfloat16
    assert resolve_impl("auto", 128, 16, bf16, platform="gpu") == "pallas"
    assert resolve_impl("auto", 96, 16, bf16, platform="gpu") == "xla"       # head_dim no pow2
    assert resolve_impl("auto", 128, 16, jnp.float32, platform="gpu") == "xla"
    assert resolve_impl("pallas_jax", 128, 16, bf16, platform="gpu") == "pallas_jax"
    with pytest.raises(ValueError, match="powers of two"):
        q, k, v, table, lengths = (jnp.asarray(x) for x in _attention_case())
        paged_attention_pallas(q[..., :12], k[..., :12], v[..., :12], table, lengths)


@pytest.mark.parametrize("batch,width,want", [
    (32, 516, 9),      # 8K table: one wave would be 528 // 256 = 2 splits; 516 / 64 -> 9
    (19, 2052, 33),    # 32K table: 3 for one wave, 33 for the 64-page rule
    (1, 2052, 66),     # one row: the wave (528 // 8), more than the rule
    (4, 3, 1)])        # a 3-page table: one split (fewer blocks than anything else)
def test_table_splits_give_long_rows_programs(batch, width, want):
    """Hand-worked on the H100's 132 SMs (4 attention programs each), 8 KV heads, 4-page
    blocks: at least one split per 64 pages, at least one wave for the batch."""
    assert table_splits(batch, 8, width, 4) == want


@pytest.mark.parametrize("m", [1, 3, 5, 8, 13, 100, 256])
def test_pallas_blocks_are_powers_of_two(m):
    """Triton needs power-of-two array sizes (a 5-page table failed on the H100 before)."""
    block, splits, width = pallas_blocks(m, 8, 16)
    for x in (block, splits):
        assert x >= 1 and x & (x - 1) == 0
    assert block <= min(8, m) and width >= m and width % (block * splits) == 0


def test_paged_attention_rejects_bad_shapes():
    q, k, v, table, lengths = (jnp.asarray(x) for x in _attention_case())
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention(q[:, :5], k, v, table, lengths)
    with pytest.raises(ValueError, match="lengths"):
        paged_attention(q, k, v, table, lengths[:2])
    with pytest.raises(ValueError, match="unknown dense paged attention impl"):
        paged_attention(q, k, v, table, lengths, impl="cuda")


def write_steps(cfg, dtype, p=4, steps=11, scorer="centroid"):
    """Caches for the XLA and the kernel writes, and the steps' (active [3], positions [3]) of
    appends that start pages, fill them, skip inactive rows and run past the table."""
    alloc = PageAllocator(40, p, seed=2).allocate([3, 4, 7], 1, steps - 4)
    caches = {impl: init_cache(cfg, 40, alloc.page_table, page_size=p, dtype=dtype,
                               scorer=scorer)
              for impl in ("xla", "pallas")}

    def each_step():
        pos = np.array([3, 4, 7])
        for step in range(steps):
            active = np.array([True, step % 3 != 1, True])
            yield jnp.asarray(active), jnp.asarray(pos, jnp.int32)
            pos = pos + active
        assert pos.max() > alloc.page_table.shape[1] * p      # some writes fell off the table

    return caches, each_step()


@pytest.mark.parametrize("dtype,scorer", [(jnp.float32, "centroid"), (jnp.bfloat16, "centroid"),
                                          (jnp.bfloat16, "quest")])
def test_kernel_write_equals_xla_write_bit_for_bit(dtype, scorer):
    """The one-kernel cache write (interpreted here) against the XLA scatters: every array equal
    after the steps of :func:`write_steps` (a Quest cache: its running min and max and its
    kmin and kmax too)."""
    caches, steps = write_steps(CFG, dtype, scorer=scorer)
    rng = np.random.default_rng(5)
    for active, pos in steps:
        k, v = (jnp.asarray(rng.normal(size=(3, 2, 8)) * 3, jnp.float32) for _ in range(2))
        for impl in caches:
            for layer in range(2):
                caches[impl] = append_token(caches[impl], layer, k, v, pos, active, impl=impl)
    for a, b in zip(jax.tree.leaves(caches["xla"]), jax.tree.leaves(caches["pallas"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_append_impl_is_checked():
    cache = init_cache(CFG, 8, np.zeros((1, 2), np.int32), page_size=4, scorer="quest")
    k = jnp.zeros((1, 2, 8))
    with pytest.raises(ValueError, match="unknown impl 'triton'"):
        append_token(cache, 0, k, k, jnp.zeros((1,), jnp.int32), jnp.ones((1,), bool),
                     impl="triton")
