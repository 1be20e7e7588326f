"""The rollout engine's page-table width buckets (``RolloutConfig.table_bucket_pages``): each
decode call sees only the table columns its rows can reach, and the rollout is the one the
full table gives."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import TINY_ENGINE, random_prompts
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rollout import engine
from sparrow_jax.rollout.decode_loop import table_width
from sparrow_jax.rollout.engine import RolloutConfig, generate
from sparrow_jax.schedule import BudgetSchedule

P = 4
CFG = TINY_ENGINE


def test_table_width():
    assert table_width(10, 4, 100, None) == 100
    assert table_width(10, 4, 100, 1) == 4          # 3 pages -> 4
    assert table_width(10, 4, 100, 8) == 8          # at least the bucket
    assert table_width(300, 4, 100, 8) == 100       # capped at the full width
    assert table_width(16, 4, 100, 1) == 4


@pytest.mark.parametrize("sparse", [False, True])
def test_buckets_give_the_full_table_rollout(sparse, monkeypatch):
    model = init_model(CFG, seed=0)
    prompts = random_prompts((5, 8, 21))
    schedule = BudgetSchedule.fixed(4, page_size=P) if sparse else None
    widths = []
    run_chunk = engine.run_chunk

    def spy(graphdef, params, state, budget_values, num_steps, *, settings):
        widths.append((state.cache.page_table.shape[1], settings.max_budget_pages))
        return run_chunk(graphdef, params, state, budget_values, num_steps, settings=settings)

    monkeypatch.setattr(engine, "run_chunk", spy)
    out = {}
    for bucket in (None, 1):
        widths.clear()
        cfg = RolloutConfig(n=2, max_new_tokens=30, temperature=0.0, page_size=P,
                            prompt_multiple=16, steps_per_call=4, dense_layers=(0,),
                            page_seed=3, table_bucket_pages=bucket)
        out[bucket] = generate(model, prompts, cfg, jax.random.key(0), schedule=schedule)
        seen = list(widths)
        if bucket is None:
            assert {w for w, _ in seen} == {-(-(32 + 30) // P)}
        else:
            # Widths grow with the calls, powers of two until the full width.
            ws = [w for w, _ in seen]
            assert ws == sorted(ws) and ws[0] == 8 and ws[-1] == 16 and len(set(ws)) == 2
            if sparse:
                assert all(m == min(4, w) for w, m in seen)
    full, bucketed = out[None], out[1]
    np.testing.assert_array_equal(np.asarray(bucketed.tokens), np.asarray(full.tokens))
    np.testing.assert_array_equal(np.asarray(bucketed.budget_pages),
                                  np.asarray(full.budget_pages))
    np.testing.assert_allclose(np.asarray(bucketed.logprobs), np.asarray(full.logprobs),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(bucketed.topk_logprobs),
                               np.asarray(full.topk_logprobs), rtol=1e-5, atol=1e-5)
