"""Memory per device of training on a mesh, computed from the config and the partition rules
(no weights, no compilation): the dry run's figure and the presets' sanity check.

Exact for the arrays whose size the layout fixes (weights, gradients, optimizer state, KV
pages: each parameter's slice as :data:`sparrow_jax.sharding.PARAM_RULES` cut it on the mesh);
a model for activations, which depend on what the compiler keeps alive.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
from flax import nnx

from sparrow_jax import sharding
from sparrow_jax.config import ModelConfig

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device."""

    weights: int       # trainable float32 masters, as laid out
    grads: int         # one gradient copy in the weights' layout
    optimizer: int     # AdamW's two moments in the weights' layout
    activations: int   # one micro-batch's forward and backward
    kv_pages: int      # the rollout's page pool (keys and values)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.kv_pages

    def as_gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in (*dataclasses.asdict(self).items(), ("total", self.total))}


def param_bytes_per_device(config: ModelConfig, axis_sizes: dict[str, int],
                           bytes_per_element: int = 4) -> int:
    """Bytes of one device's slices of every parameter (the model's shapes, the rules' layout)."""
    total = 0
    for path, shape in _param_shapes(config):
        spec = sharding.resolve(sharding.param_logical(path), shape, axis_sizes)
        split = 1
        for entry in spec:
            for axis in () if entry is None else (entry,) if isinstance(entry, str) else entry:
                split *= axis_sizes[axis]
        total += math.prod(shape) // split
    return total * bytes_per_element


@functools.lru_cache(maxsize=16)
def _param_shapes(config: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(path, shape) of every parameter; cached: tracing a 40-layer model takes seconds."""
    from sparrow_jax.models.qwen3 import Qwen3

    abstract = nnx.state(nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0))), nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(abstract)
    return tuple((sharding.path_name(p), tuple(x.shape)) for p, x in leaves)


def _split(n: int, parts: int) -> int:
    """Per-device share of a dimension of size n split over ``parts`` devices when that divides
    (as :func:`sparrow_jax.sharding.resolve`), else whole."""
    return n // parts if n % parts == 0 else n


def activation_bytes(config: ModelConfig, axis_sizes: dict[str, int], *, micro_batch_size: int,
                     seq_len: int, response_len: int, compute_bytes: int = 2,
                     chunk_size: int = 1024, remat: bool = True,
                     flash_attention: bool = False, attention_copies: int = 4) -> int:
    """One micro-batch of ``micro_batch_size`` rows of ``seq_len`` tokens (``response_len``
    scored by the LM head) through the update's forward and backward, per device.

    With ``remat`` each layer keeps only its input (``[b, T, d]``) for the backward and one layer
    at a time holds its internals; without, every layer holds them. A layer's internals: normed
    input, q/k/v, attention output, MLP gate, up, activation and product, once (their gradients
    take their place as the backward walks back), and the attention matrix ``[b, H, T, T]``
    ``attention_copies`` times in float32 (XLA's attention; a flash kernel keeps none, so with
    ``flash_attention``, cuDNN's path on GPU, only its float32 softmax statistics ``[b, H, T]``
    count).

    How many attention-sized arrays are live at the backward's peak is XLA's scheduling choice:
    the probabilities and both gradients (3) always, the scores or a transposed copy of one of
    them sometimes (4). On the same model and micro-batch XLA:CPU kept 4 on 1 and 8 devices and
    3 on every 2-device mesh, and an H200 ~3.4 at tensor=2 (tests/test_sharding.py): the
    default 4 is the upper end, what a fit check needs; 3 gives the lower end of the range.

    The LM head holds the response hidden states and a ``[chunk, V]`` float32 block of logits,
    log-probs and probabilities at a time. ``b`` is the micro-batch's rows on one device (split
    over data x fsdp when that divides). With the rows split, each device runs the head over its
    own rows with the whole head weight (its ``tensor`` shard) gathered in the compute dtype,
    and sums its gradient there in float32 before the one reduction over devices.
    """
    batch_split = axis_sizes.get("data", 1) * axis_sizes.get("fsdp", 1)
    b = _split(micro_batch_size, batch_split)
    t = axis_sizes.get("tensor", 1)
    c, d, T = compute_bytes, config.hidden_size, seq_len
    heads = _split(config.num_attention_heads, t)
    q_width = _split(config.num_attention_heads * config.head_dim, t)
    kv_width = _split(config.num_key_value_heads * config.head_dim, t)
    ffn = _split(config.intermediate_size, t)
    attention = (b * heads * T * 4 if flash_attention
                 else attention_copies * b * heads * T * T * 4)
    layer = b * T * (d + 2 * q_width + 2 * kv_width + 4 * ffn) * c + attention
    kept = b * T * d * c
    layers = config.num_hidden_layers * kept + layer if remat else (
        config.num_hidden_layers * (kept + layer))
    chunk = min(chunk_size, b * response_len)
    vocab = _split(config.vocab_size, t)
    head = b * response_len * d * c + 3 * chunk * vocab * 4
    if b < micro_batch_size:
        head += vocab * d * (c + 4)
    return layers + head


def memory_per_device(config: ModelConfig, axis_sizes: dict[str, int] | tuple[int, int, int], *,
                      micro_batch_size: int, seq_len: int, response_len: int,
                      kv_pages: int = 0, page_size: int = 16, kv_bytes: int = 2,
                      compute_bytes: int = 2, chunk_size: int = 1024,
                      remat: bool = True, flash_attention: bool = False,
                      attention_copies: int = 4) -> MemoryEstimate:
    """Memory per device of a GRPO step on a ``(data, fsdp, tensor)`` mesh.

    ``kv_pages``: pages in the pool of one rollout shard (each data x fsdp shard has its own;
    its KV heads are split over ``tensor`` as far as they divide), ``page_size`` tokens each.
    Weights, gradients and AdamW moments are float32 in the parameters' layout.
    ``attention_copies``: see :func:`activation_bytes` (4: the upper end).
    """
    if not isinstance(axis_sizes, dict):
        axis_sizes = dict(zip(sharding.AXES, axis_sizes))
    for name, value in axis_sizes.items():
        if name not in sharding.AXES or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"axis_sizes: {name}={value!r} is not a mesh axis of positive size")
    weights = param_bytes_per_device(config, axis_sizes)
    kv_heads = _split(config.num_key_value_heads, axis_sizes.get("tensor", 1))
    kv = kv_pages * page_size * 2 * config.num_hidden_layers * kv_heads * config.head_dim * kv_bytes
    return MemoryEstimate(
        weights=weights, grads=weights, optimizer=2 * weights,
        activations=activation_bytes(config, axis_sizes, micro_batch_size=micro_batch_size,
                                     seq_len=seq_len, response_len=response_len,
                                     compute_bytes=compute_bytes, chunk_size=chunk_size,
                                     remat=remat, flash_attention=flash_attention,
                                     attention_copies=attention_copies),
        kv_pages=kv)
