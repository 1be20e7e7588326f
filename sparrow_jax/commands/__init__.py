"""Implementations of the ``sparrow`` subcommands, one module each (see sparrow_jax.cli)."""

from __future__ import annotations

import os


def give_jax_the_device_memory() -> None:
    """Let JAX's GPU allocator take 95% of each GPU unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says.

    A command has the devices to itself, and JAX's default of 75% is short of what the presets are
    sized for (the chip less the dry run's 10% margin) and of a long rollout (16 rows at 32K of
    Qwen3-1.7B are about 65 GiB on an 80 GB card). Too late where this process has already
    started a backend; the memory checks read the allocator's actual limit either way.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
