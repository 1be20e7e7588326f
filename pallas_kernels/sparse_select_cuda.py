"""The sparse decode step's page selection as a CUDA C kernel (GPU only).

:func:`select_from_keys_cuda` takes what
:func:`pallas_kernels.sparse_decode_gpu.select_from_keys` takes and returns the same page
lists, computed by ``sparse_select_cuda.cu`` (beside this file) through an XLA FFI call: the
k-th largest key found a byte at a time (four rounds of a shared-memory histogram) where the
Pallas kernel takes a block-wide count for each of ~16 bits, and the ties at the threshold and
the compaction in one block-wide scan. The selection is latency, not bytes: 9-13 us a step on
an H200 (BENCHMARKS.md, kernel run AO). ``GpuDecodeTuning(select="cuda")`` runs it in the
sparse step; not yet measured on a GPU, so the default stays the Pallas selection.

Supported: tables up to 16384 pages wide (256K tokens at page 16), an NVIDIA Hopper GPU and
``nvcc``, as for the CUDA attention (:mod:`pallas_kernels.cuda_build`); :func:`unavailable` and
:func:`unsupported_args` say why not, in one line.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cuda_build import hopper_missing, register

SOURCE = Path(__file__).with_suffix(".cu")
TARGET = "sparrow_sparse_select"
MAX_WIDTH = 64 * 256     # slots a thread holds at most, times the block's threads


@functools.cache
def _registered() -> str | None:
    return register(SOURCE, "SparrowSparseSelect", TARGET, "the CUDA selection")


def unavailable() -> str | None:
    """None when the CUDA selection can run here, else why not (one line)."""
    return hopper_missing() or _registered()


def unsupported_args(keys) -> str | None:
    """None when :func:`select_from_keys_cuda` takes keys of this shape, else why not."""
    if keys.shape[-1] > MAX_WIDTH:
        return f"takes tables up to {MAX_WIDTH} pages wide, have {keys.shape[-1]}"
    return None


def select_from_keys_cuda(keys, table, lengths, budget_pages, *, page_size: int,
                          max_pages: int, kpad: int):
    """keys ``[B, Hkv, M]`` int32 (the scoring's), table ``[B, M]``, lengths ``[B]``,
    budget_pages ``[B]`` -> (phys, slots ``[B, Hkv, 2 * kpad]``, count ``[B, Hkv, 1]``,
    arrivals ``[B, Hkv, 1]`` zeros), as the Pallas selection's: a row of n pages with budget
    K (clipped to [3, max_pages]) takes every page when n <= K, else page 0, its last two and
    the K - 3 eligible slots of largest key (ties from the lowest slot), in page order;
    entries from count to kpad - 1 repeat the row's last page, those from kpad on are not
    written. Arguments it does not take raise one line; where it cannot run
    (:func:`unavailable`) the call fails when it runs."""
    why = unsupported_args(keys)
    if why is not None:
        raise ValueError(f"select_from_keys_cuda: {why}")
    if not 3 <= max_pages <= kpad:
        raise ValueError(f"select_from_keys_cuda: max_pages must be in [3, kpad={kpad}], got "
                         f"{max_pages}")
    # Registers the handler on first use where the library builds; not a check, since a host
    # without the GPU may still lower this call for one.
    _registered()
    b, hkv, _ = keys.shape
    lists = jax.ShapeDtypeStruct((b, hkv, 2 * kpad), jnp.int32)
    one = jax.ShapeDtypeStruct((b, hkv, 1), jnp.int32)
    call = jax.ffi.ffi_call(TARGET, (lists, lists, one, one))
    return call(keys.astype(jnp.int32), table.astype(jnp.int32), lengths.astype(jnp.int32),
                budget_pages.astype(jnp.int32), page_size=np.int64(page_size),
                max_pages=np.int64(max_pages))
