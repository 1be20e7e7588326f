"""Dense causal attention for training forwards, recompute and prefill.

Implementations (``impl``), one contract:

* ``"xla"``: ``jax.nn.dot_product_attention``'s XLA path (a full ``[T, T]`` score array).
* ``"cudnn"``: cuDNN's flash attention through the same call (GPU, half precision); measured
  10x faster than XLA at 8K on the H100.
* ``"splash"``: JAX's Pallas TPU splash attention, forward and backward, wrapped in
  :mod:`pallas_kernels.causal_attention_tpu` (head_dim a multiple of 128); never holds a
  ``[T, T]`` array, so a 32K update fits. Off TPU it runs in TPU interpret mode (tests).

``"auto"``: cuDNN on GPU for half precision, splash on TPU where head_dim allows, else XLA. Off
GPU the TPU choice is made when lowering (``lax.platform_dependent``), so a step exported for
TPU from a CPU host holds splash while the same step run on CPU compiles only XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

IMPLS = ("auto", "xla", "cudnn", "splash")


def resolve_impl(impl: str, head_dim: int, dtype, platform: str | None = None) -> str:
    """The implementation ``causal_attention(impl=...)`` runs on ``platform`` (default
    ``jax.default_backend()``). A named ``"splash"`` that cannot take head_dim raises."""
    if impl not in IMPLS:
        raise ValueError(f"unknown causal attention impl {impl!r}; known: {IMPLS}")
    from pallas_kernels.causal_attention_tpu import kernel_limits

    why = kernel_limits(head_dim)
    if impl == "auto":
        platform = platform or jax.default_backend()
        if platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
            return "cudnn"
        return "splash" if platform == "tpu" and why is None else "xla"
    if impl == "splash" and why is not None:
        raise ValueError(f"causal_attention(impl='splash'): {why}; use impl='xla' (or 'auto', "
                         "which falls back to it)")
    return impl


def _xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def _splash(q, k, v, interpret=False):
    from pallas_kernels.causal_attention_tpu import causal_attention_tpu

    return causal_attention_tpu(q, k, v, interpret=interpret)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str = "auto"
                     ) -> jax.Array:
    """q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]`` (Hq a multiple of Hkv) -> ``[B, T, Hq, D]``.

    Scale ``D**-0.5``; softmax in float32. Right padding needs no mask: a causal query never sees
    the padding after it.
    """
    d, dtype = q.shape[-1], q.dtype
    chosen = resolve_impl(impl, d, dtype)
    if chosen == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if chosen == "splash":
        return _splash(q, k, v, interpret=jax.default_backend() != "tpu")
    if impl == "auto" and jax.default_backend() != "gpu" and resolve_impl(
            impl, d, dtype, platform="tpu") == "splash":
        return lax.platform_dependent(q, k, v, tpu=_splash, default=_xla)
    return _xla(q, k, v)


def causal_attend(layer: int, q, k, v, state):
    """The :data:`~sparrow_jax.models.qwen3.AttendFn` of a plain causal forward (no cache)."""
    del layer
    return causal_attention(q, k, v), state
