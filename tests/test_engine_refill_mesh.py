"""Continuous refill under a device mesh against the static engine on the same mesh: the same
samples with 2, 5 and 16 slots per row shard, with and without preemption, per-prompt caps
included (with them the tail narrows to fewer slots); every sample back once, every page of
every shard's pool free. Meshes (8, 1, 1): a
queue and pool per data shard, two of them with no prompts; (2, 2, 2): rows over data x fsdp,
KV heads over tensor. Each run's chunks are also those its host-side replay
(``simulate_refill``) predicts.

Runs in a subprocess (this file as a script) on 8 simulated CPU devices; directly::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python tests/test_engine_refill_mesh.py 2,2,2 8,1,1
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import random_prompts, run_on_simulated_devices
from test_engine_mesh import CFG, N, P, R, V, _compare

LENGTHS = (5, 8, 21, 3, 13, 17, 2, 9, 22, 6, 11, 4)   # 12 prompts: 8 shards hold 2, 2, ..., 0, 0
CAPS = (4, 10, 7, 1, 9, 10, 3, 10, 6, 2, 8, 10)
SLOTS = (2, 5, 16)     # per row shard
SMALL_POOL = 11        # per shard: two 8-page rows of the longest prompts cannot grow at once


def _run(*meshes: str) -> str:
    out = run_on_simulated_devices(Path(__file__).resolve(), *meshes)
    assert out.count("same tokens") == out.count("pages free") > 0, out
    return out


def test_refill_on_a_2x2x2_mesh_equals_the_static_engine():
    out = _run("2,2,2", "--short")
    assert "checked 2 refill runs" in out, out


@pytest.mark.slow
def test_refill_on_every_mesh_equals_the_static_engine():
    out = _run("2,2,2", "8,1,1")
    assert f"checked {2 * 2 * (len(SLOTS) + 1)} refill runs" in out, out


def main(argv: list[str]) -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    from sparrow_jax.models.qwen3 import init_model
    from sparrow_jax.rollout.engine import RolloutConfig, generate
    from sparrow_jax.rollout.refill import run_refill
    from sparrow_jax.rollout.refill_schedule import simulate_refill
    from sparrow_jax.schedule import BudgetSchedule

    short = "--short" in argv
    meshes = [tuple(int(x) for x in a.split(",")) for a in argv if a != "--short"]
    assert jax.device_count() == 8, jax.devices()
    model = init_model(CFG, seed=0)
    config = RolloutConfig(n=N, max_new_tokens=R, temperature=1.0, page_size=P,
                           prompt_multiple=32, steps_per_call=3, dense_layers=(0,), page_seed=3,
                           logprob_top_k=V, table_bucket_pages=None)
    schedule = BudgetSchedule.fixed(3, page_size=P)
    key = jax.random.key(4)
    checked = 0
    for shape in meshes:
        mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"))
        shards = shape[0] * shape[1]
        runs = ([(5, SMALL_POOL)] if short else
                [(s, SMALL_POOL) for s in SLOTS] + [(SLOTS[-1], 200)])
        preempted = {True: 0, False: 0}
        narrowed = 0
        for caps in (None, CAPS):
            ref = generate(model, random_prompts(LENGTHS, seed=1), config, key, schedule, mesh=mesh,
                           max_new_tokens=caps)
            # With the caps, the tail narrows to as few as 1 slot per shard (rows gathered
            # within each shard).
            tail = shards if caps is not None else None
            for slots, pool in runs:
                chunks = []
                got, stats = run_refill(model, random_prompts(LENGTHS, seed=1),
                                        dataclasses.replace(config, num_pages=pool), key,
                                        schedule, slots=slots * shards, max_new_tokens=caps,
                                        mesh=mesh, on_chunk=chunks.append, tail_slots=tail)
                # No EOS here: the host's replay gives the same chunks per shard.
                sim, sim_stats = simulate_refill(
                    LENGTHS, caps or (R,) * len(LENGTHS), n=N, slots=slots * shards,
                    shards=shards, num_pages=pool, page_size=P, steps_per_call=3,
                    width=-(-(32 + R) // P), page_seed=3, tail_slots=tail)
                assert sim_stats == stats and [
                    (c["width"], c["steps"], c["slots"]) for c in sim] == [
                    (c["width"], c["steps"], c["slots"]) for c in chunks]
                assert all((a["contexts"] == b["contexts"]).all() for a, b in zip(sim, chunks))
                narrowed += min(c["slots"] for c in chunks) < slots * shards
                label = (f"mesh {shape}, caps {caps is not None}, {slots} slots/shard, pool "
                         f"{pool}, tail {tail}")
                _compare(ref, got, key, label)
                np.testing.assert_array_equal(np.asarray(got.response_lengths),
                                              np.asarray(ref.response_lengths))
                assert stats.returned == len(LENGTHS) * N, label
                assert stats.pages_in_use_after == 0 and stats.sequences_after == 0, label
                assert stats.peak_pages <= pool - 1, label
                preempted[pool == SMALL_POOL] += stats.preemptions > 0
                print(f"{label}: every sample once, all pages free; {stats}")
                checked += 1
        assert preempted[True] >= 1 and preempted[False] == 0, (shape, preempted)
        assert narrowed >= 1, shape          # some run's tail ran on fewer slots
    print(f"checked {checked} refill runs")


if __name__ == "__main__":
    main(sys.argv[1:])
