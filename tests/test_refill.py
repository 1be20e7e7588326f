"""Continuous refill against the static engine: the same samples, whatever the slot count, the
admission order or preemption; every sample back exactly once; every page free after a run."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from conftest import TINY_ENGINE, random_prompts
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rollout.engine import RolloutConfig, generate
from sparrow_jax.rollout.refill import generate_refill, run_refill
from sparrow_jax.rollout.refill_schedule import RefillScheduler, simulate_refill
from sparrow_jax.rollout.types import FinishReason
from sparrow_jax.schedule import BudgetSchedule

P = 4
CFG = TINY_ENGINE
LENGTHS = (5, 8, 21, 3, 13)
N = 3
R = 12
# One sample of the longest prompt needs ceil((21 + 12) / 4) = 9 pages: a pool of 14 (the null
# page included) runs two such rows at once only in part and must preempt; 200 never does.
SMALL_POOL = 11
BIG_POOL = 200
SCHEDULES = {"dense": None, "sparse": BudgetSchedule.fixed(3, page_size=P)}


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


def _config(temperature, num_pages):
    # EOS ids end most responses early (a mix of lengths); steps_per_call 3 gives many chunks
    # (admission and growth between them); one table width: one compilation per slot count.
    return RolloutConfig(n=N, max_new_tokens=R, temperature=temperature, page_size=P,
                         prompt_multiple=32, steps_per_call=3, dense_layers=(0,), page_seed=3,
                         eos_ids=(7, 11, 19), table_bucket_pages=None, num_pages=num_pages)


_STATIC = {}


def _static(model, temperature, schedule_name):
    """The static engine's rollout (cached per case: the reference of several slot counts)."""
    case = (temperature, schedule_name)
    if case not in _STATIC:
        _STATIC[case] = generate(model, random_prompts(LENGTHS), _config(temperature, BIG_POOL),
                                 jax.random.key(5), SCHEDULES[schedule_name])
    return _STATIC[case]


def _rows(ro):
    """Per row: (prompt index, response tokens, log-probs, budgets, finish reason)."""
    tokens, pl, rl = map(np.asarray, (ro.tokens, ro.prompt_lengths, ro.response_lengths))
    lp, bud, fin = np.asarray(ro.logprobs), np.asarray(ro.budget_pages), np.asarray(
        ro.finish_reason)
    index = np.asarray(ro.prompt_index)
    return [(int(index[b]), tokens[b, pl[b]:pl[b] + rl[b]].tolist(), lp[b, :rl[b]],
             bud[b, :rl[b]], int(fin[b])) for b in range(len(pl))]


def _check_same(got, want):
    assert got.tokens.shape == want.tokens.shape
    np.testing.assert_array_equal(got.prompt_index, want.prompt_index)
    np.testing.assert_array_equal(got.prompt_lengths, want.prompt_lengths)
    for b, (g, w) in enumerate(zip(_rows(got), _rows(want))):
        assert g[0] == w[0] and g[1] == w[1] and g[4] == w[4], b
        np.testing.assert_allclose(g[2], w[2], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(g[3], w[3])


def _run(model, temperature, schedule_name, slots, pool, prefill_rows, **kw):
    ro, stats = run_refill(model, random_prompts(LENGTHS), _config(temperature, pool),
                           jax.random.key(5), SCHEDULES[schedule_name], slots=slots,
                           prefill_rows=prefill_rows, **kw)
    # Every sample came back exactly once (each row written by one harvest), every page freed.
    assert stats.admissions - stats.preemptions == stats.returned == len(LENGTHS) * N
    assert len(np.unique(np.asarray(ro.prompt_index))) == len(LENGTHS)
    assert stats.pages_in_use_after == 0 and stats.sequences_after == 0
    assert stats.peak_pages <= pool - 1
    assert (np.asarray(ro.finish_reason) >= 0).all()
    return ro, stats


def _check_case(model, temperature, schedule_name, slots, pool, prefill_rows=None, **kw):
    want = _static(model, temperature, schedule_name)
    ro, stats = _run(model, temperature, schedule_name, slots, pool, prefill_rows, **kw)
    # The small pool forces preemption; the big one holds every row at full length.
    assert (stats.preemptions > 0) == (pool == SMALL_POOL), stats
    _check_same(ro, want)
    return ro, stats


# Each slot count, each pool and each case at least once; admissions padded to the slot count
# (a compilation per run), or in calls of 4 rows. The full matrix, with power-of-two
# admissions, is slow.
@pytest.mark.parametrize("temperature,schedule_name,slots,pool,prefill_rows", [
    (0.0, "dense", 2, SMALL_POOL, 2), (0.0, "dense", 16, BIG_POOL, 4),
    (1.0, "sparse", 5, SMALL_POOL, 5), (1.0, "sparse", 16, SMALL_POOL, 16)])
def test_refill_equals_static(model, temperature, schedule_name, slots, pool, prefill_rows):
    # The responses vary in length here (refill has something to do).
    lengths = np.asarray(_static(model, temperature, schedule_name).response_lengths)
    assert lengths.min() < R and len(set(lengths.tolist())) >= 2
    ro, stats = _check_case(model, temperature, schedule_name, slots, pool, prefill_rows)
    if prefill_rows < slots:   # the big pool admits all 15 samples at once: in 4 calls of 4
        assert stats.prefills == 4, stats


# Narrowing donates the loop state for its pool; the shrinking per-row buffers must not warn.
@pytest.mark.filterwarnings("error:Some donated buffers were not usable")
@pytest.mark.parametrize("temperature,schedule_name,slots,pool,prefill_rows,tail", [
    (1.0, "sparse", 16, SMALL_POOL, 4, 2), (1.0, "dense", 5, BIG_POOL, None, 1)])
def test_a_narrower_tail_keeps_the_samples(model, temperature, schedule_name, slots, pool,
                                           prefill_rows, tail):
    """The last rows moved onto fewer slots once the queue is empty (with preemption in the
    small pool): the same samples as the static engine, each back once, every page free."""
    chunks = []
    _check_case(model, temperature, schedule_name, slots, pool, prefill_rows, tail_slots=tail,
                on_chunk=chunks.append)
    assert min(c["slots"] for c in chunks) < slots


def test_a_running_row_moved_to_a_lower_slot_keeps_its_stream(model, monkeypatch):
    """No EOS, the per-prompt caps CAPS, 5 slots, ``tail_slots=1``: the tail narrows to 4,
    then 2 slots, a running row in a higher slot moving down (the replay shows it), and the
    moved rows sample their remaining tokens at temperature 1 as the static engine does."""
    config = dataclasses.replace(_config(1.0, BIG_POOL), eos_ids=())
    want = generate(model, random_prompts(LENGTHS), config, jax.random.key(5), max_new_tokens=CAPS)
    chunks = []
    ro, _ = run_refill(model, random_prompts(LENGTHS), config, jax.random.key(5), slots=5,
                       tail_slots=1, max_new_tokens=CAPS, on_chunk=chunks.append)
    _check_same(ro, want)
    assert [c["slots"] for c in chunks][-2:] == [4, 2]
    moves, narrow = [], RefillScheduler.narrow

    def watched(self, floor):
        before = [h is not None for h in self.held]
        src = narrow(self, floor)
        if src is not None:
            moves.append(any(before[s] and s != j for j, s in enumerate(src)))
        return src

    monkeypatch.setattr(RefillScheduler, "narrow", watched)
    sim, _ = simulate_refill(LENGTHS, CAPS, n=N, slots=5, num_pages=BIG_POOL, page_size=P,
                             steps_per_call=3, width=-(-(32 + R) // P), page_seed=3,
                             tail_slots=1)
    assert [c["slots"] for c in sim] == [c["slots"] for c in chunks] and any(moves)


def test_tail_slots_are_checked(model):
    with pytest.raises(ValueError, match="tail_slots must be .* got 3"):
        generate_refill(model, random_prompts(LENGTHS), _config(0.0, BIG_POOL), jax.random.key(0),
                        slots=2, tail_slots=3)


@pytest.mark.slow
@pytest.mark.parametrize("pool", [BIG_POOL, SMALL_POOL])
@pytest.mark.parametrize("slots", [2, 5, 16])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("schedule_name", ["dense", "sparse"])
def test_refill_equals_static_matrix(model, temperature, schedule_name, slots, pool):
    _check_case(model, temperature, schedule_name, slots, pool)


def test_refill_pool_too_small(model):
    with pytest.raises(ValueError, match="cannot hold one sample"):
        generate_refill(model, random_prompts(LENGTHS), _config(0.0, 9), jax.random.key(0), slots=2)


@pytest.mark.slow
def test_refill_one_slot_matches_with_more_samples(model):
    # n = 4 through one slot: each sample prefilled alone; samples 0 .. 2 are those of n = 3.
    config = dataclasses.replace(_config(1.0, SMALL_POOL), n=4)
    ro = generate_refill(model, random_prompts(LENGTHS)[:2], config, jax.random.key(5),
                         SCHEDULES["sparse"], slots=1)
    want = _rows(_static(model, 1.0, "sparse"))
    got = _rows(ro)
    for i in range(2):
        for j in range(N):
            assert got[i * 4 + j][1] == want[i * N + j][1], (i, j)


CAPS = (3, 12, 7, 1, 9)


@pytest.mark.parametrize("temperature,schedule_name", [(0.0, "dense"), (1.0, "sparse")])
def test_per_prompt_caps_static_and_refill(model, temperature, schedule_name):
    """Each prompt's rows stop at its own cap: a capped row is the uncapped row (the static
    engine's, same streams) cut at the cap, finish LENGTH there; refill gives the same."""
    full = _rows(_static(model, temperature, schedule_name))
    config = _config(temperature, BIG_POOL)
    capped = generate(model, random_prompts(LENGTHS), config, jax.random.key(5),
                      SCHEDULES[schedule_name], max_new_tokens=CAPS)
    got = _rows(capped)
    cut = 0
    for b, (g, w) in enumerate(zip(got, full)):
        cap = CAPS[w[0]]
        if len(w[1]) <= cap:       # ended by itself: the very row
            assert g[1] == w[1] and g[4] == w[4], b
        else:
            cut += 1
            assert g[1] == w[1][:cap] and g[4] == int(FinishReason.LENGTH), b
        np.testing.assert_allclose(g[2], w[2][:len(g[1])], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(g[3], w[3][:len(g[1])])
    assert cut >= 3                 # the caps did cut rows
    ro, stats = run_refill(model, random_prompts(LENGTHS), _config(temperature, SMALL_POOL),
                           jax.random.key(5), SCHEDULES[schedule_name], slots=5, prefill_rows=5,
                           max_new_tokens=CAPS)
    _check_same(ro, capped)
    assert stats.pages_in_use_after == 0 and stats.returned == len(LENGTHS) * N


def test_per_prompt_caps_are_checked(model):
    for caps, match in [((3, 12), r"max_new_tokens must be one int or 5 ints"),
                        ((3, 12, 0, 1, 9), r"max_new_tokens\[2\]=0 outside \[1, "
                                           r"config.max_new_tokens=12\]"),
                        (13, r"max_new_tokens\[0\]=13 outside"),
                        ((3.0, 1, 1, 1, 1), "max_new_tokens must be one int")]:
        with pytest.raises(ValueError, match=match):
            generate(model, random_prompts(LENGTHS), _config(0.0, BIG_POOL), jax.random.key(0),
                     max_new_tokens=caps)
        with pytest.raises(ValueError, match=match):
            generate_refill(model, random_prompts(LENGTHS), _config(0.0, BIG_POOL),
                            jax.random.key(0), slots=2, max_new_tokens=caps)
