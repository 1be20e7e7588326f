"""Tokenizer and chat template against transformers' renderings (tests/fixtures/hf/chat_cases.json,
made by scripts/make_hf_fixtures.py with Qwen3's chat template) and hand-worked templates."""

from __future__ import annotations

import json
import shutil

import jinja2
import pytest
from conftest import HF_FIXTURES, hf_case

from sparrow_jax.models.tokenizer import Tokenizer, TokenizerError, load_tokenizer

CASES = json.loads((HF_FIXTURES / "chat_cases.json").read_text())


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(hf_case("chat")["path"])


def _case_id(c):
    return f"{c['name']}-gen{int(c['add_generation_prompt'])}-think{c['enable_thinking']}"


@pytest.mark.parametrize("case", CASES["templates"], ids=_case_id)
def test_chat_template_matches_transformers(tok, case):
    kwargs = dict(messages=case["messages"], tools=case["tools"],
                  add_generation_prompt=case["add_generation_prompt"],
                  enable_thinking=case["enable_thinking"])
    assert tok.apply_chat_template(**kwargs) == case["text"]
    assert tok.apply_chat_template(**kwargs, tokenize=True) == case["ids"]


def test_reference_cases_exercise_thinking_switch():
    """The fixture really distinguishes the modes (else the test above could not fail on them)."""
    by_mode = {c["enable_thinking"]: c["text"] for c in CASES["templates"]
               if c["name"] == "single_user" and c["add_generation_prompt"]}
    assert by_mode[False].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert by_mode[True] == by_mode[None] != by_mode[False]


def test_default_enables_thinking(tok):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(msgs) == \
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("case", CASES["encode"], ids=lambda c: repr(c["text"]))
def test_encode_matches_transformers(tok, case):
    assert tok.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("case", CASES["decode"],
                         ids=lambda c: f"{c['text']!r}-skip{c['skip_special_tokens']}")
def test_decode_matches_transformers(tok, case):
    assert tok.decode(case["ids"], skip_special_tokens=case["skip_special_tokens"]) == case["text"]


def test_special_tokens_and_eos_ids(tok):
    path = hf_case("chat")["path"]
    tok_json = json.loads((path / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok_json["added_tokens"]}
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # <|im_end|> from tokenizer_config.json first, then generation_config.json's other stop id
    assert tok.eos_token_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])
    assert tok.token_to_id("<think>") == ids["<think>"]
    assert tok.vocab_size == len(tok_json["model"]["vocab"]) + len(ids)


def test_jinja_environment_features(tok):
    """Hand-worked: trim/lstrip blocks, loop controls, transformers' tojson (no HTML escaping,
    non-ASCII kept, indent), special tokens as variables, raise_exception."""
    tok = Tokenizer(tok.backend, tok.special_tokens, chat_template=(
        "{% for m in messages %}\n"
        "    {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
        "[{{ m.role }}]{{ m.content | tojson }}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{{ {'a': '<b>é'} | tojson(indent=1) }}"))
    out = tok.apply_chat_template([{"role": "user", "content": "x<y>ü"},
                                   {"role": "skip", "content": "no"}],
                                  add_generation_prompt=False)
    assert out == '[user]"x<y>ü"<|im_end|>\n{\n "a": "<b>é"\n}'

    raising = Tokenizer(tok.backend, tok.special_tokens, chat_template=(
        "{% if messages[0].role != 'system' %}{{ raise_exception('first message must be system') }}"
        "{% endif %}ok"))
    with pytest.raises(jinja2.TemplateError, match="first message must be system"):
        raising.apply_chat_template([{"role": "user", "content": "hi"}])
    assert raising.apply_chat_template([{"role": "system", "content": "s"}]) == "ok"


def test_none_fields_dropped_and_reasoning_aliases(tok):
    """As transformers: a None value is a missing key, and ``thinking`` reaches the template as
    ``reasoning_content``."""
    t = Tokenizer(tok.backend, tok.special_tokens, chat_template=(
        "{% for m in messages %}{{ m.reasoning_content | default('-') }}|"
        "{{ 'tc' if m.tool_calls is defined else 'none' }};{% endfor %}"))
    out = t.apply_chat_template([{"role": "assistant", "content": "a", "thinking": "hmm",
                                  "tool_calls": None}], add_generation_prompt=False)
    assert out == "hmm|none;"


def test_errors(tmp_path, tok):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    shutil.copy(hf_case("chat")["path"] / "tokenizer.json", tmp_path / "tokenizer.json")
    bare = Tokenizer.from_dir(tmp_path)
    assert bare.eos_token_ids == ()
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(TokenizerError, match="empty conversation"):
        tok.apply_chat_template([])
    with pytest.raises(TokenizerError, match="must be dicts"):
        tok.apply_chat_template(["hi"])
    with pytest.raises(TokenizerError, match="eos_token '<nope>' is not in the tokenizer"):
        Tokenizer(tok.backend, {"eos_token": "<nope>"})
