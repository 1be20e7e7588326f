"""GRPO group advantages (docs/design.md, section 7)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

EPS = 1e-6


def group_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """rewards ``[S]`` with the ``group_size`` samples of a prompt in adjacent rows -> ``[S]``.

    ``A = (r - mean_group) / (std_group + 1e-6)``, std with ddof=1 (as verl and tunix); a group
    whose rewards are all equal gets A = 0 everywhere.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [S], got shape {rewards.shape}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (the std uses ddof=1), got {group_size}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
    g = rewards.reshape(-1, group_size)
    mean = g.mean(axis=1, keepdims=True)
    std = jnp.sqrt(jnp.sum((g - mean) ** 2, axis=1, keepdims=True) / (group_size - 1))
    return ((g - mean) / (std + EPS)).reshape(-1)
