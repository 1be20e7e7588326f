"""Which way the decode step's matmuls run: the Pallas kernels of
:mod:`pallas_kernels.decode_mlp_gpu` (``silu(x @ gate) * (x @ up)`` in one launch) and
:mod:`pallas_kernels.decode_gemm_gpu` (a projection back into the residual stream with the
residual add and the next RMSNorm in two; the q, k and v projections' partial sums, which the
cache write's kernel sums) on a GPU, XLA's ops elsewhere.

``impl``: "auto" takes the kernels on a GPU where they apply; "pallas" wherever they apply
(Pallas' interpreter off a GPU: tests) and raises where their shapes rule them out; "xla"
never. No kernel runs with a device mesh in context (a custom call would make XLA gather
sharded weights), with weights not in the compute dtype (a cast would copy them every step),
or where a projection has a bias or an active LoRA adapter.
"""

from __future__ import annotations

import jax

from pallas_kernels.decode_gemm_gpu import add_norm_pallas, gemm_limits, gemm_partials_pallas
from pallas_kernels.decode_mlp_gpu import gate_up_silu_pallas, kernel_limits
from sparrow_jax.models.lora import Linear
from sparrow_jax.models.qk_prep import rms_norm
from sparrow_jax.sharding import has_context_mesh

IMPLS = ("auto", "xla", "pallas")


def kernels_apply(impl: str) -> bool:
    """Whether ``impl`` may take the decode kernels here at all (shapes aside)."""
    if impl not in IMPLS:
        raise ValueError(f"decode kernels: unknown impl {impl!r}; expected one of {IMPLS}")
    if impl == "xla" or has_context_mesh():
        return False
    return impl == "pallas" or jax.default_backend() == "gpu"


def _shapes_allow(impl: str, name: str, why: str | None) -> bool:
    if why is not None and impl == "pallas":
        raise ValueError(f"{name}(impl='pallas'): {why}")
    return why is None


def _plain(linear: Linear, lora: bool) -> bool:
    """No bias and no active adapter: the projection is ``x @ kernel`` alone."""
    return linear.bias is None and not (lora and linear.lora_a is not None)


def gate_up_silu(x: jax.Array, gate: Linear, up: Linear, *, lora: bool = False,
                 impl: str = "auto") -> jax.Array | None:
    """x ``[M, hidden]``, the MLP's gate and up projections -> ``silu(gate(x)) * up(x)``
    ``[R >= M, F]`` from one kernel (rows past M to be dropped after the down projection), or
    None where XLA's ops should run instead."""
    wg, wu = gate.kernel[...], up.kernel[...]
    if not (kernels_apply(impl) and _plain(gate, lora) and _plain(up, lora)
            and wg.dtype == gate.dtype and wu.dtype == up.dtype == wg.dtype):
        return None
    if not _shapes_allow(impl, "gate_up_silu", kernel_limits(x.shape[0], *wg.shape, wg.dtype)):
        return None
    return gate_up_silu_pallas(x.astype(wg.dtype), wg, wu,
                               interpret=jax.default_backend() != "gpu")


def qkv_partials(x: jax.Array, linears: tuple[Linear, ...], *, lora: bool = False,
                 impl: str = "auto") -> jax.Array | None:
    """x ``[M, hidden]``, the attention's q, k and v projections -> their split-K partial sums
    ``[S, R >= M, sum N]`` float32 from one GEMM (the cache write sums them: the q/k kernel of
    :mod:`pallas_kernels.paged_append_gpu`), or None where XLA's ops should run instead."""
    ws = [lin.kernel[...] for lin in linears]
    if not (kernels_apply(impl) and all(_plain(lin, lora) for lin in linears)
            and all(w.dtype == lin.dtype for w, lin in zip(ws, linears))):
        return None
    for w in ws:
        if not _shapes_allow(impl, "qkv_partials", gemm_limits(x.shape[0], *w.shape, w.dtype)):
            return None
    return gemm_partials_pallas(x.astype(ws[0].dtype), tuple(ws),
                                interpret=jax.default_backend() != "gpu")


def project_add_norm(linear: Linear, h: jax.Array, residual: jax.Array, norm_weight: jax.Array,
                     eps: float, *, lora: bool = False, impl: str = "auto",
                     sum_over: str | None = None) -> tuple[jax.Array, jax.Array]:
    """h ``[R >= M, K]`` (rows past M ignored), residual ``[M, N]`` -> ``x = residual +
    linear(h)`` and ``rms_norm(x, norm_weight, eps)``, both ``[M, N]``: a GEMM leaving its
    split-K partial sums and one kernel summing them into both outputs where the kernels
    apply, else XLA's ops (the same roundings). ``sum_over``: as in :class:`Linear` (the
    products summed over a mesh axis before the add: XLA's ops)."""
    m = residual.shape[0]
    w = linear.kernel[...]
    if (sum_over is None and kernels_apply(impl) and _plain(linear, lora)
            and w.dtype == linear.dtype
            and _shapes_allow(impl, "project_add_norm",
                              gemm_limits(h.shape[0], *w.shape, w.dtype))):
        interpret = jax.default_backend() != "gpu"
        parts = gemm_partials_pallas(h.astype(w.dtype), w, interpret=interpret)
        return add_norm_pallas(parts, residual, norm_weight, eps=eps, interpret=interpret)
    x = residual + linear(h, lora=lora, sum_over=sum_over)[:m].astype(residual.dtype)
    return x, rms_norm(x, norm_weight, eps)
