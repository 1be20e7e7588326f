"""The decode step's MLP input half as one Pallas GPU kernel: ``silu(x @ gate) * (x @ up)`` for
a few rows (one token per sequence), SiLU x up applied to each program's columns before they
leave it.

Why: at decode's row counts the two projections are weight reads, and XLA runs them as a
split-K GEMM whose float32 partial sums a second kernel reduces, applying SiLU x up; a program
here owns whole columns of both projections (no split of K), so the product is its epilogue
and that second launch goes (H100, Qwen3-1.7B's 2048 x 6144 pair, 48 rows: 20.5 us against
XLA's 20.4 + 3.3; BENCHMARKS.md, rollout run J). Rows are padded to ``R`` (a power of two, 16
at least: the matrix units' minimum) by masked loads, and the result keeps them: the caller
slices after the down projection, whose consumer takes the slice for free.

Roundings follow the model (``MLP`` in :mod:`sparrow_jax.models.qwen3`): each projection
rounded to x's dtype, then SiLU, rounded, then the product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.decode_gemm_gpu import (SHARED_BYTES, default_block_k, max_rows,
                                            padded_rows, pipeline_stages)

BLOCK_N = 64     # columns of each projection a program (H100 sweeps, BENCHMARKS.md run J)
STAGES = 3       # the K loop's pipeline depth where shared memory allows (ibid.)


def default_warps(rows: int) -> int:
    """4 up to 64 rows, 8 beyond (H100: 23.9 -> 23.0 us at 96 rows, 23.5 -> 22.7 at 128)."""
    return 4 if rows <= 64 else 8


def _stages(rows: int, itemsize: int, block_n: int, block_k: int) -> int:
    """:data:`STAGES` where shared memory holds that many copies of a K step's tiles (x's
    ``[R, BK]`` and both weights' ``[BK, BN]``; 256 rows of bfloat16: 2)."""
    return pipeline_stages((rows * block_k + 2 * block_k * block_n) * itemsize, STAGES)


def kernel_limits(m: int, k: int, f: int, dtype, block_n: int = BLOCK_N,
                  block_k: int | None = None) -> str | None:
    """Why the kernel cannot take ``m`` rows of ``dtype`` against a ``[K, F]`` pair (None
    when it can)."""
    itemsize = jnp.dtype(dtype).itemsize
    block_k = block_k or default_block_k(itemsize)
    if f % block_n or k % block_k:
        return (f"the projections' width ({f}) and depth ({k}) must be multiples of "
                f"{block_n} and {block_k} ({jnp.dtype(dtype).name}'s K step)")
    rows = padded_rows(m)
    if rows > max_rows(itemsize):
        return f"{m} rows of {jnp.dtype(dtype).name} is more than the kernel's {max_rows(itemsize)}"
    if not _stages(rows, itemsize, block_n, block_k):
        return (f"{rows} rows of {jnp.dtype(dtype).name} with {block_k}-deep steps overflow "
                f"the {SHARED_BYTES} bytes of shared memory")
    return None


def _gate_up_kernel(x_ref, g_ref, u_ref, o_ref, *, rows, block_n, block_k):
    """Grid (F / BN,): x ``[M, K]``, gate, up ``[K, F]`` -> this program's BN columns of
    ``[rows, F]``."""
    n = pl.program_id(0)
    m, k = x_ref.shape
    r = lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
    c = lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
    row = jnp.minimum(r, m - 1)

    def body(i, acc):
        k0 = i * block_k
        x = plgpu.load(x_ref.at[row, k0 + c], mask=r < m, other=0)
        cols = (pl.ds(k0, block_k), pl.ds(n * block_n, block_n))
        return (acc[0] + jnp.dot(x, g_ref[cols], preferred_element_type=jnp.float32),
                acc[1] + jnp.dot(x, u_ref[cols], preferred_element_type=jnp.float32))

    zero = jnp.zeros((rows, block_n), jnp.float32)
    gate, up = lax.fori_loop(0, k // block_k, body, (zero, zero))
    dt = o_ref.dtype
    rounded = lambda a: a.astype(dt).astype(jnp.float32)
    gate = rounded(gate)
    act = rounded(gate * jax.nn.sigmoid(gate))
    o_ref[:, pl.ds(n * block_n, block_n)] = (act * rounded(up)).astype(dt)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def gate_up_silu_pallas(x: jax.Array, gate: jax.Array, up: jax.Array, *,
                        block_n: int = BLOCK_N, block_k: int | None = None,
                        num_warps: int | None = None, num_stages: int | None = None,
                        interpret: bool = False) -> jax.Array:
    """x ``[M, K]``, gate and up ``[K, F]`` in x's dtype (a cast here would be a copy of the
    weights every call) -> ``silu(x @ gate) * (x @ up)`` as
    ``[padded_rows(M), F]`` in x's dtype (rows past M are the product of zero rows: zeros)."""
    m, k = x.shape
    f = gate.shape[1]
    if gate.shape != (k, f) or up.shape != (k, f) or not gate.dtype == up.dtype == x.dtype:
        raise ValueError(f"gate_up_silu_pallas: x {x.shape} {x.dtype} needs gate and up "
                         f"[{k}, F] of its dtype, got {gate.shape} {gate.dtype} and "
                         f"{up.shape} {up.dtype}")
    why = kernel_limits(m, k, f, x.dtype, block_n, block_k)
    if why is not None:
        raise ValueError(f"gate_up_silu_pallas: {why}")
    rows = padded_rows(m)
    block_k = block_k or default_block_k(x.dtype.itemsize)
    return pl.pallas_call(
        functools.partial(_gate_up_kernel, rows=rows, block_n=block_n, block_k=block_k),
        grid=(f // block_n,),
        out_shape=jax.ShapeDtypeStruct((rows, f), x.dtype),
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or default_warps(rows),
            num_stages=num_stages or _stages(rows, x.dtype.itemsize, block_n, block_k)),
        interpret=interpret, name="decode_gate_up_silu",
    )(x, gate, up)
