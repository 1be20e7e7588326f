"""The decode step's projections back into the residual stream (attention's O, the MLP's down) as
Pallas GPU kernels: a GEMM for a few rows that leaves its split-K partial sums in float32, and
one kernel that sums them, adds the residual and applies the next RMSNorm, writing both.

Why: at decode's row counts a projection is a read of its weights, split over K so that one
wave of programs covers the GPU, and the partial sums need a second pass. XLA fuses that pass
into every consumer, so the residual add and the norm that follows were three small launches a
layer (the O sum with the residual and the post-attention norm; the residual add, which
recomputes the O sum beside the down sum; the next layer's input norm: 4.1 + 3.6 + 1.6 us a
layer at 48 rows on an H100, BENCHMARKS.md rollout run I). Here they are two, each writing the
residual and the normed input of the next matmul. The GEMM reads the weights as fast as XLA's
autotuned one (run I: within ~5% at 19 and 48 rows on Qwen3-1.7B's shapes). The same GEMM
takes the attention's q, k and v weights at once, its partial sums summed by the cache write's
fused q/k kernel (:mod:`pallas_kernels.paged_append_gpu`) instead of a launch of their own.

Rows are padded to ``R`` (a power of two, 16 at least: the matrix units' minimum) by masked
loads; the partial sums keep them, and the add-norm kernel reads only the real rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_N = 64              # H100 sweeps, BENCHMARKS.md rollout run I
STAGES = 4                # ibid.; fewer where shared memory is short
WAVE = 132                # an H100's SMs: the splits fill at most one wave of programs
SHARED_BYTES = 232448     # an H100 program's shared memory (227 KiB)
# A row's program: 2.14 us at 19 rows, 2.18 at 48 on the H100, against 2.3-2.7 with 1-4 warps
# (scripts/bench_decode_gemm.py --shapes add_norm; BENCHMARKS.md rollout run K).
ADD_NORM_WARPS = 8


def padded_rows(m: int) -> int:
    """The rows a kernel computes for ``m`` rows: a power of two, 16 at least."""
    return max(16, 1 << (m - 1).bit_length())


def default_block_k(itemsize: int) -> int:
    """A K step of 256 bytes a row: 128 for 16-bit inputs (run I), 64 for float32, whose tiles
    at 128 spill from 64 rows (ptxas for sm_90)."""
    return 256 // itemsize


def max_rows(itemsize: int) -> int:
    """The most rows the default blocks take without spilling: 256 16-bit, 128 float32."""
    return 512 // itemsize


def pipeline_stages(tile_bytes: int, stages: int = STAGES) -> int:
    """``stages``, fewer where that many copies of a K step's tiles (``tile_bytes`` in all)
    overflow shared memory, 0 where not even one fits."""
    return min(stages, SHARED_BYTES // tile_bytes)


def default_splits(k: int, n: int, block_n: int, block_k: int) -> int:
    """The most splits of K (a power of two, each a whole number of K steps) that keep the
    programs, ``N / BN`` a split, within one wave (run I's best: 2 for 2048 x 4096, 4 for
    2048 x 2048 and 6144 x 2048)."""
    splits = 1
    while (n // block_n) * splits * 2 <= WAVE and k % (splits * 2 * block_k) == 0:
        splits *= 2
    return splits


def gemm_limits(m: int, k: int, n: int, dtype, block_n: int = BLOCK_N) -> str | None:
    """Why :func:`gemm_partials_pallas` cannot take ``[m, k] x [k, n]`` in ``dtype`` (None when
    it can)."""
    itemsize = jnp.dtype(dtype).itemsize
    block_k = default_block_k(itemsize)
    if n % block_n or k % block_k:
        return (f"the weight's width ({n}) and depth ({k}) must be multiples of {block_n} and "
                f"{block_k} ({jnp.dtype(dtype).name}'s K step)")
    rows = padded_rows(m)
    if rows > max_rows(itemsize):
        return (f"{m} rows of {jnp.dtype(dtype).name} is more than the kernel's "
                f"{max_rows(itemsize)}")
    return None


def _gemm_kernel(x_ref, *refs, rows, block_n, block_k, span, starts):
    """Grid (N / BN, S): x ``[M, K]`` (read as ``rows`` rows, zeros past M), weights ``[K, N_j]``
    side by side (weight j's column blocks start at block ``starts[j]``) -> this program's
    partial sum over its K span into ``[S, rows, sum N_j]``."""
    *w_refs, o_ref = refs
    n, s = pl.program_id(0), pl.program_id(1)
    m = x_ref.shape[0]
    r = lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
    c = lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
    row = jnp.minimum(r, m - 1)

    def product(w_ref, col):
        def body(i, acc):
            k0 = s * span + i * block_k
            x = plgpu.load(x_ref.at[row, k0 + c], mask=r < m, other=0)
            w = w_ref[pl.ds(k0, block_k), pl.ds(col, block_n)]
            return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, span // block_k, body, jnp.zeros((rows, block_n), jnp.float32))
        o_ref[s, :, pl.ds(n * block_n, block_n)] = acc

    if len(w_refs) == 1:
        product(w_refs[0], n * block_n)
        return
    ends = (*starts[1:], None)
    for w_ref, start, end in zip(w_refs, starts, ends):
        inside = n >= start if end is None else (n >= start) & (n < end)
        pl.when(inside)(lambda w_ref=w_ref, start=start: product(w_ref, (n - start) * block_n))


@functools.partial(jax.jit, static_argnames=("splits", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def gemm_partials_pallas(x: jax.Array, w: jax.Array | tuple[jax.Array, ...], *,
                         splits: int | None = None, block_n: int = BLOCK_N,
                         block_k: int | None = None, num_warps: int = 4,
                         num_stages: int | None = None, interpret: bool = False) -> jax.Array:
    """x ``[M, K]``, w ``[K, N]`` in x's dtype (a cast here would copy the weights every call),
    or a tuple of such weights (the attention's q, k and v projections) read as their
    concatenation ``[K, sum N_j]`` without building it -> partial sums ``[S, padded_rows(M),
    N]`` float32 whose sum over S is ``x @ w`` (rows past M zero). ``splits``: S (default
    :func:`default_splits`); the block sizes, warps and stages are what
    scripts/bench_decode_gemm.py sweeps."""
    ws = tuple(w) if isinstance(w, (tuple, list)) else (w,)
    m, k = x.shape
    widths = [a.shape[1] for a in ws]
    n = sum(widths)
    if any(a.shape[0] != k or a.dtype != x.dtype for a in ws):
        raise ValueError(f"gemm_partials_pallas: x {x.shape} {x.dtype} needs weights [{k}, N] "
                         f"of its dtype, got {[(a.shape, str(a.dtype)) for a in ws]}")
    for width in widths:
        why = gemm_limits(m, k, width, x.dtype, block_n)
        if why is not None:
            raise ValueError(f"gemm_partials_pallas: {why}")
    rows = padded_rows(m)
    block_k = block_k or default_block_k(x.dtype.itemsize)
    splits = splits or default_splits(k, n, block_n, block_k)
    if k % (splits * block_k):
        raise ValueError(f"gemm_partials_pallas: {splits} splits of K={k} are not whole "
                         f"{block_k}-deep steps")
    starts = tuple(sum(widths[:j]) // block_n for j in range(len(ws)))
    tile_bytes = (rows * block_k + block_k * block_n) * x.dtype.itemsize
    return pl.pallas_call(
        functools.partial(_gemm_kernel, rows=rows, block_n=block_n, block_k=block_k,
                          span=k // splits, starts=starts),
        grid=(n // block_n, splits),
        out_shape=jax.ShapeDtypeStruct((splits, rows, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps, num_stages=num_stages or pipeline_stages(tile_bytes)),
        interpret=interpret, name="decode_gemm",
    )(x, *ws)


def _add_norm_kernel(p_ref, res_ref, w_ref, x_ref, normed_ref, *, eps, width):
    """Grid (M,): row i of partial sums ``[S, R, N]``, residual ``[M, N]`` and the norm's
    weight ``[N]`` -> row i of the new residual and of its RMSNorm, in the model's roundings:
    the projection's sum rounded to the residual's dtype, the add rounded, the norm in float32
    rounded, then the weight (cast to that dtype) times it. Columns are a power-of-two block
    ``width >= N``, masked past N (zeros there add nothing to the sum of squares)."""
    i = pl.program_id(0)
    s, _, n = p_ref.shape
    dt = x_ref.dtype
    # Plain iotas, never clamped: Triton then sees contiguous columns and loads them as vectors
    # (an index through jnp.minimum loads element by element); masked lanes touch no memory.
    col = lax.broadcasted_iota(jnp.int32, (width,), 0)
    inside = (col < n) if width != n else None
    split = lax.broadcasted_iota(jnp.int32, (s, width), 0)

    def load(at, mask):
        return plgpu.load(at) if mask is None else plgpu.load(at, mask=mask, other=0)

    parts = load(p_ref.at[split, i, col[None]], None if inside is None else inside[None])
    proj = jnp.sum(parts, axis=0).astype(dt).astype(jnp.float32)
    res = load(res_ref.at[i, col], inside)
    x = (res.astype(jnp.float32) + proj).astype(dt)
    x32 = x.astype(jnp.float32)
    scale = lax.rsqrt(jnp.sum(x32 * x32) / n + eps)
    w = load(w_ref.at[col], inside)
    plgpu.store(x_ref.at[i, col], x, mask=inside)
    plgpu.store(normed_ref.at[i, col], w.astype(dt) * (x32 * scale).astype(dt), mask=inside)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def add_norm_pallas(partials: jax.Array, residual: jax.Array, weight: jax.Array, *,
                    eps: float, num_warps: int = ADD_NORM_WARPS,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """partials ``[S, R >= M, N]`` float32 (a projection's split-K sums, as
    :func:`gemm_partials_pallas` leaves them; S a power of two), residual ``[M, N]``, RMSNorm
    weight ``[N]`` -> ``x = residual + sum(partials)`` and ``rms_norm(x, weight)``, both
    ``[M, N]`` in the residual's dtype (roundings as the model's ``x + proj(h)`` then
    ``RMSNorm``)."""
    s, r, n = partials.shape
    m = residual.shape[0]
    if residual.shape != (m, n) or r < m or weight.shape != (n,) or s & (s - 1):
        raise ValueError(f"add_norm_pallas: partials {partials.shape} (splits a power of two) "
                         f"need residual [M <= {r}, {n}] and weight [{n}], got "
                         f"{residual.shape} and {weight.shape}")
    out = jax.ShapeDtypeStruct((m, n), residual.dtype)
    return pl.pallas_call(
        functools.partial(_add_norm_kernel, eps=eps, width=1 << (n - 1).bit_length()),
        grid=(m,),
        out_shape=[out, out],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="decode_add_norm",
    )(partials, residual, weight)
