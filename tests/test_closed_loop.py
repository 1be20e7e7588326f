"""The closed-loop controller (sparrow_jax/rl/closed_loop.py, docs/design.md, section 9) on
synthetic statistics: hand-worked steps, and random sequences against a plain-Python reference
of the rule written here, bin by bin, with the invariants (bounds, non-decreasing table) checked
every step.
"""

import dataclasses
import math
import re

import numpy as np
import pytest
import yaml

from sparrow_jax.config import ConfigError, from_dict
from sparrow_jax.rl import closed_loop as cl
from sparrow_jax.rl.config import ClosedLoopConfig, TrainConfig, load_train_config

CFG = ClosedLoopConfig(enabled=True, target=0.86, margin=0.03, patience=3, min_count=10)
ENOUGH = np.full(3, 50)


def _run(state, tails, cfg=CFG, tokens=ENOUGH):
    for tail in tails:
        state = cl.advance(state, np.asarray(tail, float), tokens, cfg)
    return state


def test_a_low_bin_rises_one_rung_at_once_and_later_bins_follow():
    s = cl.init_state([2, 4, 8], CFG)
    np.testing.assert_array_equal(s.lower, [1, 2, 4])
    np.testing.assert_array_equal(s.upper, [4, 8, 16])
    # bin 0 below target: 2 -> max(3, ceil(1.25 * 2)) = 3 at once; bins 1, 2 in between
    s1 = cl.advance(s, [0.80, 0.87, 0.88], ENOUGH, CFG)
    np.testing.assert_array_equal(s1.table, [3, 4, 8])
    np.testing.assert_array_equal(s1.streak, [0, 0, 0])
    # bin 1 low: 4 -> 5; bin 0 still low: 3 -> 4 (its bound); bin 2 low too: 8 -> 10
    s2 = cl.advance(s1, [0.5, 0.5, 0.5], ENOUGH, CFG)
    np.testing.assert_array_equal(s2.table, [4, 5, 10])
    s3 = cl.advance(s2, [0.5, 0.95, 0.95], ENOUGH, CFG)
    np.testing.assert_array_equal(s3.table, [4, 5, 10])   # bin 0 at its upper bound, 4
    # a raise of bin 0 past bin 1 lifts bin 1 with it (the running maximum)
    s = cl.init_state([4, 4, 8], dataclasses.replace(CFG, upper=3.0))
    np.testing.assert_array_equal(cl.advance(s, [0.5, 0.95, 0.95], ENOUGH, CFG).table, [5, 5, 8])


def test_a_bin_lowers_only_after_patience_comfortable_steps_in_a_row():
    s = cl.init_state([4, 8, 8], CFG)
    good = [0.95, 0.95, 0.80]     # bins 0, 1 comfortable (>= 0.89); bin 2 low
    s = _run(s, [good, good])
    np.testing.assert_array_equal(s.table[:2], [4, 8])
    np.testing.assert_array_equal(s.streak[:2], [2, 2])
    s = _run(s, [good])           # the third comfortable step: 4 -> min(3, floor(4/1.25)) = 3
    # bin 1: 8 -> floor(8 / 1.25) = 6; bin 2 rose each step: 8 -> 10 -> 13 -> 17, capped at 16
    np.testing.assert_array_equal(s.table, [3, 6, 16])
    np.testing.assert_array_equal(s.streak, [0, 0, 0])
    # a step in (target, target + margin) breaks the streak: neither comfortable nor low
    s = _run(s, [good, good, [0.87, 0.95, 0.95], good, good])
    np.testing.assert_array_equal(s.table[0], 3)
    assert s.streak[0] == 2
    # a step with too few tokens leaves the bin alone and starts its streak again
    s = cl.advance(s, [0.10, 0.95, 0.95], np.array([9, 50, 50]), CFG)
    assert s.table[0] == 3 and s.streak[0] == 0


def test_ladder_rungs_and_bounds():
    cfg = dataclasses.replace(CFG, ladder=(1, 2, 4, 8, 16), upper=4.0, lower=0.5)
    s = cl.init_state([2, 3, 8], cfg)       # 3 is between rungs
    s = cl.advance(s, [0.5, 0.5, 0.5], ENOUGH, cfg)
    np.testing.assert_array_equal(s.table, [4, 4, 16])
    s = _run(s, [[0.99] * 3] * 3, cfg)
    np.testing.assert_array_equal(s.table, [2, 2, 8])
    s = _run(s, [[0.99] * 3] * 9, cfg)      # lower bounds floor(0.5 * [2, 3, 8]) = [1, 1, 4]
    np.testing.assert_array_equal(s.table, [1, 1, 4])
    np.testing.assert_array_equal(cl.rung_up(np.array([0, 16, 20]), cfg), [1, 16, 20])
    np.testing.assert_array_equal(cl.rung_down(np.array([0, 1, 5]), cfg), [0, 1, 4])  # 1: lowest
    capped = cl.init_state([2, 3, 8], dataclasses.replace(cfg, max_pages=10))
    np.testing.assert_array_equal(capped.upper, [8, 10, 10])
    with pytest.raises(ValueError, match="above closed_loop.max_pages=5"):
        cl.init_state([2, 3, 8], dataclasses.replace(cfg, max_pages=5))
    with pytest.raises(ValueError, match="non-decreasing"):
        cl.init_state([4, 2], cfg)
    # a bin of 0 pages may still rise (its upper bound is at least 1)
    np.testing.assert_array_equal(cl.init_state([0, 2], CFG).upper, [1, 4])


def test_a_bin_no_response_reaches_does_not_floor_later_bins():
    s = cl.init_state([4, 10, 12], CFG)
    quiet = np.array([0, 0, 50])    # long prompts: responses start in bin 2
    s = _run(s, [[np.nan, np.nan, 0.95]] * 3, tokens=quiet)
    # bin 2: 12 -> floor(12 / 1.25) = 9; bin 1, never reached, comes down with it (the running
    # maximum would have kept bin 2 at 10); bin 0 is below already
    np.testing.assert_array_equal(s.table, [4, 9, 9])
    np.testing.assert_array_equal(s.held, [0, 0, 1])
    s = _run(s, [[np.nan, np.nan, 0.95]] * 3, tokens=quiet)
    np.testing.assert_array_equal(s.table, [4, 7, 7])     # 9 -> 7; bin 1's lower bound is 5
    # once bin 1 holds tokens it is a bin like the others: low, one rung up, bin 2 lifted
    s = cl.advance(s, [np.nan, 0.5, 0.95], np.array([0, 50, 50]), CFG)
    np.testing.assert_array_equal(s.table, [4, 9, 9])
    np.testing.assert_array_equal(s.held, [0, 1, 1])
    # held stays held: bin 1 without tokens now floors bin 2 as any bin does
    s = _run(s, [[np.nan, np.nan, 0.95]] * 3, tokens=quiet)
    np.testing.assert_array_equal(s.table, [4, 9, 9])
    # a checkpoint record written before `held` existed: every bin counts as held
    record = {k: v for k, v in s.to_dict().items() if k != "held"}
    assert cl.ControllerState.from_dict(record).held.tolist() == [1, 1, 1]
    assert np.array_equal(np.stack(cl.ControllerState.from_dict(s.to_dict())), np.stack(s))


def _reference(table, tails, tokens, cfg):
    """The rule as docs/design.md, section 9 states it, one bin at a time in plain Python."""
    t0 = list(table)
    lo = [math.floor(cfg.lower * x) for x in t0]
    hi = [max(math.ceil(cfg.upper * x), 1) for x in t0]
    if cfg.max_pages is not None:
        hi = [min(h, cfg.max_pages) for h in hi]
    rungs = sorted(cfg.ladder)

    def up(b):
        if rungs:
            return next((r for r in rungs if r > b), b)
        return max(b + 1, math.ceil(cfg.growth * b))

    def down(b):
        if rungs:
            return next((r for r in reversed(rungs) if r < b), b)
        return max(0, min(b - 1, math.floor(b / cfg.growth)))

    table, streak, held, out = list(t0), [0] * len(t0), [False] * len(t0), []
    for tail, count in zip(tails, tokens):
        new, lowered = [], []
        for i, b in enumerate(table):
            ok = count[i] >= cfg.min_count
            if ok and tail[i] < cfg.target:
                streak[i] = 0
                new.append(up(b))
                lowered.append(False)
            elif ok and tail[i] >= cfg.target + cfg.margin:
                streak[i] += 1
                go = streak[i] >= cfg.patience
                new.append(down(b) if go else b)
                lowered.append(go)
            else:
                streak[i] = 0
                new.append(b)
                lowered.append(False)
        new = [min(max(b, lo[i]), hi[i]) for i, b in enumerate(new)]
        held = [h or c > 0 for h, c in zip(held, count)]
        for i in range(len(new)):
            later = [new[j] for j in range(i + 1, len(new)) if held[j]]
            if not held[i] and later:
                new[i] = min(new[i], min(later))
        best = -1
        for i in range(len(new)):
            best = max(best, new[i])
            if best != table[i] or lowered[i]:
                streak[i] = 0
            new[i] = best
        table = new
        out.append((list(table), list(streak)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_random_statistics_follow_the_reference_within_bounds(seed):
    rng = np.random.default_rng(seed)
    bins = int(rng.integers(1, 7))
    table = np.sort(rng.integers(0, 20, bins))
    cfg = dataclasses.replace(
        CFG, patience=int(rng.integers(1, 5)), margin=float(rng.choice([0.0, 0.03, 0.1])),
        ladder=tuple(int(x) for x in np.unique(rng.integers(0, 60, 8))) if seed % 2 else (),
        lower=float(rng.choice([0.0, 0.5, 1.0])), upper=float(rng.choice([1.0, 2.0, 3.5])),
        max_pages=None if seed % 3 else int(table.max() + rng.integers(0, 10)))
    steps = 60
    # tails near the target (to hit every branch), some exactly at target and target + margin
    tails = rng.choice([cfg.target, cfg.target + cfg.margin, 0.5, 0.99], (steps, bins))
    tails = np.where(rng.random((steps, bins)) < 0.5, rng.uniform(0.75, 1.0, (steps, bins)),
                     tails)
    tokens = rng.choice([0, cfg.min_count - 1, cfg.min_count, 500], (steps, bins))
    tokens[:, :int(rng.integers(0, bins))] = 0     # bins the responses never reach
    state = cl.init_state(table, cfg)
    changed = 0
    for (want_table, want_streak), tail, count in zip(_reference(table, tails, tokens, cfg),
                                                      tails, tokens):
        new = cl.advance(state, tail, count, cfg)
        assert new.table.tolist() == want_table and new.streak.tolist() == want_streak
        assert np.all(np.diff(new.table) >= 0)
        assert np.all(new.table >= state.lower) and np.all(new.table <= state.upper)
        changed += len(cl.changes(state, new, tail, count))
        state = new
    assert changed > 0


def test_bin_tail_matches_numpy_percentiles():
    rng = np.random.default_rng(1)
    alpha = rng.uniform(0.5, 1.0, (6, 40))
    positions = rng.integers(0, 300, (6, 40))
    mask = rng.random((6, 40)) < 0.8
    mask[:, :3] = True
    positions[0, :3] = 299                       # the last bin is open-ended
    tail, tokens = cl.bin_tail(alpha, positions, mask, bin_tokens=64, num_bins=4, quantile=0.05)
    bins = np.minimum(positions // 64, 3)
    for i in range(4):
        sel = alpha[mask & (bins == i)]
        assert tokens[i] == sel.size
        np.testing.assert_allclose(tail[i], np.percentile(sel, 5), rtol=1e-6)
    tail, tokens = cl.bin_tail(alpha, positions, mask, bin_tokens=64, num_bins=6, quantile=0.05)
    assert tokens[5] == 0 and np.isnan(tail[5])


def test_metrics_name_each_change():
    s = cl.init_state([2, 4], CFG)
    tail, tokens = np.array([0.5, 0.9]), np.array([40, 0])
    after = cl.advance(s, tail, tokens, CFG)
    m = cl.loop_metrics(s, after, tail, tokens)
    assert m == {"closed_loop_p5_bin00": 0.5, "closed_loop_tokens_bin00": 40.0,
                 "schedule_pages_bin00": 3.0, "schedule_pages_bin01": 4.0,
                 "schedule_changes": 1.0, "schedule_old_bin00": 2.0, "schedule_new_bin00": 3.0}
    assert cl.changes(s, after, tail, tokens) == [
        {"bin": 0, "old": 2, "new": 3, "tail": 0.5, "tokens": 40}]
    assert cl.ControllerState.from_dict(after.to_dict()).to_dict() == after.to_dict()


def _train_dict(tmp_path, **over):
    return {"run_dir": str(tmp_path), "schedule": {"kind": "table", "table": [1, 2],
                                                   "bin_tokens": 64},
            "closed_loop": {"enabled": True, **over}}


@pytest.mark.parametrize("over, message", [
    ({"target": 1.2}, "closed_loop.target must be in (0, 1), got 1.2"),
    ({"estimator": "exact"}, "closed_loop.estimator must be one of"),
    ({"ladder": [4, -1]}, "closed_loop.ladder must hold ints >= 0"),
    ({"lower": 1.5}, "closed_loop.lower and closed_loop.upper"),
    ({"growth": 1.0}, "closed_loop.growth must be > 1, got 1.0"),
    ({"margin": -0.1}, "closed_loop.margin must be >= 0"),
    ({"patience": 0}, "patience must be a positive int, got 0"),
])
def test_bad_closed_loop_settings_name_the_key(tmp_path, over, message):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_train_dict(tmp_path, **over)))
    with pytest.raises(ConfigError, match="run.yaml.*" + re.escape(message)):
        load_train_config(path)


def test_closed_loop_needs_a_table_schedule(tmp_path):
    assert not TrainConfig().closed_loop.enabled          # off by default
    cfg = from_dict(TrainConfig, _train_dict(tmp_path, ladder=[1, 2, 4]))
    assert cfg.closed_loop.ladder == (1, 2, 4)
    for schedule in (None, {"kind": "fixed", "pages": 5}):
        with pytest.raises(ConfigError, match="closed_loop.enabled needs a `table` schedule"):
            from_dict(TrainConfig, {**_train_dict(tmp_path), "schedule": schedule})
