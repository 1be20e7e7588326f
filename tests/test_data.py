"""Prompt sources: the needle task's layout (parsed back independently), the partial-credit
verifier by hand, the resumable iterator, file loading through datasets, mean@k."""

import json

import numpy as np
import pytest

from sparrow_jax.config import ConfigError
from sparrow_jax.data import (BOS, EOS, MARK, QUERY, VALUE_START, DataConfig, NeedleConfig,
                              NeedleTask, PromptIterator, PromptSet, ReverseTask,
                              build_prompt_sets, evaluate_mean_at_k, positional_credit)


def _parse_needles(prompt, cfg):
    """Independent reading of a prompt: the value after each MARK, in order."""
    return [prompt[i + 1] for i in range(len(prompt) - 1) if prompt[i] == MARK]


def test_needle_layout_and_answers():
    cfg = NeedleConfig()
    prompts, answers = NeedleTask(cfg).sample(np.random.default_rng(0), 200)
    lengths = [len(p) for p in prompts]
    assert min(lengths) >= 192 and max(lengths) <= 256 and len(set(lengths)) > 20
    values = range(VALUE_START, VALUE_START + cfg.num_values)
    for p, a in zip(prompts, answers):
        assert p[0] == BOS and p[-1] == QUERY and max(p) < cfg.vocab_size
        assert p.count(MARK) == cfg.num_needles and BOS not in p[1:] and EOS not in p
        needles = _parse_needles(p, cfg)
        assert needles == a[:-1] and a[-1] == EOS
        # values appear only right after a marker; everything else is filler
        for i, t in enumerate(p[1:-1], start=1):
            if t in values:
                assert p[i - 1] == MARK
            elif t != MARK:
                assert t >= cfg.filler_start
    # values are spread over the whole range
    assert set(v for a in answers for v in a[:-1]) == set(values)


def test_needle_is_deterministic_per_seed():
    task = NeedleTask()
    a = task.sample(np.random.default_rng(7), 5)
    b = task.sample(np.random.default_rng(7), 5)
    c = task.sample(np.random.default_rng(8), 5)
    assert a == b and a != c


def test_context_free_ceiling_is_chance():
    task = NeedleTask(NeedleConfig(num_values=8))
    _, answers = task.sample(np.random.default_rng(1), 4000)
    # the best context-free guess is any fixed value: its mean reward estimates the ceiling
    guess = [VALUE_START + 3] * 3 + [EOS]
    mean = np.mean([task.reward(guess, a) for a in answers])
    assert task.context_free_ceiling() == 1 / 8
    assert abs(mean - 1 / 8) < 4 * np.sqrt((1 / 8) * (7 / 8) / (3 * 4000))


@pytest.mark.parametrize("response,expected", [
    ([5, 6, 7, EOS], 1.0), ([5, 9, 7, EOS], 2 / 3), ([5, EOS, 6, 7], 1 / 3),
    ([6, 5, 7], 1 / 3), ([], 0.0), ([5, 6, 7, 8, 9], 1.0), ([EOS], 0.0)])
def test_positional_credit_hand_worked(response, expected):
    assert positional_credit(response, [5, 6, 7, EOS]) == pytest.approx(expected)


def test_reverse_task():
    prompts, answers = ReverseTask().sample(np.random.default_rng(0), 20)
    for p, a in zip(prompts, answers):
        assert a == p[1:-1][::-1] + [EOS]


def test_iterator_is_resumable_and_covers_each_epoch():
    it = PromptIterator(10, 3, seed=4)
    first = [it.next_indices().tolist() for _ in range(3)]   # one epoch: 9 of 10 items
    flat = sum(first, [])
    assert len(set(flat)) == 9
    state = it.state_dict()
    after = [it.next_indices().tolist() for _ in range(5)]
    it2 = PromptIterator(10, 3, seed=4)
    it2.load_state_dict(state)
    assert [it2.next_indices().tolist() for _ in range(5)] == after
    assert state == {"epoch": 0, "position": 9, "seed": 4}
    with pytest.raises(ValueError, match="seed"):
        PromptIterator(10, 3, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        PromptIterator(2, 3)


class _CharTokenizer:
    """Characters as ids; the "chat template" wraps the user turn in markers."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        body = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "")


def test_file_sources_jsonl_parquet_and_saved_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"q": f"what is {i}+1", "a": str(i + 1)} for i in range(6)]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    tok = _CharTokenizer()
    for path in (jsonl, tmp_path / "p.parquet", tmp_path / "saved"):
        cfg = DataConfig(task=None, path=str(path), prompt_column="q", answer_column="a",
                         num_eval=2, system_prompt="be brief")
        train, held = build_prompt_sets(cfg, tok)
        assert len(train.prompts) == 4 and held.answers == ["5", "6"]
        assert tok.decode(train.prompts[0]) == "<system>be brief<user>what is 0+1<assistant>"
    cfg = DataConfig(task=None, path=str(jsonl), prompt_column="q", answer_column="a",
                     chat_template=False, num_eval=1)
    assert tok.decode(build_prompt_sets(cfg, tok)[0].prompts[2]) == "what is 2+1"
    with pytest.raises(ConfigError, match="no column 'question'"):
        build_prompt_sets(DataConfig(task=None, path=str(jsonl), prompt_column="question",
                                     num_eval=1), tok)
    with pytest.raises(ConfigError, match="unsupported prompt file type"):
        (tmp_path / "p.csv").write_text("q,a\n")
        build_prompt_sets(DataConfig(task=None, path=str(tmp_path / "p.csv")), tok)


def test_mean_at_k_hand_worked():
    # prompt i's j-th sample answers correctly iff j < i: rewards [[0,0],[1,0],[1,1]]
    ps = PromptSet([[0], [1], [2]], [None] * 3)

    def sample_fn(prompts, k):
        return [[int(j < p[0])] for p in prompts for j in range(k)]

    res = evaluate_mean_at_k(sample_fn, ps, lambda p, r, a: float(r[0]), 2, batch_size=2)
    assert res == {"mean_at_k": pytest.approx(3 / 6), "best_at_k": pytest.approx(2 / 3)}


def test_bad_data_config_is_named():
    with pytest.raises(ConfigError, match="data.task"):
        DataConfig(task="sudoku")
    with pytest.raises(ConfigError, match="filler"):
        NeedleConfig(vocab_size=20)
