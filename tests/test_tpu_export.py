"""Lowering for TPU from this host: ``jax.export(..., platforms=["tpu"])`` of the TPU sparse
decode kernels for v5e, v5p and v6e at Qwen3's head layouts, asserting the Mosaic kernels are in
the module. Export runs JAX's Pallas -> Mosaic lowering, not Mosaic's compiler, so a layout the
TPU rejects can still pass here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.sparse_decode_tpu import PAGE_SIZES, sparse_decode_tpu_checked
from pallas_kernels.tpu_targets import CHIPS, abstract_tpu, export_for_tpu, tpu_mesh

S = jax.ShapeDtypeStruct
LAYOUTS = [(16, 8), (32, 8), (40, 8)]     # Qwen3 q heads / KV heads (1.7B-4B, 8B, 14B)
KERNELS = ("sparse_decode_tpu_score", "sparse_decode_tpu_select", "sparse_decode_tpu_attend")


def sparse_step_args(hq, hkv, page_size, *, batch=8, context=32768, d=128, dtype=jnp.bfloat16):
    m = context // page_size
    n = batch * m
    return (S((batch, hq, d), dtype), S((hkv, n, page_size, d), dtype),
            S((hkv, n, page_size, d), dtype), S((hkv, n, d), dtype), S((batch, m), jnp.int32),
            S((batch,), jnp.int32), S((batch,), jnp.int32))


def assert_mosaic(exported, names=KERNELS):
    text = exported.mlir_module()
    assert text.count("tpu_custom_call") >= len(names)
    for name in names:
        assert name in text, name


@pytest.mark.parametrize("chip", sorted(CHIPS))
@pytest.mark.parametrize("hq,hkv", LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_sparse_step_lowers_for_tpu(chip, hq, hkv, page_size):
    exported = export_for_tpu(
        lambda *a: sparse_decode_tpu_checked(*a, page_size=page_size),
        *sparse_step_args(hq, hkv, page_size), chip=chip)
    assert exported.platforms == ("tpu",)
    assert_mosaic(exported)


@pytest.mark.parametrize("chip", sorted(CHIPS))
def test_quest_step_lowers_for_tpu(chip):
    """scorer="quest": the scoring kernel takes kmin and kmax and the group's 4 heads."""
    q, k, v, cent, *rest = sparse_step_args(32, 8, 16)
    exported = export_for_tpu(
        lambda q, k, v, kmin, kmax, *a: sparse_decode_tpu_checked(q, k, v, (kmin, kmax), *a,
                                                                  page_size=16),
        q, k, v, cent, cent, *rest, chip=chip)
    assert_mosaic(exported)


def test_streamed_lists_lower_for_tpu():
    """Batch 64 at 32K: the page lists outgrow SMEM and are copied in row by row."""
    from pallas_kernels.sparse_decode_tpu import list_sizes
    assert list_sizes(64, 8, 2048, 16)[2]
    assert_mosaic(export_for_tpu(lambda *a: sparse_decode_tpu_checked(*a, page_size=16),
                                 *sparse_step_args(32, 8, 16, batch=64), chip="v5p"))


def test_unknown_chip_is_named():
    with pytest.raises(ValueError, match="unknown TPU chip 'v4'"):
        with abstract_tpu("v4"):
            pass


def test_engine_decode_step_lowers_with_the_tpu_kernels():
    """One decode step of a tiny model (head_dim 128, bf16 cache) exported for TPU from this
    host with impl="auto": the sparse layer holds the TPU kernels (``auto`` decides per platform
    when lowering), while the same step run here on CPU takes the reference."""
    from flax import nnx

    from sparrow_jax.attention.allocator import PageAllocator
    from sparrow_jax.attention.decode import decode_step
    from sparrow_jax.attention.paged_cache import init_cache
    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.qwen3 import init_model

    cfg = ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    graphdef, params = nnx.split(init_model(cfg, seed=0))
    alloc = PageAllocator(40, 16, seed=0).allocate([100, 60], 1, 4)
    cache = init_cache(cfg, 40, alloc.page_table, page_size=16, dtype=jnp.bfloat16)

    def step(params, cache, tokens, budget):
        return decode_step(nnx.merge(graphdef, params), cache, tokens, budget_pages=budget,
                           dense_layers=(0,), impl="auto")

    args = (params, cache, jnp.asarray([3, 5], jnp.int32), jnp.asarray([4, 4], jnp.int32))
    assert_mosaic(export_for_tpu(step, *args, chip="v5p"))
    cpu_text = jax.jit(step).lower(*args).as_text()
    assert "tpu_custom_call" not in cpu_text


def test_tensor_split_decode_step_lowers_for_tpu():
    """The rollout's decode step with the weights and KV heads split over ``tensor`` = 2
    (``shard_map`` over an abstract mesh of two v5p devices, the decode copy's blocks by
    ``rollout_specs``): each shard's sparse layer holds the TPU kernels on its one KV head, and
    the only collectives are the row-parallel sums: two a layer and the embedding's one."""
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P, use_abstract_mesh

    from sparrow_jax.attention.allocator import PageAllocator
    from sparrow_jax.attention.decode import decode_step
    from sparrow_jax.attention.paged_cache import init_cache
    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.qwen3 import init_model
    from sparrow_jax.rollout.decode_loop import cache_specs
    from sparrow_jax.sharding import rollout_specs

    cfg = ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    graphdef, params = nnx.split(init_model(cfg, seed=0, dtype=jnp.bfloat16))
    alloc = PageAllocator(40, 16, seed=0).allocate([100, 60], 1, 4)
    cache = init_cache(cfg, 40, alloc.page_table, page_size=16, dtype=jnp.bfloat16)
    mesh = tpu_mesh("v5p", (1, 1, 2), ("data", "fsdp", "tensor"))
    rows = P(("data", "fsdp"))
    specs = (rollout_specs(params, 2), cache_specs(cache), rows, rows)
    args = jax.tree.map(lambda x, spec: S(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
                        (params, cache, jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32)), specs)

    def step(params, cache, tokens, budget):
        return decode_step(nnx.merge(graphdef, params), cache, tokens, budget_pages=budget,
                           dense_layers=(0,), impl="auto", tensor_axis="tensor")

    with use_abstract_mesh(mesh):
        exported = jax.export.export(jax.jit(jax.shard_map(
            step, mesh=mesh, in_specs=specs, out_specs=(rows, specs[1]), check_vma=False)),
            platforms=["tpu"])(*args)
    assert_mosaic(exported)
    text = exported.mlir_module()
    assert text.count("all_reduce") == 2 * cfg.num_hidden_layers + 1
    assert "all_gather" not in text
