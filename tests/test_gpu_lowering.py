"""The Pallas GPU kernels lowered to Triton for an H100 on this CPU-only host: JAX lowers a
``pallas_call`` to Triton IR when the abstract mesh names a GPU device, so what the Triton
lowering cannot take (a primitive, a shape, a dtype) fails here, in CI, and not first on a GPU
machine. What runs after lowering (Triton's passes, ptxas) still needs the GPU lane
(scripts/test_gpu.sh). The interpret-mode tests check what the kernels compute; these check that
the GPU can be handed them."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import mesh as mesh_lib

from pallas_kernels.sparse_decode_gpu import GpuDecodeTuning, sparse_decode_pallas
from pallas_kernels.teacher_forced_gpu import (TeacherForcedTuning, page_masked_attention,
                                               select_pages_kernel)

H100 = mesh_lib.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                               platform="gpu")


def triton_kernels(fn, *args) -> list[str]:
    """The names of the Triton kernels in ``fn(*args)`` lowered for an H100 (raises where the
    Triton lowering cannot take a kernel)."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H100)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r'name = "([a-z_]+)", num_stages', text)


def decode_case(*, b=2, hq=8, hkv=2, d=128, p=16, pages=60, m=24, dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((hkv, pages, p, d)), dtype)
    return dict(q=jnp.asarray(rng.standard_normal((b, hq, d)), dtype), k=k, v=k,
                cent=jnp.mean(k.astype(jnp.float32), axis=2).astype(dtype),
                table=jnp.asarray(rng.permutation(pages)[:b * m].reshape(b, m), jnp.int32),
                lengths=jnp.asarray([m * p, 5 * p + 3][:b], jnp.int32),
                budget=jnp.full((b,), 8, jnp.int32))


@pytest.mark.parametrize("tuning,dtype,hq", [
    (GpuDecodeTuning(), jnp.bfloat16, 8),
    (GpuDecodeTuning(block_pages=8, splits=2, attend_stages=2, attend_warps=4), jnp.float16, 8),
    (GpuDecodeTuning(score_chunk=128, select_warps=8), jnp.bfloat16, 10)])   # group of 5
def test_sparse_decode_lowers_for_h100(tuning, dtype, hq):
    c = decode_case(dtype=dtype, hq=hq)

    def step(q, k, v, cent, table, lengths, budget):
        return sparse_decode_pallas(q, k, v, table, lengths, budget, page_size=16,
                                    centroids=cent, max_budget_pages=8, tuning=tuning)

    assert triton_kernels(step, *c.values()) == [
        "sparse_decode_score", "sparse_decode_select", "sparse_decode_attend"]


def test_teacher_forced_kernels_lower_for_h100():
    """The selection kernel and the attention's forward and backward (through ``jax.grad``)."""
    rng = np.random.default_rng(1)
    b, t, hq, hkv, d, p = 1, 128, 4, 2, 64, 16
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
               for h in (hq, hkv, hkv))
    words = jnp.full((b, hkv, 1, t), -1, jnp.int32)
    scores = jnp.asarray(rng.standard_normal((b, hkv, 16, t // p)), jnp.float32)

    def loss(q, k, v, words):
        out = page_masked_attention(q, k, v, words, p, TeacherForcedTuning())
        return jnp.sum(out.astype(jnp.float32))

    names = triton_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, words)
    assert len(names) == 3 and all(names), names     # forward, dk/dv, dq
    names = triton_kernels(
        lambda s: select_pages_kernel(s, jnp.full((16,), t // p, jnp.int32),
                                      jnp.full((b, 16), 4, jnp.int32)), scores)
    assert len(names) == 1, names


def test_an_unlowerable_kernel_fails_here():
    """The check can fail: a kernel using what the Triton lowering lacks (a sort) raises."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.sort(x_ref[...])

    def fn(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    with pytest.raises(Exception, match="sort"):
        triton_kernels(fn, jnp.zeros((16,), jnp.float32))
