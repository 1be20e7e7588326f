"""What Qwen3's attention does to the projected queries and keys before attending: RMSNorm over
``head_dim`` (q and k each with their own weight), then RoPE.

:class:`QKPrep` carries it as data so that an attention function can apply it itself: the decode
step's GPU cache write fuses it into one kernel with the token's K/V write
(:mod:`pallas_kernels.paged_append_gpu`), where XLA spent five small kernels a layer on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from sparrow_jax.models.rope import apply_rope


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """As HF: normalise ``x [..., D]`` in float32, cast back to ``x``'s dtype, then scale by
    ``weight [D]`` cast to that dtype."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * x32.astype(dtype)


@struct.dataclass
class QKPrep:
    """q/k-norm weights ``[D]`` and RoPE's cos/sin ``[B, T, D]`` (float32) of one layer.

    ``partials``: in the decode form on a GPU, the q, k and v projections' split-K partial
    sums ``[S, R >= B, (Hq + 2 Hkv) * D]`` float32, whose sum (rounded to the compute dtype) is
    the q, k, v handed beside this: a cache write that takes them
    (:func:`sparrow_jax.attention.paged_cache.prep_and_append_token`) spares the launch that
    sums them, and XLA drops q, k, v when nothing else reads them. None elsewhere."""

    q_weight: jax.Array
    k_weight: jax.Array
    cos: jax.Array
    sin: jax.Array
    eps: float = struct.field(pytree_node=False)
    partials: jax.Array | None = None

    def __call__(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q ``[B, T, Hq, D]``, k ``[B, T, Hkv, D]`` as projected -> both normed and rotated."""
        return (apply_rope(rms_norm(q, self.q_weight, self.eps), self.cos, self.sin),
                apply_rope(rms_norm(k, self.k_weight, self.eps), self.cos, self.sin))
