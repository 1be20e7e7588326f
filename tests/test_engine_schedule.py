"""The schedule as a runtime array of the decode loop (docs/design.md, section 4): new tables
under one ``schedule_bound`` reuse the decode chunk's compilation and give the rollout a fresh,
self-bounded run of each table gives."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import TINY_ENGINE, random_prompts
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rollout import budget
from sparrow_jax.rollout.decode_loop import run_chunk
from sparrow_jax.rollout.engine import RolloutConfig, generate
from sparrow_jax.schedule import BudgetSchedule

P = 4
CFG = TINY_ENGINE
BIN = 8          # tokens per bin: prompts of 5..21 tokens plus 24 new cross several bins
BINS = 5


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


def _config(**kw):
    base = dict(n=2, max_new_tokens=24, temperature=1.0, page_size=P, prompt_multiple=16,
                steps_per_call=6, dense_layers=(0,), page_seed=3, table_bucket_pages=None)
    return RolloutConfig(**{**base, **kw})


def _tables(count, seed=1):
    """``count`` different non-decreasing tables of BINS bins, entries in [0, 6], the last 6:
    self-bounded, each gathers 9 pages (one compilation for all the fresh runs)."""
    rng = np.random.default_rng(seed)
    out = set()
    while len(out) < count:
        out.add(tuple(np.sort(rng.integers(0, 7, BINS - 1)).tolist()) + (6,))
    return [BudgetSchedule.from_table(t, BIN, page_size=P) for t in sorted(out)]


def test_split_schedule_budgets_equal_the_schedule():
    lengths = np.arange(1, 200)
    for schedule in (BudgetSchedule.from_table((0, 2, 2, 9), 10, page_size=P),
                     BudgetSchedule.fixed(7, page_size=P),
                     BudgetSchedule.from_fraction(0.3, floor=4, page_size=P)):
        shape, values = budget.split_schedule(schedule)
        got = np.asarray(budget.budget_pages(shape, values, lengths))
        np.testing.assert_array_equal(got, np.asarray(schedule.budget_pages(lengths)))
    # Hand-worked: 10-token bins, reserved 3 on top.
    shape, values = budget.split_schedule(BudgetSchedule.from_table((0, 2, 9), 10, page_size=P))
    assert values.tolist() == [3, 5, 12]
    assert np.asarray(budget.budget_pages(shape, values, np.array([9, 10, 29, 500]))).tolist() \
        == [3, 5, 12, 12]
    # Tables of one shape share it; a fraction's name does not split it.
    assert (budget.split_schedule(BudgetSchedule.from_table((1, 4), 10))[0]
            == budget.split_schedule(BudgetSchedule.from_table((2, 3), 10))[0])
    assert (budget.split_schedule(BudgetSchedule.from_fraction(0.5, name="a"))[0]
            == budget.split_schedule(BudgetSchedule.from_fraction(0.5, name="b"))[0])


def test_gather_width_follows_the_bound():
    bound = BudgetSchedule.from_table((1, 5, 20), 8, page_size=P)
    assert budget.gather_width(bound, 2) == 2       # 8 tokens: bin 0 and 1 -> 8 pages, cap 2
    assert budget.gather_width(bound, 3) == 3
    assert budget.gather_width(bound, 4) == 4       # 16 tokens reach bin 2 (23), cap 4
    assert budget.gather_width(bound, 100) == 23
    assert budget.gather_width(BudgetSchedule.fixed(9, page_size=P), 100) == 9


def test_ten_tables_one_compilation_same_tokens(model):
    tables = _tables(10)
    # Gathers 11 pages where each table alone gathers 9: the fresh runs below are another
    # program (the static path, the gather width from the table itself).
    bound = BudgetSchedule.fixed(3 + 8, page_size=P)
    prompts = random_prompts((5, 13, 21))
    config = _config()
    key = jax.random.key(0)
    before = run_chunk._cache_size()
    runs = [generate(model, prompts, config, key, schedule=t, schedule_bound=bound)
            for t in tables]
    assert run_chunk._cache_size() == before + 1
    budgets = set()
    for table, got in zip(tables, runs):
        fresh = generate(model, prompts, config, key, schedule=table)   # self-bounded, static
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(fresh.tokens))
        np.testing.assert_array_equal(np.asarray(got.response_lengths),
                                      np.asarray(fresh.response_lengths))
        np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(fresh.logprobs),
                                   rtol=1e-5, atol=1e-5)
        # Each step recorded the table's budget at its length (response token j >= 1 came
        # from position prompt + j - 1, so the sequence then held prompt + j tokens).
        pl, rl = np.asarray(got.prompt_lengths), np.asarray(got.response_lengths)
        recorded = np.asarray(got.budget_pages)
        for row in range(len(pl)):
            j = np.arange(1, rl[row])
            want = np.asarray(table.budget_pages(pl[row] + j))
            np.testing.assert_array_equal(recorded[row, 1:rl[row]], want)
        budgets.add(recorded.tobytes())
    assert len(budgets) == len(tables)      # the tables did reach the loop


def test_schedule_above_its_bound_is_refused(model):
    bound = BudgetSchedule.from_table((2, 4, 4, 6, 6), BIN, page_size=P)
    above = BudgetSchedule.from_table((2, 5, 5, 6, 6), BIN, page_size=P)
    with pytest.raises(ValueError, match="schedule_bound: the schedule gives 8 pages at length "
                                         "8, above the bound's 7"):
        generate(model, random_prompts((5, 13, 21)), _config(), jax.random.key(0), schedule=above,
                 schedule_bound=bound)
    # Past the batch's reach, a table bin above the bound is refused too.
    late = BudgetSchedule.from_table((0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9), BIN, page_size=P)
    with pytest.raises(ValueError, match="at length 80, above the bound's 9"):
        generate(model, random_prompts((5, 13, 21)), _config(), jax.random.key(0), schedule=late,
                 schedule_bound=bound)
    with pytest.raises(ValueError, match="schedule_bound counts pages of 16 tokens"):
        generate(model, random_prompts((5, 13, 21)), _config(), jax.random.key(0), schedule=bound,
                 schedule_bound=BudgetSchedule.fixed(9))
