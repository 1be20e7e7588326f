"""The TPU chips this project targets, and lowering for one of them from a host without a TPU.

``jax.export(fn, platforms=["tpu"])`` lowers Pallas TPU kernels to Mosaic custom calls without a
TPU; kernels whose lowering asks which chip it is for (tile sizes, core count) need an abstract
TPU device in scope, which :func:`abstract_tpu` provides. Export does not run Mosaic's compiler:
some layout errors surface only on a real TPU.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """Public figures of one chip: device kind as JAX names it, TensorCores one JAX device
    drives, HBM bandwidth (bytes/s) and capacity (bytes)."""
    device_kind: str
    cores: int
    hbm_bytes_per_s: float
    hbm_bytes: int


# HBM bandwidth and size from Google Cloud's TPU pages (v5e, v5p, v6e "Trillium").
CHIPS = {
    "v5e": TpuChip("TPU v5 lite", 1, 819e9, 16 * 2 ** 30),
    "v5p": TpuChip("TPU v5", 2, 2765e9, 95 * 2 ** 30),
    "v6e": TpuChip("TPU v6 lite", 1, 1640e9, 32 * 2 ** 30),
}


def tpu_mesh(chip: str, shape: tuple[int, ...] = (1,), names: tuple[str, ...] = ("x",)
             ) -> AbstractMesh:
    """An abstract mesh of ``chip`` devices (a key of :data:`CHIPS`): lowering under it (and
    ``shard_map`` over it) targets that chip, whatever the host has."""
    if chip not in CHIPS:
        raise ValueError(f"unknown TPU chip {chip!r}; expected one of {sorted(CHIPS)}")
    c = CHIPS[chip]
    dev = AbstractDevice(device_kind=c.device_kind, num_cores=c.cores, platform="tpu")
    return AbstractMesh(shape, names, abstract_device=dev)


@contextlib.contextmanager
def abstract_tpu(chip: str):
    """Within this context, lowering targets ``chip`` (a key of :data:`CHIPS`) as one abstract
    device, whatever the host has."""
    with use_abstract_mesh(tpu_mesh(chip)):
        yield


def export_for_tpu(fn, *args, chip: str) -> jax.export.Exported:
    """``jax.export`` of ``jax.jit(fn)`` at ``args`` (arrays or ShapeDtypeStructs) for
    ``chip``."""
    with abstract_tpu(chip):
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
