"""Causal attention on TPU through JAX's splash attention
(``jax.experimental.pallas.ops.tpu.splash_attention``), forward and backward, behind the
contract of :func:`sparrow_jax.attention.dense.causal_attention`.

Splash is block-sparse flash attention: the causal mask is cut into ``block x block`` tiles
once, at trace time, and tiles above the diagonal are never visited, so neither pass holds a
``[T, T]`` array. Its backward (a custom VJP: one dq kernel, one dk/dv kernel) recomputes the
softmax from saved log-sum-exps. What this wrapper adds:

* the batch folded into the head axis (``[B*Hq, T, D]`` queries, ``[B*Hkv, T, D]`` keys):
  query head ``b*Hq + h*r + i`` reads KV head ``b*Hkv + h``, which is splash's own GQA rule,
  so one kernel call covers the batch (``vmap`` of the kernel does not run in TPU interpret
  mode);
* T right-padded with zeros to a multiple of the block: a causal query never sees the padding
  after it, and the padded queries' rows are cut off (their gradients are zero);
* the scale ``D**-0.5`` folded into q (splash applies none), in q's dtype.

Tiles are ``block_for(T)`` tokens (512 where T allows: fewer, larger DMAs) for the forward and
both backward kernels. Cutting the mask into tiles costs seconds at 32K (NumPy); splash caches
the result per mask and block shape (its ``_process_mask``), so it is paid once per shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

LANES = 128
BLOCKS = (512, 256, 128)


def kernel_limits(head_dim: int) -> str | None:
    """Why splash cannot take this head_dim, or None if it can (one head fills whole
    128-lane rows)."""
    if head_dim % LANES:
        return f"head_dim {head_dim} is not a multiple of {LANES}"
    return None


def padded_length(t: int) -> int:
    """T rounded up to whole 128-token tiles."""
    return -(-t // LANES) * LANES


def block_for(t_padded: int) -> int:
    """The largest of :data:`BLOCKS` dividing the padded length."""
    return next(b for b in BLOCKS if t_padded % b == 0)


def _kernel(heads: int, t: int, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
        splash_attention_mask as sm,
    )

    mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(heads)])
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    # Made in every trace, never cached here: device arrays made in one trace and closed over in
    # a later one break jax.export (its input tree miscounts them).
    return sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=pltpu.InterpretParams() if interpret else False)


def causal_attention_tpu(q: jax.Array, k: jax.Array, v: jax.Array, *,
                         interpret: bool = False) -> jax.Array:
    """q ``[B, T, Hq, D]``, k/v ``[B, T, Hkv, D]`` -> ``[B, T, Hq, D]`` in q's dtype;
    differentiable. ``interpret``: TPU interpret mode (CPU tests)."""
    b, t, hq, d = q.shape
    tp = padded_length(t)

    def heads_first(x):   # [B, T, H, D] -> [B*H, Tp, D]
        x = jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
        return jnp.swapaxes(x, 1, 2).reshape(-1, tp, d)

    kernel = _kernel(b * hq, tp, block_for(tp), interpret)
    out = kernel(heads_first(q * jnp.asarray(d ** -0.5, q.dtype)), heads_first(k),
                 heads_first(v))
    return jnp.swapaxes(out.reshape(b, hq, tp, d), 1, 2)[:, :t].astype(q.dtype)
