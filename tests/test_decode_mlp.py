"""The decode step's SiLU x up kernel against float64 NumPy, and its dispatch (the model's decode
form with it: tests/test_decode_gemm.py). On CPU the kernel runs in Pallas' interpreter; on a
GPU the same tests compile it with Triton."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.decode_mlp_gpu import gate_up_silu_pallas, padded_rows
from sparrow_jax.models.decode_kernels import gate_up_silu
from sparrow_jax.models.lora import Linear

INTERPRET = jax.default_backend() != "gpu"


def _numpy_gate_up(x, gate, up, dtype):
    """float64 products, each rounded to ``dtype`` where the model rounds: the projections,
    SiLU, the product."""
    def rnd(a):
        return a.astype(dtype).astype(np.float64)

    x, gate, up = (np.asarray(a, np.float64) for a in (x, gate, up))
    g, u = rnd(x @ gate), rnd(x @ up)
    return rnd(rnd(g / (1 + np.exp(-g))) * u)


@pytest.mark.parametrize("rows", [1, 5, 19, 33, 100])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_matches_float64(rows, dtype):
    rng = np.random.default_rng(rows)
    k, f = 256, 192                      # two K steps, three programs of 64 columns
    x = jnp.asarray(rng.normal(size=(rows, k)), dtype)
    gate, up = (jnp.asarray(rng.normal(size=(k, f)) / np.sqrt(k), dtype) for _ in range(2))
    got = np.asarray(gate_up_silu_pallas(x, gate, up, interpret=INTERPRET), np.float64)
    assert got.shape == (padded_rows(rows), f)
    np_dtype = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32
    want = _numpy_gate_up(x, gate, up, np_dtype)
    # bfloat16: a float32 sum rounded may land one unit in the last place (2^-8) from the
    # float64 sum rounded.
    tol = 2 ** -7 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(got[:rows], want, rtol=tol, atol=tol * np.abs(want).max())
    np.testing.assert_array_equal(got[rows:], 0.0)


def _linears(k, f, dtype=jnp.float32, param_dtype=jnp.float32, *, bias=False):
    return [Linear(k, f, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                   rngs=nnx.Rngs(seed)) for seed in (1, 2)]


def test_dispatch():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 128)), jnp.float32)
    gate, up = _linears(128, 64)
    w = lambda lin: np.asarray(lin.kernel[...])
    assert gate_up_silu(x, gate, up, impl="xla") is None
    if jax.default_backend() != "gpu":
        assert gate_up_silu(x, gate, up, impl="auto") is None
    # Weights kept in float32 for a bfloat16 layer would be cast every step: XLA's ops.
    assert gate_up_silu(x, *_linears(128, 64, dtype=jnp.bfloat16), impl="pallas") is None
    # A bias, or an adapter in use, is more than x @ kernel: XLA's ops.
    assert gate_up_silu(x, *_linears(128, 64, bias=True), impl="pallas") is None
    adapted, _ = _linears(128, 64)
    adapted.add_lora(4, 2.0, jax.random.key(0))
    assert gate_up_silu(x, adapted, up, lora=True, impl="pallas") is None
    assert gate_up_silu(x, adapted, up, lora=False, impl="pallas") is not None
    out = gate_up_silu(x, gate, up, impl="pallas")
    np.testing.assert_allclose(np.asarray(out)[:3],
                               _numpy_gate_up(x, w(gate), w(up), np.float32),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"multiples of 64 and 64 \(float32's K step"):
        gate_up_silu(x, *_linears(128, 48), impl="pallas")
    many = jnp.zeros((129, 128), jnp.float32)      # past float32's 128 rows: XLA, or an error
    if jax.default_backend() == "gpu":
        assert gate_up_silu(many, gate, up, impl="auto") is None
    with pytest.raises(ValueError, match="129 rows of float32 is more than the kernel's 128"):
        gate_up_silu(many, gate, up, impl="pallas")
    bf16 = _linears(128, 64, jnp.bfloat16, jnp.bfloat16)
    assert gate_up_silu(many, *bf16, impl="pallas").shape == (256, 64)
    with pytest.raises(ValueError, match="unknown impl"):
        gate_up_silu(x, gate, up, impl="triton")
