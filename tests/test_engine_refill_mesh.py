"""Continuous refill against the static engine under a data-parallel mesh (data=8, 8 simulated
CPU devices): the same samples with 2, 5 and 16 slots, with and without preemption, per-prompt
caps included; every sample back once, every page free. Refill itself runs on one device (it has
no mesh yet, docs/design.md, section 11); the reference is ``generate(mesh=)``.

Runs in a subprocess (this file as a script); directly::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python tests/test_engine_refill_mesh.py
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import run_on_simulated_devices
from test_engine_mesh import CFG, LENGTHS, N, P, R, V, _compare, _prompts

CAPS = (4, 10, 7, 1, 9)
RUNS = ((2, 11), (5, 11), (16, 11), (16, 200))   # (slots, pool): 11 pages force preemption


@pytest.mark.slow
def test_refill_equals_data_parallel_static():
    out = run_on_simulated_devices(Path(__file__).resolve())
    assert f"checked {2 * len(RUNS)} refill runs" in out, out


def main() -> None:
    jax.config.update("jax_default_matmul_precision", "highest")
    from sparrow_jax.models.qwen3 import init_model
    from sparrow_jax.rollout.engine import RolloutConfig, generate
    from sparrow_jax.rollout.refill import run_refill
    from sparrow_jax.schedule import BudgetSchedule

    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((8, 1, 1), ("data", "fsdp", "tensor"))
    model = init_model(CFG, seed=0)
    config = RolloutConfig(n=N, max_new_tokens=R, temperature=1.0, page_size=P,
                           prompt_multiple=32, steps_per_call=3, dense_layers=(0,), page_seed=3,
                           logprob_top_k=V, table_bucket_pages=None)
    schedule = BudgetSchedule.fixed(3, page_size=P)
    key = jax.random.key(4)
    checked = 0
    preempted = {True: 0, False: 0}      # small pool: runs that preempted
    for caps in (None, CAPS):
        ref = generate(model, _prompts(), config, key, schedule, mesh=mesh, max_new_tokens=caps)
        for slots, pool in RUNS:
            got, stats = run_refill(model, _prompts(), dataclasses.replace(config, num_pages=pool),
                                    key, schedule, slots=slots, max_new_tokens=caps)
            label = f"caps {caps}, {slots} slots, pool {pool}"
            _compare(ref, got, key, label)
            np.testing.assert_array_equal(np.asarray(got.response_lengths),
                                          np.asarray(ref.response_lengths))
            assert stats.returned == len(LENGTHS) * N, label
            assert stats.pages_in_use_after == 0 and stats.sequences_after == 0, label
            preempted[pool == 11] += stats.preemptions > 0
            print(f"{label}: {stats}")
            checked += 1
    assert preempted[True] >= 1 and preempted[False] == 0, preempted
    print(f"checked {checked} refill runs")


if __name__ == "__main__":
    main()
