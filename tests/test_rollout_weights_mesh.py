"""The rollout's per-call set-up on a mesh: the decode copy of the weights (cast to the compute
dtype, split over ``tensor`` by the rollout's layout and whole over the row axes) as one jitted
program, and the sharded cache built without a compilation per call; with several processes,
each one's local copy taken from the gathered weights' own shards. On two H100s the copy by
``jax.device_put`` took 2.3 s of every rollout and the cache's builder recompiled each time
(0.2 s); the one-GPU rollout paid neither.

Runs as a script in a subprocess on simulated CPU devices where the suite's process has one
device; on a multi-GPU host (``scripts/multi_gpu.py``'s tests) on its GPUs."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from conftest import run_on_simulated_devices


def test_decode_weights_and_cache_on_a_mesh():
    if jax.device_count() > 1:      # a multi-GPU host (scripts/multi_gpu.py): its own devices
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main()
        out = out.getvalue()
    else:
        out = run_on_simulated_devices(Path(__file__).resolve())
    lines = ["decode copy on the mesh", "local replica without a copy", "cache compiled once"]
    if jax.device_count() >= 4:
        lines.append("local tensor blocks")
    for line in lines:
        assert f"{line}: ok" in out, out


def main():
    from flax import nnx

    from sparrow_jax import sharding
    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.qwen3 import init_model
    from sparrow_jax.rollout import decode_loop
    from sparrow_jax.rollout import engine

    cfg = ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    # The blocks each layout gives a device, by hand: (rows, columns) of a tensor shard t of 2.
    split = {"embed_tokens": (True, False), "lm_head": (True, False),
             "q_proj/kernel": (False, True), "k_proj/kernel": (False, True),
             "v_proj/kernel": (False, True),
             "gate_proj/kernel": (False, True), "up_proj/kernel": (False, True),
             "o_proj/kernel": (True, False), "down_proj/kernel": (True, False)}

    def block(path, x, tensor, t):
        """The part of the whole ``x`` a device of tensor index t holds."""
        rows, cols = next((v for k, v in split.items() if path.endswith(k)), (False, False))
        if tensor == 1 or not (rows or cols):
            return x
        if rows:
            n = x.shape[0] // tensor
            return x[t * n:(t + 1) * n]
        n = x.shape[1] // tensor
        return x[:, t * n:(t + 1) * n]

    for shape in ((1, 2, 1), (1, 1, 2)):
        mesh = sharding.make_mesh(sharding.MeshConfig(*shape), jax.devices()[:2])
        devices = set(mesh.devices.flat)
        tensor = mesh.shape["tensor"]
        # Float32 masters computing in bfloat16, sharded over fsdp and tensor as the trainer
        # holds them; and the same weights committed to one device (a notebook's model), which
        # takes the fallback.
        sharded = init_model(cfg, dtype=jnp.bfloat16)
        expect = {"/".join(map(str, path)): np.asarray(x).astype(jnp.bfloat16)
                  if np.issubdtype(x.dtype, np.floating) else np.asarray(x)
                  for path, x in nnx.to_flat_state(nnx.state(sharded))}
        sharding.shard_model(sharded, mesh)
        assert any(not x.sharding.is_fully_replicated
                   for x in jax.tree.leaves(nnx.state(sharded)))
        alone = init_model(cfg, dtype=jnp.bfloat16)
        nnx.update(alone, jax.device_put(nnx.state(alone), jax.devices()[0]))
        for model in (sharded, alone):
            _, params = engine.model_params(model, mesh)
            assert engine._cast_onto.cache_info().currsize >= 1   # the jitted copy, not device_put
            for path, x in nnx.to_flat_state(params):
                path = "/".join(map(str, path))
                assert x.sharding.device_set == devices, path
                assert x.dtype == expect[path].dtype, (path, x.dtype)
                for shard in x.addressable_shards:
                    t = mesh.devices.flatten().tolist().index(shard.device) % tensor
                    np.testing.assert_array_equal(np.asarray(shard.data),
                                                  block(path, expect[path], tensor, t),
                                                  err_msg=f"{path} on tensor shard {t}")
        # Weights that already are the copy (compute dtype, laid out) are not copied again.
        ready = init_model(cfg, dtype=jnp.float32)
        _, laid = engine.model_params(ready, mesh)
        nnx.update(ready, laid)
        _, params = engine.model_params(ready, mesh)
        for (path, x), y in zip(nnx.to_flat_state(nnx.state(ready)), jax.tree.leaves(params)):
            assert y.addressable_shards[0].data.unsafe_buffer_pointer() == (
                x.addressable_shards[0].data.unsafe_buffer_pointer()), path
    print("decode copy on the mesh: ok")

    # A process's share of the run's mesh (its own devices): the whole weights gathered over
    # the run's mesh, then replicated on the local mesh from their own shards, with no copy.
    n = min(4, jax.device_count())
    run_mesh = sharding.make_mesh(sharding.MeshConfig(1, n, 1), jax.devices()[:n])
    mine = jax.devices()[n // 2:n]
    local_mesh = sharding.make_mesh(sharding.MeshConfig(1, len(mine), 1), mine)
    x = jax.device_put(np.arange(24.0, dtype=np.float32).reshape(4, 6),
                       jax.sharding.NamedSharding(run_mesh, jax.sharding.PartitionSpec()))
    local = sharding.local_shards(x, local_mesh)
    assert local.sharding.is_fully_replicated
    assert local.sharding.device_set == set(mine)
    np.testing.assert_array_equal(np.asarray(local), np.asarray(x))
    source = {s.device: s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    assert all(s.data.unsafe_buffer_pointer() == source[s.device]
               for s in local.addressable_shards)
    print("local replica without a copy: ok")

    if jax.device_count() >= 4:
        # Split over tensor: the run's mesh (1, 2, 2); this process's devices hold one block of
        # each tensor index. In the mesh's own order no copy; in the other order each device
        # takes a copy of the block its neighbour holds; a layout no local device holds raises.
        spec = jax.sharding.PartitionSpec(None, "tensor")
        run_mesh = sharding.make_mesh(sharding.MeshConfig(1, 2, 2), jax.devices()[:4])
        x = jax.device_put(np.arange(24.0, dtype=np.float32).reshape(4, 6),
                           jax.sharding.NamedSharding(run_mesh, spec))
        mine = list(run_mesh.devices[0, 1])
        source = {s.device: s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        for order in (mine, mine[::-1]):
            # Mesh, not jax.make_mesh: on GPUs make_mesh sorts the devices by id, which would
            # make both orders one mesh.
            local_mesh = jax.sharding.Mesh(np.array(order).reshape(1, 1, 2), sharding.AXES,
                                           axis_types=(jax.sharding.AxisType.Auto,) * 3)
            local = sharding.local_shards(x, local_mesh, spec)
            assert local.sharding.spec == spec and local.sharding.device_set == set(mine)
            np.testing.assert_array_equal(np.asarray(local), np.asarray(x))
            copied = [s.data.unsafe_buffer_pointer() != source[s.device]
                      for s in local.addressable_shards]
            assert not any(copied) if order == mine else all(copied), (order, copied)
        try:
            sharding.local_shards(x, jax.make_mesh((1, 1, 1), sharding.AXES, devices=mine[:1]),
                                  jax.sharding.PartitionSpec())
        except ValueError as e:
            assert "no local device holds block" in str(e), e
        else:
            raise AssertionError("a block no local device holds was accepted")
        print("local tensor blocks: ok")

    mesh = sharding.make_mesh(sharding.MeshConfig(1, 2, 1), jax.devices()[:2])
    devices = set(mesh.devices.flat)
    table = jax.device_put(np.zeros((2, 8), np.int32),
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
                               decode_loop.ROWS)))
    for _ in range(2):
        cache = decode_loop.sharded_cache(cfg, 16, table, page_size=4, dtype="bfloat16",
                                          scorer="centroid", mesh=mesh)
    assert decode_loop._cache_builder.cache_info().currsize == 1
    assert decode_loop._cache_builder(cfg, 16, 4, jnp.dtype("bfloat16"), "centroid",
                                      mesh)._cache_size() == 1
    assert cache.k_pages[0].shape[1] == 2 * 16 and cache.k_pages[0].sharding.device_set == devices
    print("cache compiled once: ok")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
