"""The decode step's residual-stream kernels (a GEMM leaving split-K partial sums, and the sum +
residual add + RMSNorm) against float64 NumPy, their dispatch, and the model's decode form with
every decode kernel against the general forward. On CPU the kernels run in Pallas' interpreter;
on a GPU the same tests compile them with Triton."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import sparrow_jax.models.decode_kernels as decode_kernels
from pallas_kernels.decode_gemm_gpu import (add_norm_pallas, default_splits,
                                            gemm_partials_pallas, padded_rows)
from sparrow_jax.attention.dense import causal_attend
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.decode_kernels import project_add_norm
from sparrow_jax.models.lora import Linear, LoRAConfig, attach_lora
from sparrow_jax.models.qwen3 import init_model

INTERPRET = jax.default_backend() != "gpu"


def _np_dtype(dtype):
    return ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32


def _rnd(a, dtype):
    return np.asarray(a, np.float64).astype(_np_dtype(dtype)).astype(np.float64)


def _numpy_add_norm(proj, residual, weight, eps, dtype):
    """float64, rounded to ``dtype`` where the model rounds: the projection, the add, the
    normalised row, then the weight (cast) times it."""
    x = _rnd(np.asarray(residual, np.float64) + _rnd(proj, dtype), dtype)
    normed = _rnd(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps), dtype)
    return x, _rnd(_rnd(weight, dtype) * normed, dtype)


@pytest.mark.parametrize("rows,k,n,splits", [(1, 512, 128, None), (19, 768, 192, 2),
                                             (48, 512, 320, 4), (100, 256, 64, 1)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gemm_partials_sum_to_the_product(rows, k, n, splits, dtype):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.normal(size=(rows, k)), dtype)
    w = jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), dtype)
    got = np.asarray(gemm_partials_pallas(x, w, splits=splits, interpret=INTERPRET), np.float64)
    want_splits = splits or default_splits(k, n, 64, 256 // jnp.dtype(dtype).itemsize)
    assert got.shape == (want_splits, padded_rows(rows), n)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # float32 sums of exact products (bf16 x bf16 fits float32; float32 inputs at full
    # precision): a few units of float32's last place.
    np.testing.assert_allclose(got.sum(0)[:rows], want, rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(got[:, rows:], 0.0)


def test_default_splits_fill_one_wave():
    """Qwen3-1.7B's O, down and QKV shapes: the settings the H100 sweep found best (BENCHMARKS.md
    rollout run I), each within one wave of 132 programs."""
    assert default_splits(2048, 2048, 64, 128) == 4     # O: 32 column blocks x 4
    assert default_splits(6144, 2048, 64, 128) == 4     # down
    assert default_splits(2048, 4096, 64, 128) == 2     # QKV: 64 x 2
    assert default_splits(2048, 12288, 64, 128) == 1    # 192 blocks: already past a wave
    assert default_splits(384, 64, 64, 128) == 1        # three K steps: no even split


@pytest.mark.parametrize("width,splits,rows,padded", [(128, 4, 19, 32), (320, 2, 5, 16),
                                                      (192, 1, 48, 64)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_add_norm_matches_float64(width, splits, rows, padded, dtype):
    """Widths a power of two and not (the block is masked past them), partial sums with padded
    rows holding garbage (only the real rows are read)."""
    rng = np.random.default_rng(width + rows)
    parts = rng.normal(size=(splits, padded, width)).astype(np.float32)
    residual = jnp.asarray(rng.normal(size=(rows, width)), dtype)
    weight = jnp.asarray(1 + 0.1 * rng.normal(size=(width,)), jnp.float32)
    x, normed = add_norm_pallas(jnp.asarray(parts), residual, weight, eps=1e-6,
                                interpret=INTERPRET)
    want_x, want_normed = _numpy_add_norm(parts[:, :rows].astype(np.float64).sum(0), residual,
                                          weight, 1e-6, dtype)
    assert x.shape == normed.shape == (rows, width) and x.dtype == normed.dtype == dtype
    # The float32 sum of the partials may round one unit of the dtype's last place away from
    # the float64 sum, and the norm carries it.
    tol = 2 ** -7 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(x, np.float64), want_x, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(normed, np.float64), want_normed, rtol=tol, atol=tol)


def _linear(k, n, *, bias=False, seed=0):
    lin = Linear(k, n, use_bias=bias, rngs=nnx.Rngs(seed))
    if bias:
        lin.bias[...] = jnp.ones((n,))
    return lin


def test_project_add_norm_dispatch(monkeypatch):
    calls = []
    kernel = decode_kernels.add_norm_pallas
    monkeypatch.setattr(decode_kernels, "add_norm_pallas",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(16, 128)), jnp.float32)     # 3 real rows, 13 padding
    residual = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(64,)), jnp.float32)
    lin = _linear(128, 64)
    want = _numpy_add_norm(np.asarray(h[:3], np.float64) @ np.asarray(lin.kernel[...]),
                           residual, weight, 1e-6, jnp.float32)
    for impl, kernel_calls in [("pallas", 1), ("xla", 1)]:     # calls so far
        got = project_add_norm(lin, h, residual, weight, 1e-6, impl=impl)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-5, atol=1e-5)
        assert len(calls) == kernel_calls
    # A bias, or an adapter in use, keeps XLA's ops (and the same result as the layer's own).
    calls.clear()
    for lin, lora in [(_linear(128, 64, bias=True), False), (_lora_linear(), True)]:
        x, normed = project_add_norm(lin, h, residual, weight, 1e-6, lora=lora, impl="pallas")
        want_x = residual + lin(h, lora=lora)[:3]
        np.testing.assert_allclose(np.asarray(x), np.asarray(want_x), rtol=1e-6, atol=1e-6)
    assert not calls
    with pytest.raises(ValueError, match=r"project_add_norm\(impl='pallas'\): the weight's "
                                         r"width \(48\)"):
        project_add_norm(_linear(128, 48), h, residual[:, :48], weight[:48], 1e-6,
                         impl="pallas")
    with pytest.raises(ValueError, match="unknown impl"):
        project_add_norm(lin, h, residual, weight, 1e-6, impl="triton")


def _lora_linear():
    lin = _linear(128, 64, seed=1)
    lin.add_lora(4, 2.0, jax.random.key(0))
    lin.lora_b[...] = jax.random.normal(jax.random.key(1), lin.lora_b[...].shape)
    return lin


def _decode_attend(layer, q, k, v, state, prep):
    return causal_attend(layer, *prep(q, k), v, state)


def _counting(monkeypatch, names):
    calls = {name: 0 for name in names}
    for name in names:
        kernel = getattr(decode_kernels, name)

        def counted(*a, _kernel=kernel, _name=name, **kw):
            calls[_name] += 1
            return _kernel(*a, **kw)

        monkeypatch.setattr(decode_kernels, name, counted)
    return calls


@pytest.mark.parametrize("lora", [False, True])
def test_model_decode_form_matches_the_general_forward(monkeypatch, lora):
    """Every decode kernel in every layer (q, k and v one GEMM, the O and down projections each a
    GEMM and an add-norm, the gate-up pair one kernel); none where a LoRA sits on the
    projection."""
    calls = _counting(monkeypatch, ["gate_up_silu_pallas", "gemm_partials_pallas",
                                    "add_norm_pallas"])
    cfg = ModelConfig.preset("tiny")
    model = init_model(cfg, seed=1)
    if lora:
        attach_lora(model, LoRAConfig(rank=4), jax.random.key(2))
        for m in _adapted_linears(model):      # B starts at zero: make the adapter count
            m.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(3), m.lora_b[...].shape)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (5, 1)), jnp.int32)
    positions = jnp.asarray([[0], [3], [9], [100], [4000]], jnp.int32)
    want, _ = model.forward(tokens, positions, lora=lora)
    got, _ = model.forward(tokens, positions, attend=_decode_attend, lora=lora,
                           decode_kernels="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    layers = 0 if lora else cfg.num_hidden_layers
    assert calls == {"gate_up_silu_pallas": layers, "gemm_partials_pallas": 3 * layers,
                     "add_norm_pallas": 2 * layers}


def test_model_decode_form_in_bfloat16_is_as_close_to_float32_as_the_general_one():
    """The compute dtype the rollout uses, bf16 weights (the kernels take no cast). The kernels'
    float32 sums run in another order than XLA's, so one unit of bf16's last place differs here
    and there and spreads through the layers: both forms are held to the same float32 forward
    of the same weights instead, the decode form no further from it than the general one."""
    cfg = ModelConfig.preset("tiny")
    model = init_model(cfg, seed=1, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    exact = init_model(cfg, seed=1)
    nnx.update(exact, jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(model)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 1)), jnp.int32)
    positions = jnp.asarray([[0], [7], [300], [1], [2], [50], [9], [4000]], jnp.int32)
    ref = np.asarray(exact.forward(tokens, positions)[0], np.float64)
    general = np.asarray(model.forward(tokens, positions)[0], np.float64)
    decode = np.asarray(model.forward(tokens, positions, attend=_decode_attend,
                                      decode_kernels="pallas")[0], np.float64)
    err_general, err_decode = (np.sqrt(np.mean((x - ref) ** 2)) for x in (general, decode))
    assert 0 < err_general < 2 ** -5
    assert err_decode < 1.25 * err_general, (err_decode, err_general)


def _adapted_linears(model):
    return [m for _, m in nnx.iter_modules(model) if isinstance(m, Linear)
            and m.lora_b is not None]
