"""Bit-exact training on a GPU: XLA's scatter-adds in a fixed order.

The embedding's gradient is a scatter-add of the tokens' rows. On a GPU, XLA emits it with
atomic adds unless told otherwise, so rows of a repeated token sum in whatever order the threads
reach them: a rerun, or a resumed run, then differs from the first in the last bits of a few
weights (H100, float32: 26 of 3072 embedding entries, 1-2 units in the last place, and the
step's metrics after it). ``--xla_gpu_enable_scatter_determinism_expander=true`` makes XLA
rewrite such scatters into a sorted, deterministic form; with it the trainer's resume tests pass
bit for bit on the H100. XLA reads its flags once, when JAX's backend starts, so the flag must be
in ``XLA_FLAGS`` before the first device use: ``sparrow train`` puts it there; a notebook sets
the variable before its first JAX computation, and the trainer says so when it is missing.
"""

from __future__ import annotations

import os
from typing import MutableMapping

SCATTER_FLAG = "--xla_gpu_enable_scatter_determinism_expander"


def _named(flags: str) -> bool:
    return any(f == SCATTER_FLAG or f.startswith(SCATTER_FLAG + "=") for f in flags.split())


def enable_deterministic_scatter(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Adds ``SCATTER_FLAG=true`` to ``environ["XLA_FLAGS"]`` unless the flag is named there
    already (a user's own choice, either way, stands). Returns whether it added it."""
    flags = environ.get("XLA_FLAGS", "")
    if _named(flags):
        return False
    environ["XLA_FLAGS"] = f"{flags} {SCATTER_FLAG}=true".strip()
    return True


def scatter_warning(backend: str, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """The line a GPU training run prints when its scatter-adds may sum in any order (the flag
    not named in ``XLA_FLAGS``); None otherwise."""
    if backend != "gpu" or _named(environ.get("XLA_FLAGS", "")):
        return None
    return (f"note: on a GPU, XLA_FLAGS without {SCATTER_FLAG}=true leaves the embedding's "
            "gradient to atomic adds, so a resumed run matches the uninterrupted one only to the "
            "last bits (set it before JAX starts; `sparrow train` does)")


__all__ = ["SCATTER_FLAG", "enable_deterministic_scatter", "scatter_warning"]
