"""The sparse decode step's page scoring from centroids as a CUDA C kernel (GPU only).

:func:`score_keys_cuda` takes what :func:`pallas_kernels.sparse_decode_gpu.score_keys` takes
for the centroid scorer and returns the same keys, computed by ``sparse_score_cuda.cu``
(beside this file) through an XLA FFI call, with many more of the pages' scattered 256-byte
centroid reads in flight than the Pallas kernel's one tile a program (which reads at 63-68%
of the ceiling, BENCHMARKS.md, kernel runs AK and AM). ``GpuDecodeTuning(score="cuda")``
runs it in the sparse step; not yet measured on a GPU, so the default stays the Pallas
scoring. Quest's scoring (two summaries a page) stays on the Pallas kernel.

Supported: bf16 queries and centroids, head_dim 128, any page size and query heads a KV head,
an NVIDIA Hopper GPU and ``nvcc``, as for the CUDA attention
(:mod:`pallas_kernels.cuda_build`); :func:`unsupported_args` and :func:`unavailable` say why
not, in one line.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cuda_build import hopper_missing, register

SOURCE = Path(__file__).with_suffix(".cu")
TARGET = "sparrow_sparse_score"
HEAD_DIM = 128


@functools.cache
def _registered() -> str | None:
    return register(SOURCE, "SparrowSparseScore", TARGET, "the CUDA scoring")


def unavailable() -> str | None:
    """None when the CUDA scoring can run here, else why not (one line)."""
    return hopper_missing() or _registered()


def unsupported_args(q, summaries) -> str | None:
    """None when :func:`score_keys_cuda` takes these queries and page summaries (a tuple: one
    array of centroids, or Quest's two), else why not (one line)."""
    if len(summaries) != 1:
        return "scores from centroids only (Quest's two summaries take the Pallas scoring)"
    if q.dtype != jnp.bfloat16 or summaries[0].dtype != jnp.bfloat16:
        return f"needs bf16 queries and centroids, have {q.dtype} and {summaries[0].dtype}"
    if q.shape[-1] != HEAD_DIM:
        return f"needs head_dim {HEAD_DIM}, have {q.shape[-1]}"
    return None


def score_keys_cuda(q, centroids, table, lengths, *, page_size: int, rounds: int | None = None):
    """q ``[B, Hq, D]``, centroids ``[Hkv, N, D]``, table ``[B, M]`` int32, lengths ``[B]`` ->
    keys ``[B, Hkv, M]`` int32: slot j of row b (n = ceil(length / page_size) pages) is
    eligible when 1 <= j < n - 2, its key the order key of ``centroid . qbar`` (qbar the mean
    of the KV head's query heads; float32), INT_MIN elsewhere. Arguments it does not take
    raise one line; where it cannot run (:func:`unavailable`) the call fails when it runs.
    ``rounds``: slot chunks of 128 a block takes one after another, each chunk's table entries
    read while the last chunk's centroids are on their way (None: the fewest that fit every
    block in one wave on this GPU)."""
    why = unsupported_args(q, (centroids,))
    if why is not None:
        raise ValueError(f"score_keys_cuda: {why}")
    # Registers the handler on first use where the library builds; not a check, since a host
    # without the GPU may still lower this call for one.
    _registered()
    if rounds is not None and rounds < 1:
        raise ValueError(f"score_keys_cuda: rounds must be >= 1, got {rounds}")
    b, hq, _ = q.shape
    hkv = centroids.shape[0]
    if hq % hkv:
        raise ValueError(f"score_keys_cuda: {hq} query heads are not a multiple of {hkv} KV "
                         f"heads")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((b, hkv, table.shape[1]), jnp.int32))
    return call(q, centroids, table.astype(jnp.int32), lengths.astype(jnp.int32),
                page_size=np.int64(page_size), rounds=np.int64(rounds or 0))
