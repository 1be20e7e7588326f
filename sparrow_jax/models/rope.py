"""Rotary position embedding, rotate-half form (as HF's Qwen3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[..., head_dim]`` for integer ``positions [...]``.

    Angles are formed in float32 as ``position * inv_freq`` (one rounding, as HF does): at
    positions near 32K an angle is ~3e4 rad, where float32 keeps ~2e-3 rad, so computing the
    product any other way (in bf16, or as a sum) would disagree with the reference model.
    """
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (jnp.float32(theta) ** exponents)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x ``[B, T, H, D]``, cos/sin ``[B, T, D]`` -> x rotated, in x's dtype."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
