"""The GRPO trainer with the closed-loop schedule on (docs/design.md, section 9), on a tiny model
with the real rollout engine (sparse past layer 0, pages of 4 tokens, bins of 8 tokens): the
table moves every step without compiling the decode chunk again, each change is logged, and a
run interrupted mid-way resumes to the uninterrupted run's tables and metrics.
"""

import json
import os
import signal

import numpy as np
import pytest

from sparrow_jax.checkpoint import Checkpointer
from sparrow_jax.config import ModelConfig, from_dict
from sparrow_jax.rl import closed_loop as cl
from sparrow_jax.rl import trainer as trainer_mod
from sparrow_jax.rl.config import TrainConfig
from sparrow_jax.rl.interrupt import TrainingInterrupted
from sparrow_jax.rl.update import PolicyUpdater
from sparrow_jax.rollout import decode_loop


def _cfg(run_dir, steps, loop, **over):
    cfg = {
        "run_dir": str(run_dir), "steps": steps, "seed": 0, "reward": "reverse",
        "model": {"hf_config": {**ModelConfig.preset("tiny").to_hf_dict(), "vocab_size": 24,
                                "num_hidden_layers": 2}},
        "data": {"task": "reverse", "reverse": {"num_values": 8, "min_len": 6, "max_len": 8},
                 "num_train": 16, "num_eval": 2, "prompts_per_step": 2},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 10,
                    "engine": {"page_size": 4, "dense_layers": [0]}},
        # prompts of 8-10 tokens and 10 new ones: steps at lengths 9-20, bins 1 and 2
        "schedule": {"kind": "table", "table": [1, 1, 2], "bin_tokens": 8, "page_size": 4},
        "update": {"micro_batch_size": 4, "length_multiple": 32, "remat": False},
        "optim": {"learning_rate": 1e-3},
        "mismatch": {"min_count": 1},
        "closed_loop": {"enabled": True, "min_count": 1, **loop},
        "checkpoint_every": 2, "eval_every": 0, "tensorboard": False, "progress": False,
    }
    return from_dict(TrainConfig, {**cfg, **over})


def _metrics(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time_", "tokens_per_s"))}
            for r in rows]


def _tables(rows, bins=3):
    return [[int(r[f"schedule_pages_bin{i:02d}"]) for i in range(bins)] for r in rows]


def test_table_changes_do_not_compile_the_decode_loop_again(tmp_path):
    """A target no bin reaches (the paper estimator over top-20 of a 24-token vocabulary of a
    random model stays far below 0.999): every measured bin climbs one rung a step, 1 -> 12
    pages, while the decode chunk and the prefill compile once."""
    cfg = _cfg(tmp_path, 12, {"target": 0.999, "ladder": list(range(13)), "upper": 16.0,
                              "max_pages": 12})
    chunk, start = decode_loop.run_chunk._cache_size(), decode_loop.start._cache_size()
    rows = trainer_mod.train(cfg).history
    tables = _tables(rows)
    assert sum(r["schedule_changes"] > 0 for r in rows) >= 10
    # bin 0 holds no token (lengths >= 9): left alone
    assert tables[0] == [1, 2, 3] and tables[-1] == [1, 12, 12]
    for before, after, r in zip([[1, 1, 2]] + tables, tables, rows):
        assert after == sorted(after)
        for i in range(3):
            changed = f"schedule_new_bin{i:02d}" in r
            assert changed == (before[i] != after[i])
            if changed:
                assert r[f"schedule_old_bin{i:02d}"] == before[i]
    assert "closed_loop_tokens_bin00" not in rows[0] and rows[0]["closed_loop_tokens_bin01"] > 0
    assert decode_loop.run_chunk._cache_size() - chunk == 1
    assert decode_loop.start._cache_size() - start == 1


LOWER = {"target": 0.05, "margin": 0.0, "patience": 3, "lower": 0.0}   # every bin comfortable


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    trainer_mod.train(_cfg(run_dir, 6, LOWER, schedule={
        "kind": "table", "table": [0, 4, 6], "bin_tokens": 8, "page_size": 4}))
    return run_dir


def test_interrupted_run_resumes_to_the_same_tables_and_metrics(tmp_path, reference,
                                                                monkeypatch):
    """SIGINT in the fourth update: the checkpoint of step 4 holds a streak of 1 in the measured
    bins (lowerings at steps 2 and 5), so a resume that lost the controller's counters would
    lower at another step. Bin 0 holds no token and keeps its 0 pages."""
    schedule = {"kind": "table", "table": [0, 4, 6], "bin_tokens": 8, "page_size": 4}
    update, calls = PolicyUpdater.update, []

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return update(self, *args, **kwargs)

    monkeypatch.setattr(PolicyUpdater, "update", interrupted)
    with pytest.raises(TrainingInterrupted, match="before step 4"):
        trainer_mod.train(_cfg(tmp_path, 6, LOWER, schedule=schedule, checkpoint_every=10))
    record = Checkpointer(tmp_path / "checkpoints").read_record(4)
    state = cl.ControllerState.from_dict(record["closed_loop"])
    assert state.streak.tolist()[1:] == [1, 1]
    assert record["schedule"]["table"] == state.table.tolist()
    monkeypatch.setattr(PolicyUpdater, "update", update)
    trainer_mod.train(_cfg(tmp_path, 6, LOWER, schedule=schedule), resume=True)

    want, got = _metrics(reference), _metrics(tmp_path)
    assert got == want
    # lowered one rung (geometric, x1.25) at steps 2 and 5 in the measured bins
    assert [t[1:] for t in _tables(want)] == [[4, 6], [4, 6], [3, 4], [3, 4], [3, 4], [2, 3]]
    final = [Checkpointer(d / "checkpoints").read_record(6)["closed_loop"]
             for d in (reference, tmp_path)]
    assert final[0] == final[1]
    np.testing.assert_array_equal(final[0]["table"], _tables(want)[-1])
