"""Math dataset recipes: each loads from a local copy in its dataset's real layout
(tests/fixtures/math, described in its README), or from the Hugging Face cache, with its
answers normalised; a missing copy says where to put the files; prompts are the paper's
template in Qwen3's chat template with thinking on or off."""

import shutil

import pytest
from conftest import HF_FIXTURES

from sparrow_jax.config import ConfigError, from_dict
from sparrow_jax.data import DataConfig, build_eval_sets, build_prompt_sets
from sparrow_jax.recipes import MATH_PROMPT, RECIPES, get_recipe, load_recipe, render_prompt

pytest.importorskip("datasets")
FIX = HF_FIXTURES.parent / "math"

# recipe -> (local copy, [(start of the problem, gold answer)]), read off the fixture files.
EXPECTED = {
    "polaris": ("polaris", [("Compute $1+", "\\frac{3}{2}"), ("Find all real", "\\{-2, 2\\}"),
                            ("What is $7", "42")]),
    "dapo": ("dapo_math_17k_processed", [("In triangle $ABC$", "5"),
                                         ("Find the remainder", "2")]),
    "aime24": ("aime_2024", [("Find the number of ordered", "9"), ("Compute $2^{10}", "024")]),
    "aime25": ("aime_2025", [("Find the sum of all integer", "70")]),
    "aime26": ("aime_2026", [("Compute $3", "277"), ("Compute $\\sqrt", "5")]),
    "amc": ("aimo_validation_amc", [("What is $0.5", "142"), ("What is $1/4", "0.25")]),
    "math500": ("math_500", [("Convert the point", "\\left( 3, \\frac{\\pi}{2} \\right)"),
                             ("Simplify", "\\frac34")]),
    "gsm8k": ("gsm8k", [("Natalia sold clips", "72"), ("A shop sells", "2500")]),
}


def test_every_recipe_has_a_fixture():
    assert sorted(EXPECTED) == sorted(RECIPES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_loads_from_a_local_copy(name):
    folder, expected = EXPECTED[name]
    got = load_recipe(name, FIX / folder)
    assert [e.answer for e in got] == [a for _, a in expected]
    for example, (start, _) in zip(got, expected):
        assert example.problem.startswith(start), example.problem
    # DAPO's own instruction is stripped: the recipe's template is the only one
    assert not any("Answer:" in e.problem for e in got)


def test_a_single_file_and_the_hub_cache(tmp_path, monkeypatch):
    assert [e.answer for e in load_recipe("polaris", FIX / "polaris" /
                                          "polaris-data-53K.jsonl")] == ["\\frac{3}{2}",
                                                                         "\\{-2, 2\\}", "42"]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=r"recipe gsm8k: no local copy of openai/gsm8k .*"
                       r"huggingface-cli download --repo-type dataset openai/gsm8k "
                       r"--local-dir data/gsm8k.*" + str(tmp_path)):
        load_recipe("gsm8k")
    shutil.copytree(FIX / "gsm8k", tmp_path / "datasets--openai--gsm8k" / "snapshots" / "a1")
    assert [e.answer for e in load_recipe("openai/gsm8k")] == ["72", "2500"]   # by hub id


def test_bad_copies_and_names():
    with pytest.raises(ConfigError, match=r"recipe math500: record 0 has no field 'problem'"):
        load_recipe("math500", FIX / "gsm8k" / "main" / "test-00000-of-00001.parquet")
    with pytest.raises(ConfigError, match=r"recipe amc: .*nowhere does not exist"):
        load_recipe("amc", FIX / "nowhere")
    with pytest.raises(ConfigError, match=r"recipe math500: no test split files"):
        load_recipe("math500", FIX / "aime_2025")
    with pytest.raises(ConfigError, match=r"unknown math recipe 'aime2024' .*'aime24'"):
        get_recipe("aime2024")


def test_the_papers_prompt():
    assert render_prompt(MATH_PROMPT, "What is $1+1$?") == (
        "Please solve the following math problem: What is $1+1$?. The assistant first thinks "
        "about the reasoning process step by step and then provides the user with the answer. "
        "Return the final answer in \\boxed{} tags, for example \\boxed{1}. Let's solve this "
        "step by step.")
    with pytest.raises(ConfigError, match=r"^data.prompt_template: no \{problem\} slot in the "
                                          r"template 'Solve it.'$"):
        DataConfig(task=None, recipe="polaris", prompt_template="Solve it.")


@pytest.fixture(scope="module")
def tok():
    from sparrow_jax.models.tokenizer import load_tokenizer

    return load_tokenizer(HF_FIXTURES / "chat")


@pytest.mark.parametrize("thinking", [True, False])
def test_prompt_sets_through_the_chat_template(tok, thinking):
    cfg = DataConfig(task=None, recipe="aime24", path=str(FIX / "aime_2024"),
                     eval_sets={"amc": str(FIX / "aimo_validation_amc"),
                                "gsm8k": str(FIX / "gsm8k")},
                     enable_thinking=thinking)
    train, held = build_prompt_sets(cfg, tok)
    assert train.answers == ["9", "024"]
    text = tok.decode(train.prompts[0])
    assert text.startswith("<|im_start|>user\nPlease solve the following math problem: Find "
                           "the number of ordered pairs $(a,b)$ of positive integers with "
                           "$a+b=10$.. The assistant first thinks")
    tail = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    assert text.endswith("step by step.<|im_end|>\n" + tail)
    # the held-out sets, apart and all in one (the evaluation set of the current trainer)
    sets = build_eval_sets(cfg, tok)
    assert list(sets) == ["amc", "gsm8k"]
    assert sets["amc"].answers == ["142", "0.25"] and sets["gsm8k"].answers == ["72", "2500"]
    assert held.answers == ["142", "0.25", "72", "2500"]
    assert held.prompts[2] == sets["gsm8k"].prompts[0]


def test_data_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"^data.recipe: unknown math recipe 'polars' "
                                          r"\(did you mean 'polaris'\?\)"):
        from_dict(DataConfig, {"task": None, "recipe": "polars"}, where="data")
    with pytest.raises(ConfigError, match=r"^data.eval_sets: unknown math recipe 'aime'"):
        DataConfig(task=None, recipe="polaris", eval_sets={"aime": None})
    with pytest.raises(ConfigError, match=r"^data.eval_sets.amc: expected a path or null, "
                                          r"got 3"):
        DataConfig(task=None, recipe="polaris", eval_sets={"amc": 3})
    with pytest.raises(ConfigError, match=r"data.recipe='polaris' needs task: null"):
        DataConfig(recipe="polaris")
