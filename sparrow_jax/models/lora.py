"""Linear layers with an optional LoRA adapter, switched on or off per call.

The adapter belongs to the sparse actor only (docs/design.md, section 8): every dense pass calls
with ``lora=False`` and so never depends on it. Adapter weights are :class:`LoRAParam`, a
subclass of ``nnx.Param``, so optimizers and checkpoints can select them
(``nnx.state(model, LoRAParam)``) apart from the dense weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAParam(nnx.Param):
    """A LoRA adapter weight (trained apart from the dense policy)."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int = 16
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        if self.rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {self.rank}")
        bad = sorted(set(self.targets) - set(LORA_TARGETS))
        if bad:
            raise ValueError(f"unknown LoRA targets {bad}; the linear layers are {LORA_TARGETS}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class Linear(nnx.Module):
    """``y = x @ kernel (+ bias) [+ scale * (x @ lora_a) @ lora_b]``; kernel is ``[in, out]``.

    Parameters are stored in ``param_dtype`` (float32 masters for training) and cast to the
    compute ``dtype`` at use.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(stddev=in_features ** -0.5)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None
        # nnx.data: an attribute first set to None is otherwise static, and add_lora could not
        # put a parameter there later.
        self.lora_a: LoRAParam | None = nnx.data(None)
        self.lora_b: LoRAParam | None = nnx.data(None)
        self.lora_scale = 0.0
        self.dtype = dtype

    def add_lora(self, rank: int, scale: float, key: jax.Array, param_dtype=jnp.float32):
        """Attaches a LoRA adapter; B starts at zero, so the adapted layer starts equal to the
        base."""
        in_features, out_features = self.kernel[...].shape
        self.lora_a = LoRAParam(
            jax.random.normal(key, (in_features, rank), param_dtype) * in_features ** -0.5)
        self.lora_b = LoRAParam(jnp.zeros((rank, out_features), param_dtype))
        self.lora_scale = scale

    def __call__(self, x: jax.Array, *, lora: bool = False,
                 sum_over: str | None = None) -> jax.Array:
        """``sum_over``: inside ``shard_map``, the mesh axis this layer's input features are
        split over (x, the kernel's rows and LoRA's A hold this shard's part: a row-parallel
        layer). Each shard's product, adapter included, is summed over the axis in float32,
        then the bias added once."""
        x = x.astype(self.dtype)
        if sum_over is not None:
            return self._summed(x, lora, sum_over)
        y = x @ self.kernel[...].astype(self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if lora and self.lora_a is not None:
            y = y + self._adapter(x).astype(y.dtype)
        return y

    def _adapter(self, x: jax.Array) -> jax.Array:
        down = x @ self.lora_a[...].astype(self.dtype)
        return self.lora_scale * (down @ self.lora_b[...].astype(self.dtype))

    def _summed(self, x: jax.Array, lora: bool, axis: str) -> jax.Array:
        y = jnp.matmul(x, self.kernel[...].astype(self.dtype), preferred_element_type=jnp.float32)
        if lora and self.lora_a is not None:
            y = y + self._adapter(x).astype(jnp.float32)
        y = jax.lax.psum(y, axis).astype(self.dtype)
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)


def attach_lora(model: nnx.Module, config: LoRAConfig, key: jax.Array) -> nnx.Module:
    """Adds adapters to every targeted :class:`Linear` of ``model`` in place and returns it."""
    targets = [(path, m) for path, m in nnx.iter_modules(model)
               if isinstance(m, Linear) and path and path[-1] in config.targets]
    if not targets:
        raise ValueError(f"no linear layer of the model matches LoRA targets {config.targets}")
    for (path, layer), k in zip(targets, jax.random.split(key, len(targets))):
        layer.add_lora(config.rank, config.scale, k, layer.kernel[...].dtype)
    return model
