"""Budget schedules, the cost model and the schedule search against hand computations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.config import CONFIG_DIR, ConfigError
from sparrow_jax.cost_model import DecodeCost
from sparrow_jax.schedule import (BudgetSchedule, rollout_cost_dense, rollout_cost_sparse,
                                  search_schedule)


@pytest.mark.parametrize("name,length,pages", [
    ("qwen3-1.7b", 18_000, 253 + 3),   # bin 9
    ("qwen3-1.7b", 0, 29 + 3),
    ("qwen3-1.7b", 1_999, 29 + 3),
    ("qwen3-1.7b", 2_000, 61 + 3),
    ("qwen3-1.7b", 1_000_000, 253 + 3),  # the last bin is open-ended
    ("qwen3-4b", 28_000, 381 + 3),     # bin 14
    ("qwen3-8b", 35_999, 381 + 3),     # bin 17, read as 381 (the reference code's 385)
    ("qwen3-8b", 36_000, 445 + 3),
    ("qwen3-14b", 9_000, 253 + 3),     # bin 4
    ("qwen3-14b", 27_999, 381 + 3),    # bin 13: the ninth 381
    ("qwen3-14b", 28_000, 509 + 3),
    ("qwen3-14b", 39_000, 893 + 3),
])
def test_paper_tables(name, length, pages):
    assert int(BudgetSchedule.paper(name).budget_pages(length)) == pages


def test_paper_tables_shape():
    for name, bins in [("qwen3-1.7b", 20), ("qwen3-4b", 20), ("qwen3-8b", 20), ("qwen3-14b", 19)]:
        table = BudgetSchedule.paper(name).table
        assert len(table) == bins
        assert all((v + 3) % 16 == 0 for v in table)  # budgets are whole multiples of 16 pages
        assert list(table) == sorted(table)


def test_vectorised_and_jittable():
    s = BudgetSchedule.paper("qwen3-4b")
    lengths = jnp.asarray([[1, 2_000, 4_001], [39_999, 40_000, 12_345]], jnp.int32)
    want = np.array([[29, 45, 61], [509, 509, 157]]) + 3
    np.testing.assert_array_equal(np.asarray(s.budget_pages(lengths)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(s.budget_pages)(lengths)), want)


def test_fixed_fraction_and_custom_table():
    np.testing.assert_array_equal(np.asarray(BudgetSchedule.fixed(40).budget_pages([5, 90_000])),
                                  [40, 40])
    frac = BudgetSchedule.from_fraction(0.25, floor=8, page_size=16)
    # 16 pages -> 4 -> floor 8; 100 pages -> 25; 101 pages (1601 tokens) -> ceil(25.25) = 26
    np.testing.assert_array_equal(np.asarray(frac.budget_pages([256, 1600, 1601])), [8, 25, 26])
    table = BudgetSchedule.from_table([5, 9], bin_tokens=100)
    np.testing.assert_array_equal(np.asarray(table.budget_pages([99, 100, 5000])), [8, 12, 12])
    # every field keeps its declared default (a constructor named like a field once replaced
    # the field's default with the constructor itself)
    assert (table.fraction, table.pages, frac.table) == (0.0, 0, ())


@pytest.mark.parametrize("schedule", [BudgetSchedule.paper("qwen3-14b"), BudgetSchedule.fixed(7),
                                      BudgetSchedule.from_fraction(0.1, 5),
                                      BudgetSchedule.from_table([1, 2, 3], 500)])
def test_yaml_round_trip(schedule):
    assert BudgetSchedule.from_yaml(schedule.to_yaml()) == schedule


def test_config_files_hold_the_paper_tables():
    for name in ("qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b"):
        assert BudgetSchedule.from_yaml(name) == BudgetSchedule.paper(name)
        path = CONFIG_DIR / "schedules" / f"{name}.yaml"
        assert BudgetSchedule.from_yaml(path) == BudgetSchedule.paper(name)


def test_from_spec_reads_each_spelling(tmp_path):
    assert BudgetSchedule.from_spec("8") == BudgetSchedule.fixed(8)
    assert BudgetSchedule.from_spec("qwen3-4b") == BudgetSchedule.paper("qwen3-4b")
    custom = BudgetSchedule.from_table([5, 9], bin_tokens=64, page_size=8)
    path = tmp_path / "mine.yaml"
    path.write_text(custom.to_yaml())
    assert BudgetSchedule.from_spec(str(path), page_size=8) == custom
    with pytest.raises(ValueError, match="pages of 8 tokens, not 16"):
        BudgetSchedule.from_spec(str(path))
    with pytest.raises(ValueError, match="neither a page count"):
        BudgetSchedule.from_spec("qwen3-70b")


def test_bad_schedules_are_named():
    with pytest.raises(ValueError, match="no paper schedule"):
        BudgetSchedule.paper("qwen3-70b")
    with pytest.raises(ValueError, match=">= 3 pages"):
        BudgetSchedule.fixed(2)
    with pytest.raises(ValueError, match="fraction must be"):
        BudgetSchedule.from_fraction(1.5)
    with pytest.raises(ValueError, match="non-empty"):
        BudgetSchedule.from_table([])
    with pytest.raises(ConfigError, match="unknown key"):
        BudgetSchedule.from_yaml("kind: table\ntable: [1]\nbins: 3\n")
    with pytest.raises(ValueError, match="integer"):
        BudgetSchedule.fixed(8).budget_pages(jnp.asarray([1.5]))


def test_closed_forms_hand_computed():
    # P=10 N=2 L_in=3 L_out=4 D=5 r=2 I=7:
    # comp = 2*10*2*4 + 2*(6+4)*4*2*5 = 160 + 800; mem = 2*3*4*5 + 2*16*5 = 120 + 160
    assert rollout_cost_dense(10, 2, 3, 4, 5, 2, 7) == 960 + 7 * 280
    # no_score = 160 + 2*2*2*5*6*4 + 2*7*2*5*6*4 = 160 + 960 + 3360
    # scoring  = 2*2*3*5*4 + 2*2*5*16/4 + 2*7*3*5*4 + 7*2*5*16/4 = 240 + 80 + 840 + 280
    assert rollout_cost_sparse(10, 2, 3, 4, 5, 2, 7, 6, page_size=2) == 4480 + 1440


def _tiny_cost(**kw):
    args = dict(params=100, num_layers=3, kv_elements_per_layer=4, gqa_ratio=2, intensity=10,
                num_dense_layers=1, page_size=4)
    args.update(kw)
    return DecodeCost(**args)


def test_step_cost_hand_computed():
    cost = _tiny_cost()
    # weights: 2*100*2 + 10*100 = 1400.
    # length 10: 3 pages <= 3, dense in all 3 layers: 3 * (2*2*4 + 10*2*4) * 10 = 2880.
    # length 30: 8 pages > 3. Dense layer: 96*30 = 2880. Each of 2 sparse layers: 12 tokens
    # (96*12 = 1152) + 5 candidate pages scored ((2*4 + 10*4) * 5 = 240): 2 * 1392 = 2784.
    assert cost.step_cost([10, 30], [3, 3]) == pytest.approx(1400 + 2880 + 2880 + 2784)
    # Quest reads two summary vectors per page: + 2 layers * 5 pages * 10 * 4.
    quest = _tiny_cost(summary_vectors=2)
    assert quest.step_cost([10, 30], [3, 3]) == pytest.approx(9944 + 400)
    assert cost.step_cost([30]) == pytest.approx(200 + 1000 + 3 * 96 * 30)  # dense


def test_rollout_cost_hand_computed_and_against_closed_form():
    cost = _tiny_cost()
    # Lengths 3, 4, 5 with 4-token pages: at most 2 pages, under a 3-page budget, so all dense.
    assert cost.rollout_cost(2, 3, 1, BudgetSchedule.fixed(3)) == pytest.approx(
        3 * 1200 + 3 * 96 * (3 + 4 + 5))
    # Without weight reads or dense layers, one sequence's dense rollout is the closed form plus
    # the current token it counts (lengths L_in + t + 1): (r + I) D L_out more.
    plain = _tiny_cost(num_dense_layers=0, count_weights=False)
    d_all = 3 * 4
    for l_in, l_out in [(5, 7), (100, 300)]:
        want = rollout_cost_dense(100, 1, l_in, l_out, d_all, 2, 10) + (2 + 10) * d_all * l_out
        assert plain.rollout_cost(l_in, l_out) == pytest.approx(want)


def test_schedule_saves_cost_at_long_lengths():
    from sparrow_jax.config import ModelConfig
    cost = DecodeCost.from_model_config(ModelConfig.preset("qwen3-1.7b"), intensity=300.0)
    dense = cost.rollout_cost(1000, 31_000, 8)
    sparse = cost.rollout_cost(1000, 31_000, 8, BudgetSchedule.paper("qwen3-1.7b"))
    assert 1.5 < dense / sparse < 20


def test_search_hand_computed():
    nan = np.nan
    alpha = [[0.90, 0.95, 0.97],   # 29 meets the target
             [0.80, 0.87, 0.90],   # 61
             [nan, nan, nan],      # thin: carry 61
             [0.70, 0.80, 0.85],   # none meets it: the largest, 93
             [0.88, 0.90, 0.90]]   # 29, lifted to 93 by the cumulative max
    got = search_schedule(alpha, [29, 61, 93], target=0.86, bin_tokens=1000)
    assert got.table == (29, 61, 61, 93, 93) and got.bin_tokens == 1000
    # Budgets given in any order; leading thin bins take the first measured bin's choice.
    got = search_schedule([[nan, nan], [0.9, 0.5]], [61, 29], target=0.86)
    assert got.table == (61, 61)
