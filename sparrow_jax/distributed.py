"""Several processes, one run: ``jax.distributed`` set up from the environment, and the few
host-side collectives the trainer needs (docs/design.md, section 10).

Every process runs the same program (multi-controller JAX). :func:`initialize` connects them
before any device is touched:

- TPU pods, SLURM and the other clusters JAX detects fill in the coordinator, the process count
  and each process's id themselves;
- elsewhere (several processes on one host, a hand-launched GPU cluster) the environment
  variables ``SPARROW_COORDINATOR`` (``host:port`` of process 0), ``SPARROW_NUM_PROCESSES`` and
  ``SPARROW_PROCESS_ID`` give them, or the arguments of :func:`initialize`;
- with none of these there is one process and nothing happens.

On CPU the processes' collectives go through gloo (JAX has none by default).

The helpers below are collectives too: every process must call them, in the same order.
"""

from __future__ import annotations

import os

import jax
import numpy as np

ENV_COORDINATOR = "SPARROW_COORDINATOR"
ENV_NUM_PROCESSES = "SPARROW_NUM_PROCESSES"
ENV_PROCESS_ID = "SPARROW_PROCESS_ID"

_initialized = False


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def _cluster_detected() -> bool:
    """Whether JAX's own cluster detection (SLURM, TPU pods, MPI, ...) applies here."""
    from jax._src import clusters

    try:
        return any(c.is_env_present() for c in clusters.ClusterEnv._cluster_types
                   if not c.opt_in_only_method)
    except Exception:  # noqa: BLE001 - a private API: detection is best effort
        return False


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Connects this process to the others of its run; returns whether several processes run.

    Arguments override the ``SPARROW_*`` environment variables; with neither, JAX's cluster
    detection decides, and without a cluster this is a no-op (one process). Idempotent. Must
    run before the first device use (XLA fixes its backends then)."""
    global _initialized
    if _initialized:
        return jax.process_count() > 1
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    given = {"coordinator": coordinator, "num_processes": num_processes,
             "process_id": process_id}
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"{ENV_NUM_PROCESSES} must be >= 1, got {num_processes}")
    if num_processes == 1:
        _initialized = True
        return False
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(f"several processes need a coordinator, a process count and a "
                             f"process id; missing {missing} (set {ENV_COORDINATOR}, "
                             f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"{ENV_PROCESS_ID} must be in [0, {num_processes}), got "
                             f"{process_id}")
    elif not _cluster_detected():
        _initialized = True
        return False
    # Only the CPU backend reads this; without it CPU devices of different processes cannot
    # run a collective.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
    _initialized = True
    return jax.process_count() > 1


def is_primary() -> bool:
    """Process 0: the one that writes logs, metrics, plots and the run's config."""
    return jax.process_index() == 0


def allgather_rows(x: np.ndarray) -> np.ndarray:
    """Concatenates every process's ``x`` (``[N, ...]``, same shape and dtype on each) along
    axis 0, in process order -> ``[processes * N, ...]``; ``x`` itself with one process. 64-bit
    values travel as pairs of 32-bit words, so they arrive bit for bit whatever
    ``jax_enable_x64`` says."""
    x = np.ascontiguousarray(x)
    if x.ndim == 0:
        raise ValueError("allgather_rows needs an array with a row axis")
    if jax.process_count() == 1:
        return x
    from jax.experimental import multihost_utils

    if x.dtype.itemsize == 8:
        words = x.reshape(x.shape[0], -1).view(np.uint32)
        out = np.asarray(multihost_utils.process_allgather(words, tiled=True))
        return np.ascontiguousarray(out).view(x.dtype).reshape((-1,) + x.shape[1:])
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is set on any process (the same answer on all)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(allgather_rows(np.asarray([int(flag)], np.int32)).max())


def max_over_processes(value: int) -> int:
    """The largest ``value`` over the processes (the same answer on all)."""
    if jax.process_count() == 1:
        return int(value)
    return int(allgather_rows(np.asarray([value], np.int64)).max())


def barrier(name: str) -> None:
    """Waits until every process has reached the barrier called ``name``."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
