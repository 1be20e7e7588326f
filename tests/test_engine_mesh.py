"""The rollout engine under a device mesh: a sampled rollout gives the tokens of the one-device
rollout on every mesh. With ``tensor`` > 1 the weights are split (heads, MLP width, and the
vocabulary where it divides), the O and down projections summed over the shards: the default
test also runs a model with attention biases, active LoRA adapters and a vocabulary the axis
does not divide.

The comparison runs in a subprocess (this file run as a script) with 8 simulated CPU devices
(``--xla_force_host_platform_device_count=8``); on a multi-device host (e.g. 2 GPUs) it runs in
the test's own process on the devices found, the meshes scaled to their count. Run it directly
to see the figures::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python tests/test_engine_mesh.py 8,1,1 2,4,1 2,2,2 1,8,1
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import TINY_ENGINE, random_prompts, run_on_simulated_devices

P = 4
CFG = TINY_ENGINE
V = CFG.vocab_size
LENGTHS = (5, 8, 21, 3, 13)   # 5 prompts: most meshes need placeholder prompts
N, R = 2, 10
MAX_GAP = 1e-5                # a token may differ only where the draw was this close to a tie


def _run_script(*meshes: str) -> str:
    """The script's printout: on a multi-device host (e.g. 2 GPUs) run here on the devices
    found; otherwise in a subprocess on simulated CPU devices."""
    if jax.device_count() > 1:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(list(meshes))
        return out.getvalue()
    return run_on_simulated_devices(Path(__file__).resolve(), *meshes)


def _checked(out: str) -> tuple[int, int]:
    """Meshes the script compared (each comparison printed its "same tokens" line: every mesh
    with the plain model, those with a tensor split also with the adapted one)."""
    meshes, adapted = (int(x) for x in out.split("checked ")[-1].split()[:2])
    assert out.count("same tokens") == meshes + adapted and meshes >= 1, out
    return meshes, adapted


def test_sampled_rollout_equals_one_device_on_a_2x2x2_mesh():
    out = _run_script("2,2,2")
    meshes = _meshes([(2, 2, 2)], int(out.split()[0]))
    split = sum(m[2] > 1 for m in meshes)
    assert _checked(out) == (len(meshes), split) and split >= 1, out


@pytest.mark.slow
def test_sampled_rollout_equals_one_device_on_every_mesh():
    requested = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 8, 1)]
    out = _run_script(*(",".join(map(str, m)) for m in requested))
    devices = int(out.split()[0])   # the script's first line: "<n> devices (<platform>); ..."
    meshes = _meshes(requested, devices)
    assert _checked(out) == (len(meshes), sum(m[2] > 1 for m in meshes)), out


@pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2,
                    reason="needs two GPUs: the decode kernels run on GPUs only")
def test_decode_kernels_on_a_tensor_split_in_bfloat16():
    """On two GPUs, in bfloat16, at a shape where the decode step's kernels apply to each
    shard's block (the q/k/v partial sums and the gate-up kernel on half the heads and half the
    MLP width): a (1, 1, 2) rollout against one GPU's. Until the first differing token of a row
    (near-ties in bfloat16) the log-probs agree to bfloat16 rounding; wrong blocks would send
    them apart at the first decode step."""
    import dataclasses

    import jax.numpy as jnp

    from pallas_kernels.decode_gemm_gpu import gemm_limits
    from pallas_kernels.decode_mlp_gpu import kernel_limits
    from sparrow_jax.models.qwen3 import init_model
    from sparrow_jax.rollout.engine import RolloutConfig, generate
    from sparrow_jax.schedule import BudgetSchedule

    cfg = dataclasses.replace(CFG, vocab_size=256, hidden_size=256, intermediate_size=512,
                              head_dim=128)
    rows = N * len(LENGTHS)
    assert gemm_limits(rows, 256, 256 + 2 * 128, jnp.bfloat16) is None      # q, k, v halves
    assert kernel_limits(rows, 256, 256, jnp.bfloat16) is None              # gate, up halves
    model = init_model(cfg, seed=0, dtype=jnp.bfloat16)
    config = RolloutConfig(n=N, max_new_tokens=R, temperature=1.0, page_size=P,
                           prompt_multiple=32, steps_per_call=R, dense_layers=(0,), page_seed=3,
                           table_bucket_pages=None)
    schedule, key = BudgetSchedule.fixed(3, page_size=P), jax.random.key(4)
    ref = generate(model, random_prompts(LENGTHS), config, key, schedule)
    got = generate(model, random_prompts(LENGTHS), config, key, schedule,
                   mesh=jax.make_mesh((1, 1, 2), ("data", "fsdp", "tensor"),
                                      devices=jax.devices()[:2]))
    rt, gt = np.asarray(ref.tokens), np.asarray(got.tokens)
    pl = np.asarray(ref.prompt_lengths)
    agreed = 0
    for b in range(len(pl)):
        a, g = rt[b, pl[b]:pl[b] + R], gt[b, pl[b]:pl[b] + R]
        j = int(np.argmax(a != g)) if (a != g).any() else R
        np.testing.assert_allclose(np.asarray(got.logprobs)[b, :j],
                                   np.asarray(ref.logprobs)[b, :j], atol=0.05, err_msg=str(b))
        agreed += j
    assert agreed >= len(pl) * R // 2, agreed     # most positions compared, not a few


def test_mesh_axes_are_checked():
    from sparrow_jax.models.qwen3 import init_model
    from sparrow_jax.rollout.engine import RolloutConfig, generate

    mesh = jax.make_mesh((1, 1), ("data", "model"))
    with pytest.raises(ValueError, match=r"mesh's axes must be \('data', 'fsdp', 'tensor'\)"):
        generate(init_model(CFG), [[1, 2]], RolloutConfig(page_size=P), jax.random.key(0),
                 mesh=mesh)


# ------------------------------------------------------------------------------ the script
def _meshes(requested: list[tuple[int, int, int]], devices: int) -> list[tuple[int, int, int]]:
    """The requested meshes when they use every device; otherwise (another device count) the
    same layouts scaled to ``devices``, those the tiny model's 2 KV heads allow."""
    if all(np.prod(m) == devices for m in requested):
        return requested
    d = devices
    scaled = [(d, 1, 1), (2, d // 2, 1), (2, 2, d // 4), (1, d, 1), (1, d // 2, 2)]
    return list(dict.fromkeys(m for m in scaled if np.prod(m) == d
                              and m[2] <= CFG.num_key_value_heads and min(m) >= 1))


def _check_pool_is_split(mesh) -> None:
    """Each device holds its row shard's pool (a block of the page axis) and its KV heads."""
    import jax.numpy as jnp

    from sparrow_jax.rollout.decode_loop import sharded_cache

    groups, tensor = mesh.shape["data"] * mesh.shape["fsdp"], mesh.shape["tensor"]
    table = jax.device_put(np.zeros((groups * 2, 3), np.int32),
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
                               ("data", "fsdp"))))
    cache = sharded_cache(CFG, 7, table, page_size=P, dtype=jnp.float32, scorer="centroid",
                          mesh=mesh)
    h, d = CFG.num_key_value_heads, CFG.head_dim
    assert cache.k_pages[0].shape == (h, groups * 7, P, d)
    for shard in cache.k_pages[0].addressable_shards:
        assert shard.data.shape == (h // tensor, 7, P, d)
    for shard in cache.partial_sum.addressable_shards:
        assert shard.data.shape == (CFG.num_hidden_layers, 2, h // tensor, d)


def _compare(ref, got, key, label: str) -> None:
    """Row by row: the same tokens; up to a row's first differing token (allowed only where the
    reference's Gumbel-max draw had its best two candidates within MAX_GAP) the same log-probs
    and top-k."""
    from sparrow_jax.rollout.sampling import step_keys, stream_keys

    rt, gt = np.asarray(ref.tokens), np.asarray(got.tokens)
    pl, rl = np.asarray(ref.prompt_lengths), np.asarray(ref.response_lengths)
    np.testing.assert_array_equal(np.asarray(got.prompt_index), np.asarray(ref.prompt_index))
    np.testing.assert_array_equal(np.asarray(got.prompt_lengths), pl)
    ids, logps = np.asarray(ref.topk_ids), np.asarray(ref.topk_logprobs, np.float64)
    s, v = len(pl), ids.shape[2]
    # Every draw of the reference, rebuilt: argmax(logp + gumbel(step key)) over the whole
    # vocabulary (logprob_top_k = V records all of logp); the gap of a differing token is read
    # from these perturbed log-probs.
    rows, steps = np.meshgrid(np.arange(s), np.arange(R), indexing="ij")
    keys = step_keys(stream_keys(key, rows.ravel() // N, rows.ravel() % N), steps.ravel())
    noise = np.asarray(jax.vmap(lambda k: jax.random.gumbel(k, (v,)))(keys), np.float64)
    logp = np.empty((s, R, v))
    np.put_along_axis(logp, ids, logps, axis=2)
    pert = logp + noise.reshape(s, R, v)
    for b in range(s):
        drawn = rt[b, pl[b] + np.arange(rl[b])]
        np.testing.assert_array_equal(np.argmax(pert[b, :rl[b]], -1), drawn)
    differing = []
    for b in range(s):
        a, g = rt[b, pl[b]:pl[b] + R], gt[b, pl[b]:pl[b] + R]
        j = int(np.argmax(a != g)) if (a != g).any() else R
        if j < R:
            gap = abs(pert[b, j, a[j]] - pert[b, j, g[j]])
            assert gap < MAX_GAP, f"{label}: row {b} differs at {j} with gap {gap:.3g}"
            differing.append((b, j, gap))
        np.testing.assert_allclose(np.asarray(got.logprobs)[b, :j],
                                   np.asarray(ref.logprobs)[b, :j], atol=1e-5)
        np.testing.assert_array_equal(np.asarray(got.topk_ids)[b, :j, :5], ids[b, :j, :5])
        np.testing.assert_array_equal(np.asarray(got.budget_pages)[b, :j],
                                      np.asarray(ref.budget_pages)[b, :j])
        if j == R:
            assert int(np.asarray(got.response_lengths)[b]) == rl[b]
    print(f"{label}: same tokens in {s - len(differing)}/{s} rows; differing "
          f"(row, position, gap): {differing}")


def _adapted_model():
    """The tiny model with attention biases, an odd vocabulary (49: split over no tensor axis)
    and LoRA adapters on every linear layer, biases and adapters' B random (both start at 0)."""
    import dataclasses

    from flax import nnx

    from sparrow_jax.models.lora import LoRAConfig, attach_lora
    from sparrow_jax.models.qwen3 import init_model
    from sparrow_jax.sharding import path_name

    model = attach_lora(init_model(dataclasses.replace(CFG, vocab_size=V + 1,
                                                       attention_bias=True), seed=1),
                        LoRAConfig(rank=4), jax.random.key(5))
    state = nnx.state(model)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    keys = jax.random.split(jax.random.key(6), len(leaves))
    leaves = [jax.random.normal(k, x.shape, x.dtype) * 0.1
              if path_name(path).endswith(("/bias", "/lora_b")) else x
              for (path, x), k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


def main(argv: list[str]) -> None:
    import dataclasses
    import time

    jax.config.update("jax_default_matmul_precision", "highest")   # float32 on GPUs too
    from sparrow_jax.models.qwen3 import init_model
    from sparrow_jax.rollout.engine import RolloutConfig, generate
    from sparrow_jax.schedule import BudgetSchedule

    requested = [tuple(int(x) for x in a.split(",")) for a in argv] or [(2, 2, 2)]
    devices = jax.device_count()
    meshes = _meshes(requested, devices)
    print(f"{devices} devices ({jax.devices()[0].platform}); meshes {meshes}")
    assert meshes, f"no mesh of {requested} fits {devices} devices"
    model = init_model(CFG, seed=0)
    config = RolloutConfig(n=N, max_new_tokens=R, temperature=1.0, page_size=P,
                           prompt_multiple=32, steps_per_call=R, dense_layers=(0,), page_seed=3,
                           logprob_top_k=V, table_bucket_pages=None)
    schedule = BudgetSchedule.fixed(3, page_size=P)   # sparse: below most rows' page count
    key = jax.random.key(4)
    t0 = time.perf_counter()
    ref = generate(model, random_prompts(LENGTHS), config, key, schedule)
    print(f"one device: {time.perf_counter() - t0:.1f} s")
    for shape in meshes:
        mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"))
        _check_pool_is_split(mesh)
        t0 = time.perf_counter()
        got = generate(model, random_prompts(LENGTHS), config, key, schedule, mesh=mesh)
        print(f"mesh {shape}: {time.perf_counter() - t0:.1f} s")
        _compare(ref, got, key, f"mesh {shape}")
    if any(m[2] > 1 for m in meshes):
        adapted = _adapted_model()
        config = dataclasses.replace(config, logprob_top_k=V + 1)
        ref = generate(adapted, random_prompts(LENGTHS), config, key, schedule, lora=True)
        for shape in (m for m in meshes if m[2] > 1):
            got = generate(adapted, random_prompts(LENGTHS), config, key, schedule, lora=True,
                           mesh=jax.make_mesh(shape, ("data", "fsdp", "tensor")))
            _compare(ref, got, key, f"biases, LoRA and vocabulary {V + 1} on mesh {shape}")
    bad = jax.make_mesh((1, devices // 4, 4), ("data", "fsdp", "tensor")) if devices % 4 == 0 \
        else None
    if bad is not None:
        try:
            generate(model, random_prompts(LENGTHS), config, key, schedule, mesh=bad)
        except ValueError as e:
            assert "tensor=4 must divide the model's 2 KV heads" in str(e), e
        else:
            raise AssertionError("a tensor axis wider than the KV heads was accepted")
    split = [m for m in meshes if m[2] > 1]
    print(f"checked {len(meshes)} {len(split)} meshes (all, then those with a tensor split "
          "again with the adapted model)")


if __name__ == "__main__":
    main(sys.argv[1:])
