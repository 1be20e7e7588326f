"""Training-side sharding: a device mesh, partition rules as one table, and the shardings of a
model, its optimizer state and the forward's activations.

Mesh axes (in this order):

- ``data``: replicas. Parameters and optimizer state are copied; the batch is split.
- ``fsdp``: parameters, gradients and optimizer state are split (each device holds a slice and
  the compiler gathers a layer's weights when it runs), and the batch is split too.
- ``tensor``: attention heads, MLP width and the vocabulary are split; the residual stream is
  not.

A rule names, per array dimension, the mesh axes that split it. A dimension is split only when
the product of its axes' sizes divides it; otherwise the axes are dropped from the right until
it does (at worst the dimension is replicated), so a tiny test model runs on any mesh. Axes of
size 1 are dropped as well, so equal layouts have equal specs.

Using it: ``shard_model(model, mesh)`` places a model's variables; everything downstream follows
the arrays' shardings (:class:`~sparrow_jax.rl.update.PolicyUpdater` builds the optimizer state
on the same mesh and runs its steps under it; checkpoints restore onto the shardings of their
templates).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")   # the rows of a batch: split over every replica and FSDP shard

# One entry per dimension of the array: None (whole), an axis name, or a tuple of axis names.
Logical = tuple[Any, ...]

# Parameter path (``/``-joined nnx state path, layer indices included) -> logical spec. The
# first pattern that ``re.search``-es the path wins. Linear kernels are ``[in, out]``: the
# column-parallel layers (q/k/v, gate/up) split their output over ``tensor``, the row-parallel
# ones (o, down) their input, so the pair needs one reduction; the other dimension is the FSDP
# slice. A LoRA adapter follows its base kernel: A ``[in, r]`` takes the kernel's input axis,
# B ``[r, out]`` its output axis, the rank stays whole.
PARAM_RULES: tuple[tuple[str, Logical], ...] = (
    (r"^(embed_tokens|lm_head)$", ("tensor", "fsdp")),          # [vocab, hidden]
    (r"/(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", ("fsdp", "tensor")),
    (r"/(o_proj|down_proj)/kernel$", ("tensor", "fsdp")),
    (r"/(q_proj|k_proj|v_proj)/bias$", ("tensor",)),
    (r"/o_proj/bias$", (None,)),
    (r"/(q_proj|k_proj|v_proj|gate_proj|up_proj)/lora_a$", ("fsdp", None)),
    (r"/(q_proj|k_proj|v_proj|gate_proj|up_proj)/lora_b$", (None, "tensor")),
    (r"/(o_proj|down_proj)/lora_a$", ("tensor", None)),
    (r"/(o_proj|down_proj)/lora_b$", (None, "fsdp")),
    (r"(^|/)(input_layernorm|post_attention_layernorm|q_norm|k_norm|norm)/weight$", (None,)),
)

# The forward's activations, by the letters of their dimensions (B batch, T tokens, D hidden,
# H heads, K head dim, F MLP width). Batch inputs take BATCH on their rows
# (:func:`batch_sharding`); the LM head's logits follow the vocabulary split of its weight.
ACTIVATION_RULES: dict[str, Logical] = {
    "BTD": (BATCH, None, None),              # residual stream
    "BTHK": (BATCH, None, "tensor", None),   # q, k, v per head
    "BTF": (BATCH, None, "tensor"),          # MLP gate * up
}


# --------------------------------------------------------------------------------- the mesh
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; one of them may be -1: whatever the device count leaves over."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def __post_init__(self):
        for name in AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or (
                    value <= 0 and value != -1):
                raise ValueError(f"mesh.{name} must be a positive int or -1, got {value!r}")
        rest = [name for name in AXES if getattr(self, name) == -1]
        if len(rest) > 1:
            raise ValueError(f"mesh: at most one axis may be -1, got {rest}")

    def axis_sizes(self, num_devices: int) -> tuple[int, int, int]:
        """The (data, fsdp, tensor) sizes on ``num_devices`` devices."""
        sizes = [getattr(self, name) for name in AXES]
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % fixed:
                raise ValueError(f"mesh {self.spelling()}: {num_devices} devices do not split "
                                 f"into {fixed} x the rest")
            sizes[sizes.index(-1)] = num_devices // fixed
        elif fixed != num_devices:
            raise ValueError(f"mesh {self.spelling()} needs {fixed} devices, found {num_devices}")
        return tuple(sizes)

    def spelling(self) -> str:
        return ", ".join(f"{name}={getattr(self, name)}" for name in AXES)


def make_mesh(config: MeshConfig = MeshConfig(), devices: Sequence | None = None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: every device of every process).
    Axes are ``Auto``: the compiler propagates shardings from the arrays and the constraints.
    ``devices`` chooses which devices, not where they sit: ``jax.make_mesh`` places them by the
    hardware's topology (on GPUs by device id), so build a ``Mesh`` directly to fix an order."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = config.axis_sizes(len(devices))
    return jax.make_mesh(sizes, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


# --------------------------------------------------------------------------------- specs
def resolve(logical: Logical, shape: Sequence[int], axis_sizes: dict[str, int]) -> PartitionSpec:
    """Logical spec -> PartitionSpec for ``shape`` on a mesh of ``axis_sizes``: axes of size 1
    dropped; a dimension the axes' product does not divide loses axes from the right."""
    if len(logical) != len(shape):
        raise ValueError(f"spec {logical} has {len(logical)} entries for shape {tuple(shape)}")
    out = []
    for entry, dim in zip(logical, shape):
        axes = [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
        axes = [a for a in axes if axis_sizes.get(a, 1) > 1]
        while axes and dim % math.prod(axis_sizes[a] for a in axes):
            axes.pop()
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*out)


def path_name(key_path) -> str:
    """A jax key path -> ``layers/0/self_attn/q_proj/kernel`` (an nnx Variable's trailing
    ``value`` attribute left out)."""
    parts = []
    for k in key_path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        else:
            parts.append(str(k))
    if parts and parts[-1] == "value":
        parts.pop()
    return "/".join(parts)


def param_logical(path: str) -> Logical:
    """The logical spec of the parameter at ``path``; ValueError naming it if no rule matches."""
    for pattern, logical in PARAM_RULES:
        if re.search(pattern, path):
            return logical
    raise ValueError(f"no partition rule matches parameter {path!r}; add a row to "
                     "sparrow_jax.sharding.PARAM_RULES")


def _sizes(mesh) -> dict[str, int]:
    return dict(mesh.shape)


def param_specs(state, axis_sizes: dict[str, int]):
    """PartitionSpec pytree like ``state`` (an nnx State, or any pytree with parameter paths)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: resolve(param_logical(path_name(p)), np.shape(x), axis_sizes), state)


def rollout_specs(state, tensor: int):
    """PartitionSpec pytree like ``state`` for the rollout's decode copy on a mesh whose
    ``tensor`` axis has this size: :data:`PARAM_RULES` with only ``tensor`` kept (heads, MLP
    width and vocabulary split; whole over ``data`` and ``fsdp``, whose shards decode rows of
    their own). The decode loop runs in ``shard_map`` over these blocks
    (:meth:`~sparrow_jax.models.qwen3.Qwen3.forward`'s ``tensor_axis``)."""
    return param_specs(state, {"tensor": tensor})


def state_shardings(state, mesh: Mesh):
    """NamedSharding pytree like ``state`` (a model's nnx State or its trainable part)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(state, _sizes(mesh)),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def opt_state_shardings(optimizer, opt_state, param_shardings, mesh: Mesh):
    """NamedSharding pytree like ``opt_state`` (real or from ``jax.eval_shape``): every copy of
    the parameter tree inside it (Adam's moments, ...) takes ``param_shardings``; the rest (step
    counts) is replicated."""
    import optax

    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(optimizer, lambda _, s: s, opt_state, param_shardings,
                                 transform_non_params=lambda x: jax.tree.map(
                                     lambda _: replicated, x),
                                 is_leaf=lambda x: isinstance(x, NamedSharding))


def init_opt_state(optimizer, params):
    """``optimizer.init(params)``; when ``params`` lie on a mesh, the state laid out like them
    (:func:`opt_state_shardings`), built there rather than gathered on one device."""
    mesh = mesh_of(params)
    if mesh is None:
        return optimizer.init(params)
    out = opt_state_shardings(optimizer, jax.eval_shape(optimizer.init, params),
                              state_shardings(params, mesh), mesh)
    return jax.jit(optimizer.init, out_shardings=out)(params)


def shard_model(model, mesh: Mesh):
    """Places every variable of the NNX ``model`` by :data:`PARAM_RULES` on ``mesh`` (in place);
    returns the model."""
    from flax import nnx

    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, state_shardings(state, mesh)))
    return model


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """Rows (axis 0) over ``data`` x ``fsdp`` as far as they divide; other axes whole."""
    return NamedSharding(mesh, resolve((BATCH,) + (None,) * (len(shape) - 1), shape,
                                       _sizes(mesh)))


def mesh_of(tree) -> Mesh | None:
    """The mesh of the first leaf of ``tree`` laid out by a NamedSharding, else None."""
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def use_mesh(mesh: Mesh | None):
    """``jax.set_mesh(mesh)`` as a context, or nothing when ``mesh`` is None."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


# --------------------------------------------------------------------------------- constraints
def _context_sizes() -> dict[str, int] | None:
    """Sizes of the ``Auto`` axes of the mesh set by :func:`use_mesh`, None without one (and
    inside ``shard_map``, where the axes are manual)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    sizes = {name: size for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes,
                                                    mesh.axis_types)
             if kind == AxisType.Auto}
    return sizes if sizes and any(s > 1 for s in sizes.values()) else None


def has_context_mesh() -> bool:
    """Whether arrays here are laid out over a mesh of several devices by XLA (a custom call
    would then need its operands gathered); False inside ``shard_map``, whose code sees its
    own shards."""
    return _context_sizes() is not None


def constrain(x: jax.Array, kind: str) -> jax.Array:
    """Pins activation ``x`` to :data:`ACTIVATION_RULES` ``[kind]`` under the context mesh; the
    identity without one (single-device code is unchanged)."""
    sizes = _context_sizes()
    if sizes is None:
        return x
    return jax.lax.with_sharding_constraint(x, resolve(ACTIVATION_RULES[kind], x.shape, sizes))


def row_axes(rows: int) -> tuple[str, ...] | None:
    """The context mesh's axes that split ``rows`` batch rows (those of :data:`BATCH` the rule
    splits them over, as :func:`resolve` decides), or None without a mesh or a split."""
    sizes = _context_sizes()
    if sizes is None:
        return None
    axes = resolve((BATCH,), (rows,), sizes)[0]
    if axes is None:
        return None
    return (axes,) if isinstance(axes, str) else tuple(axes)


def constrain_params(tree):
    """Pins a parameter-shaped pytree (gradients, updated parameters) to the parameter rules under
    the context mesh; the identity without one."""
    sizes = _context_sizes()
    if sizes is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, param_specs(tree, sizes))


def local_shards(x: jax.Array, mesh: Mesh, spec: PartitionSpec = PartitionSpec()) -> jax.Array:
    """``x`` as an array laid out by ``spec`` on ``mesh``, whose devices are among those holding
    ``x``'s shards (a process's own devices), assembled from those shards: each device takes
    the one it holds when that is its block, else a copy of another local device's. ValueError
    when no local device holds a block (the run's mesh splits ``x`` across processes)."""
    def key(index):
        return tuple(sl.indices(n)[:2] for sl, n in zip(index, x.shape))

    held = {}
    for shard in x.addressable_shards:
        held.setdefault(key(shard.index), {})[shard.device] = shard.data
    target = NamedSharding(mesh, spec)
    wanted = target.devices_indices_map(x.shape)
    arrays = []
    for device in mesh.devices.flat:
        blocks = held.get(key(wanted[device]))
        if blocks is None:
            raise ValueError(f"local_shards: no local device holds block {wanted[device]} of an "
                             f"array of shape {x.shape} laid out as {x.sharding}")
        arrays.append(blocks[device] if device in blocks
                      else jax.device_put(next(iter(blocks.values())), device))
    return jax.make_array_from_single_device_arrays(x.shape, target, arrays)


def constrain_replicated(tree):
    """Whole copies on every device under the context mesh (small outputs read on the host by
    every process); the identity without one."""
    if _context_sizes() is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, PartitionSpec()), tree)
