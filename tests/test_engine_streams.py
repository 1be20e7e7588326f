"""Per-sample random streams: a sampled response depends on (key, prompt id, sample index) only,
not on the batch it was generated in."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_ENGINE, random_prompts
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rollout.engine import RolloutConfig, generate
from sparrow_jax.rollout.sampling import (SamplingParams, sample_from_logprobs, step_keys,
                                          stream_keys)
from sparrow_jax.schedule import BudgetSchedule

P = 4
CFG = TINY_ENGINE
LENGTHS = (5, 8, 21, 3)
R = 10


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


def _config(n):
    # Sparse (budget 3 pages < most rows' page count), temperature 1, shuffled pages.
    # One table width and one prompt width for every call: a compilation per batch size only.
    return RolloutConfig(n=n, max_new_tokens=R, temperature=1.0, page_size=P, prompt_multiple=32,
                         steps_per_call=R, dense_layers=(0,), page_seed=3,
                         table_bucket_pages=None, num_pages=80)


SCHEDULE = BudgetSchedule.fixed(3, page_size=P)


def _samples(ro, prompt_ids):
    """{(prompt id, sample index): (response tokens, log-probs)} of a rollout."""
    tokens, pl, rl = map(np.asarray, (ro.tokens, ro.prompt_lengths, ro.response_lengths))
    lp, index = np.asarray(ro.logprobs), np.asarray(ro.prompt_index)
    out, seen = {}, {}
    for b in range(len(pl)):
        i = int(index[b])
        j = seen.setdefault(i, 0)
        seen[i] += 1
        out[(prompt_ids[i], j)] = (tokens[b, pl[b]:pl[b] + rl[b]].tolist(), lp[b, :rl[b]])
    return out


def _same(got, want, count):
    """The ``count`` samples both hold are equal (tokens; log-probs to float32 rounding)."""
    common = got.keys() & want.keys()
    assert len(common) == count
    for k in common:
        assert got[k][0] == want[k][0], k
        np.testing.assert_allclose(got[k][1], want[k][1], rtol=1e-5, atol=1e-5)


def test_samples_do_not_depend_on_the_batch(model):
    prompts = random_prompts(LENGTHS)
    key = jax.random.key(11)
    ids = list(range(len(prompts)))
    # Every call has 12 rows: one compilation of the decode loop.
    full = _samples(generate(model, prompts, _config(3), key, SCHEDULE), ids)
    # The samples differ from one another (the streams are not shared).
    assert len({tuple(t) for t, _ in full.values()}) == len(full)

    # Alone, with the prompt's id, and more samples: samples 0 .. n-1 are a prefix.
    alone = _samples(generate(model, [prompts[2]], _config(12), key, SCHEDULE, prompt_ids=[2]),
                     [2])
    _same(alone, full, 3)
    # Another order and composition of the prompts, with their ids.
    order = [3, 1, 0]
    _same(_samples(generate(model, [prompts[i] for i in order], _config(4), key, SCHEDULE,
                            prompt_ids=order), order), full, 9)
    # Another key: other tokens.
    other = _samples(generate(model, prompts, _config(3), jax.random.key(12), SCHEDULE), ids)
    assert sum(other[k][0] != full[k][0] for k in full) >= len(full) - 1


def test_row_keys_draw_each_row_from_its_own_stream():
    """[B] keys: row b is exactly the draw of ``categorical(key[b], logp[b])`` (a hand-made
    per-row loop), whatever the other rows hold."""
    logp = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (6, 30)) * 2, -1)
    keys = step_keys(stream_keys(jax.random.key(5), jnp.array([0, 0, 1, 1, 2, 9]),
                                 jnp.array([0, 1, 0, 1, 0, 0])), jnp.array([0, 3, 3, 1, 7, 2]))
    params = SamplingParams(temperature=1.0)
    tokens, lp = sample_from_logprobs(keys, logp, params)
    for b in range(6):
        want = int(jax.random.categorical(keys[b], logp[b]))
        assert int(tokens[b]) == want
        alone, _ = sample_from_logprobs(keys[b:b + 1], logp[b:b + 1], params)
        assert int(alone[0]) == want
    np.testing.assert_allclose(lp, np.asarray(logp)[np.arange(6), np.asarray(tokens)])
    # The stream is fold_in(fold_in(fold_in(key, prompt), sample), position).
    k = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(jax.random.key(5), 2), 0), 7)
    np.testing.assert_array_equal(jax.random.key_data(keys[4]), jax.random.key_data(k))


def test_bad_prompt_ids_are_named(model):
    with pytest.raises(ValueError, match="prompt_ids must be 2 ints"):
        generate(model, random_prompts(LENGTHS)[:2], _config(1), jax.random.key(0), prompt_ids=[0])
    with pytest.raises(ValueError, match="prompt_ids must be 2 ints"):
        generate(model, random_prompts(LENGTHS)[:2], _config(1), jax.random.key(0),
                 prompt_ids=[0, -1])
