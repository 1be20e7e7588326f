"""The sparse decode step's page scoring from centroids as a CUDA C kernel (GPU only).

:func:`score_keys_cuda` takes what :func:`pallas_kernels.sparse_decode_gpu.score_keys` takes
for the centroid scorer and returns the same keys, computed by ``sparse_score_cuda.cu``
(beside this file) through an XLA FFI call: each warp streams a contiguous run of the
centroids through shared-memory stages by ``cp.async``, the table entries a ring ahead, so
that its reads stay in flight while it scores (the Pallas kernel, a chain of dependent loads a
program, reads at 63-68% of the ceiling: BENCHMARKS.md, kernel runs AK, AO and AP).
``GpuDecodeTuning(score="cuda")`` runs it in the sparse step. Quest's scoring (two summaries
a page) stays on the Pallas kernel.

Supported: bf16 queries and centroids, head_dim 128, any page size, up to 8 query heads a KV
head, an NVIDIA Hopper GPU and ``nvcc``, as for the CUDA attention
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
from pallas_kernels.paged_attend_gpu import sm_count

SOURCE = Path(__file__).with_suffix(".cu")
TARGET = "sparrow_sparse_score"
HEAD_DIM, MAX_GROUP = 128, 8
SLOTS = 16   # a stage of the kernel: slots of one (row, KV head) streamed together


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
    if q.shape[1] > MAX_GROUP * summaries[0].shape[0]:
        return (f"takes at most {MAX_GROUP} query heads a KV head, have {q.shape[1]} for "
                f"{summaries[0].shape[0]}")
    return None


def score_keys_cuda(q, centroids, table, lengths, *, page_size: int, blocks: int | None = None):
    """q ``[B, Hq, D]``, centroids ``[Hkv, N, D]``, table ``[B, M]`` int32, lengths ``[B]`` ->
    keys ``[B, Hkv, M]`` int32: slot j of row b (n = ceil(length / page_size) pages) is
    eligible when 1 <= j < n - 2, its key the order key of ``centroid . qbar`` (qbar the mean
    of the KV head's query heads; float32), INT_MIN elsewhere. Arguments it does not take
    raise one line; where it cannot run (:func:`unavailable`) the call fails when it runs.
    ``blocks``: the persistent grid, each block's warps taking one contiguous run of the
    slots each (None: one block an SM)."""
    why = unsupported_args(q, (centroids,))
    if why is not None:
        raise ValueError(f"score_keys_cuda: {why}")
    # Registers the handler on first use where the library builds; not a check, since a host
    # without the GPU may still lower this call for one.
    _registered()
    if blocks is not None and blocks < 1:
        raise ValueError(f"score_keys_cuda: blocks must be >= 1, got {blocks}")
    b, hq, _ = q.shape
    hkv = centroids.shape[0]
    if hq % hkv:
        raise ValueError(f"score_keys_cuda: {hq} query heads are not a multiple of {hkv} KV "
                         f"heads")
    width = table.shape[1]
    pad = -width % SLOTS     # the kernel's stages are 16 slots of one row
    table = jnp.pad(table.astype(jnp.int32), ((0, 0), (0, pad)))
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((b, hkv, width + pad), jnp.int32))
    keys = call(q, centroids, table, lengths.astype(jnp.int32), page_size=np.int64(page_size),
                blocks=np.int64(blocks or sm_count()))
    return keys[:, :, :width] if pad else keys
