"""Which way the decode step's ``silu(x @ gate) * (x @ up)`` runs: one Pallas kernel on a GPU
(:mod:`pallas_kernels.decode_mlp_gpu`), XLA's ops elsewhere."""

from __future__ import annotations

import jax

from pallas_kernels.decode_mlp_gpu import gate_up_silu_pallas, kernel_limits
from sparrow_jax.sharding import has_context_mesh


def gate_up_silu(x: jax.Array, gate: jax.Array, up: jax.Array, *,
                 impl: str = "auto") -> jax.Array | None:
    """x ``[M, K]``, gate and up ``[K, F]`` -> the kernel's product ``[R >= M, F]`` (rows past M
    to be dropped after the down projection), or None where XLA's ops should run instead.

    impl: "auto" takes the kernel on a GPU where it applies (weights already in x's dtype, no
    device mesh in context: a custom call would make XLA gather sharded weights; rows and dtype
    within :func:`~pallas_kernels.decode_mlp_gpu.kernel_limits`); "pallas"
    takes it wherever it applies (Pallas' interpreter off a GPU: tests) and raises where its
    shapes rule it out; "xla" never."""
    if impl not in ("auto", "xla", "pallas"):
        raise ValueError(f"gate_up_silu: unknown impl {impl!r}; expected auto, xla or pallas")
    if impl == "xla" or has_context_mesh() or not gate.dtype == up.dtype == x.dtype:
        return None
    why = kernel_limits(x.shape[0], *gate.shape, x.dtype)
    on_gpu = jax.default_backend() == "gpu"
    if impl == "pallas" and why is not None:
        raise ValueError(f"gate_up_silu(impl='pallas'): {why}")
    if why is not None or (impl == "auto" and not on_gpu):
        return None
    return gate_up_silu_pallas(x, gate, up, interpret=not on_gpu)
