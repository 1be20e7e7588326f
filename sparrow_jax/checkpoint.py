"""Orbax checkpoints of a training run, for exact (bit-for-bit) resume.

A checkpoint holds the arrays (dense params, optimizer state, RNG key data) and a JSON record
(step, data iterator state, budget schedule, anything JSON the trainer adds). Arrays are saved
as the flat leaf list of their pytrees and restored into the structure of a template (the
freshly initialised state), so NNX and optax container types never enter the file format.
Saves are synchronous: once :meth:`Checkpointer.save` returns, the step directory is final (orbax
writes into a temporary directory and renames it), so a kill cannot leave a partial checkpoint
that a resume would read.

Sharded arrays are written as they lie (each process writes the shards it holds; nothing is
gathered) and restored straight into the layout of the template's leaves, which may come from
another mesh than the one that saved them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


def _abstract(x) -> jax.ShapeDtypeStruct:
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class Checkpointer:
    """Checkpoints under ``directory``, keeping the last ``keep`` steps."""

    def __init__(self, directory: str | Path, keep: int = 3):
        if keep <= 0:
            raise ValueError(f"keep must be positive, got {keep}")
        ocp = _ocp()
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=False, create=True))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, arrays: dict[str, Any], record: dict[str, Any]) -> None:
        """``arrays``: name -> pytree of arrays (``jax.Array`` leaves saved shard by shard);
        ``record``: JSON-serialisable metadata."""
        ocp = _ocp()
        leaves = {name: [x if isinstance(x, jax.Array) else np.asarray(x)
                         for x in jax.tree.leaves(tree)] for name, tree in arrays.items()}
        self._manager.save(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(leaves), record=ocp.args.JsonSave(record)))
        self._manager.wait_until_finished()

    def restore(self, step: int, templates: dict[str, Any]) -> tuple[dict[str, Any], dict]:
        """-> (name -> pytree shaped like ``templates[name]``, the JSON record).

        A template leaf with a sharding (a ``jax.Array``, or a ``jax.ShapeDtypeStruct`` given
        one) is restored into that sharding, whatever mesh saved it; other leaves onto the
        default device.
        """
        ocp = _ocp()
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"available: {self.all_steps()}")
        abstract = {name: [_abstract(x) for x in jax.tree.leaves(tree)]
                    for name, tree in templates.items()}
        out = self._manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(abstract), record=ocp.args.JsonRestore()))
        restored = {}
        for name, tree in templates.items():
            leaves = out["arrays"][name]
            treedef = jax.tree.structure(tree)
            if len(leaves) != treedef.num_leaves:
                raise ValueError(f"checkpoint {step}: {name} has {len(leaves)} arrays, the model "
                                 f"expects {treedef.num_leaves}")
            restored[name] = jax.tree.unflatten(treedef, [jax.numpy.asarray(x) for x in leaves])
        return restored, dict(out["record"])

    def read_record(self, step: int) -> dict:
        """The JSON record of checkpoint ``step`` alone (no arrays read)."""
        ocp = _ocp()
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"available: {self.all_steps()}")
        out = self._manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))
        return dict(out["record"])

    def close(self) -> None:
        self._manager.close()
