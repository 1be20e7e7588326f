"""Memory per device: hand-worked figures for the tiny model and Qwen3-1.7B (the comparison
with XLA's own memory analysis on simulated devices is in tests/test_sharding.py)."""

import pytest

from sparrow_jax.config import ModelConfig
from sparrow_jax.memory import memory_per_device

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def test_tiny_model_on_2x2x2_by_hand():
    est = memory_per_device(TINY, (2, 2, 2), micro_batch_size=16, seq_len=64, response_len=32,
                            kv_pages=10, compute_bytes=4)
    # elements per device: embed and lm_head 64*32/4 each, q and o 32*32/4, k and v 32*16/4,
    # gate, up, down 32*64/4, norms whole (32 + 32 + 8 + 8 + 32)
    elements = 2 * 512 + 2 * 256 + 2 * 128 + 3 * 512 + 112
    assert est.weights == est.grads == 4 * elements == 13760
    assert est.optimizer == 2 * 13760
    # 10 pages x 16 tokens x (K, V) x 1 layer x 1 KV head (2 over tensor 2) x 8 x 2 bytes
    assert est.kv_pages == 10 * 16 * 2 * 1 * 1 * 8 * 2
    # b = 16 / (2 x 2) = 4 rows, T = 64: internals 4*64*(32 + 2*16 + 2*8 + 4*32)*4 bytes,
    # attention 4 x 4*2*64*64*4, the kept input 4*64*32*4; head: 4*32*32*4 hidden,
    # 3 x [128, 32] float32 logits blocks, and (rows split) the head weight's tensor shard
    # [32, 32] gathered (4 bytes here) and its float32 gradient
    layer = 4 * 64 * 208 * 4 + 4 * 4 * 2 * 64 * 64 * 4
    head = 4 * 32 * 32 * 4 + 3 * 128 * 32 * 4 + 32 * 32 * (4 + 4)
    assert est.activations == 4 * 64 * 32 * 4 + layer + head
    assert est.total == 13760 * 4 + est.kv_pages + est.activations


def test_qwen3_1_7b_on_four_fsdp_devices_by_hand():
    cfg = ModelConfig.preset("qwen3-1.7b")
    est = memory_per_device(cfg, {"data": 1, "fsdp": 4, "tensor": 1}, micro_batch_size=4,
                            seq_len=8192, response_len=4096, kv_pages=2048)
    # per layer: q, o 2048^2, k, v 2048*1024, MLP 3*2048*6144, all split 4 ways, plus the norms
    # (2*2048 + 2*128) whole; the tied embedding 151936*2048 / 4; the final norm 2048
    per_layer = (2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 6144) // 4 + 4352
    elements = 28 * per_layer + 151936 * 2048 // 4 + 2048
    assert elements == 430_236_672
    assert est.weights == 4 * elements and est.optimizer == 8 * elements
    # 2048 pages x 16 tokens x (K, V) x 28 layers x 8 KV heads x 128 x bf16
    assert est.kv_pages == 32768 * 2 * 28 * 8 * 128 * 2 == 3_758_096_384


def test_rejects_unknown_axes():
    with pytest.raises(ValueError, match="axis_sizes: model=2 is not a mesh axis"):
        memory_per_device(TINY, {"model": 2}, micro_batch_size=1, seq_len=8, response_len=4)
