"""Response lengths for benchmarks: how long each row of a batch is allowed to run (its per-prompt
``max_new_tokens``), drawn to look like RL rollouts rather than every row running to the cap.

- ``"lognormal"``: log-normal with median ``cap / 5`` and sigma 1, truncated (clipped) at the cap,
  then 10% of the rows forced to the cap (the long tail that keeps a static batch running).
- ``"uniform"``: uniform over ``1 .. cap``.

Seeded: the same (kind, rows, cap, seed) always gives the same lengths.
"""

from __future__ import annotations

import numpy as np

KINDS = ("lognormal", "uniform")
MEDIAN_FRACTION = 0.2   # the log-normal's median, as a fraction of the cap
SIGMA = 1.0
AT_CAP = 0.1            # fraction of rows forced to the cap


def length_mix(kind: str, rows: int, cap: int, seed: int = 0) -> np.ndarray:
    """``rows`` lengths in ``[1, cap]`` -> ``[rows]`` int32 (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"length mix kind={kind!r}; known: {KINDS}")
    if rows < 1 or cap < 1:
        raise ValueError(f"length mix needs rows >= 1 and cap >= 1, got rows={rows}, cap={cap}")
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.integers(1, cap + 1, rows).astype(np.int32)
    x = np.exp(rng.normal(np.log(MEDIAN_FRACTION * cap), SIGMA, rows))
    lengths = np.clip(np.ceil(x), 1, cap).astype(np.int32)
    lengths[rng.permutation(rows)[:round(AT_CAP * rows)]] = cap
    return lengths


__all__ = ["KINDS", "length_mix"]
