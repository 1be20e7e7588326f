"""Lowering the dense paths for TPU from this host: ``jax.export(..., platforms=["tpu"])`` for
v5e, v5p and v6e at Qwen3's head layouts (d=128, bf16) of dense paged decode and of splash causal
attention, forward and backward, through ``impl="auto"``; the Mosaic calls must be in the module.
Export runs JAX's Pallas -> Mosaic lowering, not Mosaic's compiler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.tpu_targets import CHIPS, export_for_tpu
from sparrow_jax.attention.dense import causal_attention
from sparrow_jax.attention.paged_dense import paged_attention

S = jax.ShapeDtypeStruct
LAYOUTS = [(16, 8), (32, 8), (40, 8)]     # Qwen3 q heads / KV heads (1.7B-4B, 8B, 14B)
BF16 = jnp.bfloat16


def mosaic_calls(exported) -> int:
    return exported.mlir_module().count("tpu_custom_call")


@pytest.mark.parametrize("chip", sorted(CHIPS))
@pytest.mark.parametrize("hq,hkv", LAYOUTS)
def test_dense_decode_lowers_for_tpu(chip, hq, hkv):
    batch, context, page = 8, 32768, 16
    m = context // page
    args = (S((batch, hq, 128), BF16), S((hkv, batch * m, page, 128), BF16),
            S((hkv, batch * m, page, 128), BF16), S((batch, m), jnp.int32),
            S((batch,), jnp.int32))
    exported = export_for_tpu(lambda *a: paged_attention(*a), *args, chip=chip)
    assert exported.platforms == ("tpu",)
    assert mosaic_calls(exported) == 1
    assert 'kernel_name = "paged_flash_attention_kernel_inline_seq_dim"' in exported.mlir_module()


def test_tensorcore_split_follows_the_chip():
    """Only v5p drives two TensorCores: the kernel splits by KV head there (by row when the KV
    heads are odd), and not at all on one core, where a split would hang it."""
    from pallas_kernels.paged_dense_tpu import megacore_mode, tensorcores
    from pallas_kernels.tpu_targets import abstract_tpu

    cores = {}
    for chip in sorted(CHIPS):
        with abstract_tpu(chip):
            cores[chip] = tensorcores()
    assert cores == {"v5e": 1, "v5p": 2, "v6e": 1}
    assert tensorcores() == 1     # this CPU host
    assert [megacore_mode(8, 4, 2), megacore_mode(1, 4, 2), megacore_mode(1, 3, 2),
            megacore_mode(8, 4, 1)] == ["kv_head", "batch", None, None]


@pytest.mark.parametrize("chip", sorted(CHIPS))
@pytest.mark.parametrize("hq,hkv", LAYOUTS)
def test_splash_forward_and_backward_lower_for_tpu(chip, hq, hkv):
    """T=1000 (padded to 1024): the forward is one splash kernel; jax.grad adds its dq and
    dk/dv kernels (and the forward saving residuals)."""
    q, kv = S((2, 1000, hq, 128), BF16), S((2, 1000, hkv, 128), BF16)
    fwd = export_for_tpu(lambda *a: causal_attention(*a), q, kv, kv, chip=chip)
    assert mosaic_calls(fwd) == 1

    def loss(q, k, v):
        return causal_attention(q, k, v).astype(jnp.float32).sum()

    bwd = export_for_tpu(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, chip=chip)
    assert mosaic_calls(bwd) == 3
    for name in ("splash_mha_fwd_residuals", "splash_mha_dq", "splash_mha_dkv"):
        assert f'kernel_name = "{name}' in bwd.mlir_module(), name
