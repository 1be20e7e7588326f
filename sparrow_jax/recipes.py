"""Math dataset recipes of the Sparrow paper: which fields of each Hugging Face dataset hold the
problem and the answer, how an answer becomes the gold text of the ``math`` reward, and the
prompt the model sees.

Nothing is downloaded here: a recipe reads a local copy through ``datasets``, either the path
given (a parquet, JSONL, JSON or arrow file, a folder of them such as a ``huggingface-cli
download --local-dir`` copy, or a ``save_to_disk`` folder) or else the snapshot in the local
Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Callable, NamedTuple

from sparrow_jax.config import ConfigError, unknown_name

# The paper's prompt; ``{problem}`` is replaced by the problem text (str.format would trip on
# the template's own braces and on the problems' LaTeX).
MATH_PROMPT = (
    "Please solve the following math problem: {problem}. The assistant first thinks about the "
    "reasoning process step by step and then provides the user with the answer. Return the "
    "final answer in \\boxed{} tags, for example \\boxed{1}. Let's solve this step by step.")

DATA_SUFFIXES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
SPLITS = ("train", "test", "validation")


def render_prompt(template: str, problem: str) -> str:
    if "{problem}" not in template:
        raise ConfigError(f"no {{problem}} slot in the template {template!r}")
    return template.replace("{problem}", problem)


# ------------------------------------------------------------------------------ answers
def text_answer(value: Any) -> str:
    return str(value).strip()


def number_answer(value: Any) -> str:
    """A numeric column (AMC's answers are floats: 142.0) as its shortest exact text."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return text_answer(value)


def gsm8k_answer(value: Any) -> str:
    """GSM8K's answer field is the worked solution, the number after its ``####``; thousands
    separators dropped (``1,000`` would read as a tuple)."""
    text = str(value)
    if "####" not in text:
        raise ValueError(f"a GSM8K answer without '####': {text[-80:]!r}")
    return text.rsplit("####", 1)[1].strip().replace(",", "")


# DAPO-Math-17k wraps every problem in its own instruction (an "Answer:" line, not a box); the
# processed copy keeps that wrapper in `prompt`. Stripped, so the recipe's prompt is the only one.
_DAPO_HEAD = ("Solve the following math problem step by step. The last line of your response "
              "should be of the form Answer: $Answer (without quotes) where $Answer is the "
              "answer to the problem.\n\n")
_DAPO_TAIL = "\n\nRemember to put your answer on its own line after \"Answer:\"."


def dapo_problem(value: Any) -> str:
    text = str(value).strip()
    text = text.removeprefix(_DAPO_HEAD)
    return text.removesuffix(_DAPO_TAIL).strip()


# ------------------------------------------------------------------------------ recipes
@dataclasses.dataclass(frozen=True)
class Recipe:
    """hub_id: the dataset on the Hugging Face hub; subset: its configuration (a sub-folder of
    its files); split: the split the paper uses; problem_field, answer_field: the columns;
    answer: column value -> gold text; problem: column value -> problem text."""

    name: str
    hub_id: str
    split: str
    problem_field: str
    answer_field: str
    subset: str | None = None
    answer: Callable[[Any], str] = text_answer
    problem: Callable[[Any], str] = text_answer


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("polaris", "POLARIS-Project/Polaris-Dataset-53K", "train", "problem", "answer"),
    Recipe("dapo", "open-r1/DAPO-Math-17k-Processed", "train", "prompt", "solution",
           subset="all", problem=dapo_problem),
    Recipe("aime24", "HuggingFaceH4/aime_2024", "train", "problem", "answer"),
    Recipe("aime25", "yentinglin/aime_2025", "train", "problem", "answer"),
    Recipe("aime26", "MathArena/aime_2026", "train", "problem", "answer", answer=number_answer),
    Recipe("amc", "AI-MO/aimo-validation-amc", "train", "problem", "answer",
           answer=number_answer),
    Recipe("math500", "HuggingFaceH4/MATH-500", "test", "problem", "answer"),
    Recipe("gsm8k", "openai/gsm8k", "test", "question", "answer", subset="main",
           answer=gsm8k_answer),
)}


def get_recipe(name: str) -> Recipe:
    """A recipe by its short name or its hub id."""
    if name in RECIPES:
        return RECIPES[name]
    for recipe in RECIPES.values():
        if recipe.hub_id == name:
            return recipe
    raise unknown_name("math recipe", name, RECIPES)


class MathExample(NamedTuple):
    problem: str
    answer: str


# ------------------------------------------------------------------------------ local files
def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "huggingface") / "hub"


def cached_snapshot(recipe: Recipe) -> Path | None:
    """The newest snapshot folder of the recipe's dataset in the local hub cache, if any."""
    root = hub_cache() / f"datasets--{recipe.hub_id.replace('/', '--')}" / "snapshots"
    snapshots = sorted(root.glob("*"), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    return snapshots[-1] if snapshots else None


def _where_to_put(recipe: Recipe) -> str:
    return (f"download it where it can be read, e.g. `huggingface-cli download --repo-type "
            f"dataset {recipe.hub_id} --local-dir data/{recipe.name}` and give that folder as "
            f"the path, or into the hub cache ({hub_cache()})")


def data_files(folder: Path, recipe: Recipe) -> list[Path]:
    """The recipe's data files in a folder: those of its subset's sub-folder when there is one
    (else of a ``data`` sub-folder, where the hub keeps a default subset's files), and of its
    split when file names say their split (``test-00000-of-00001.parquet``)."""
    for sub in (recipe.subset, "data"):
        if sub is not None and (folder / sub).is_dir():
            folder = folder / sub
            break
    files = sorted(p for p in folder.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))

    def split_of(p: Path) -> str | None:
        rel = p.relative_to(folder).as_posix()
        return next((s for s in SPLITS if re.search(rf"(^|[/_.-]){s}([/_.-]|$)", rel)), None)

    named = [p for p in files if split_of(p) is not None]
    if not named:
        return files
    return [p for p in named if split_of(p) == recipe.split]


def recipe_records(recipe: Recipe, path: str | Path | None = None) -> list[dict]:
    """Rows of the recipe's split, from ``path`` or the hub cache; a ConfigError that says
    where to put the files when there is no local copy."""
    from sparrow_jax.data import load_files, load_records

    if path is None:
        source = cached_snapshot(recipe)
        if source is None:
            raise ConfigError(f"recipe {recipe.name}: no local copy of {recipe.hub_id} (no "
                              f"path given, not in the hub cache); {_where_to_put(recipe)}")
    else:
        source = Path(path)
        if not source.exists():
            raise ConfigError(f"recipe {recipe.name}: {source} does not exist; "
                              f"{_where_to_put(recipe)}")
    if source.is_file() or (source / "dataset_dict.json").is_file() or (
            source / "state.json").is_file():
        return load_records(source, recipe.split)
    files = data_files(source, recipe)
    if not files:
        raise ConfigError(f"recipe {recipe.name}: no {recipe.split} split files "
                          f"({'/'.join(DATA_SUFFIXES)}) under {source}; {_where_to_put(recipe)}")
    return load_files(files)


def load_recipe(name: str, path: str | Path | None = None) -> list[MathExample]:
    """The recipe's problems and gold answers (see :func:`recipe_records` for ``path``)."""
    recipe = get_recipe(name)
    rows = recipe_records(recipe, path)
    out = []
    for i, row in enumerate(rows):
        for field in (recipe.problem_field, recipe.answer_field):
            if field not in row:
                raise ConfigError(f"recipe {recipe.name}: record {i} has no field {field!r} "
                                  f"(fields: {sorted(row)}); is this {recipe.hub_id}?")
        try:
            out.append(MathExample(recipe.problem(row[recipe.problem_field]),
                                   recipe.answer(row[recipe.answer_field])))
        except ValueError as e:
            raise ConfigError(f"recipe {recipe.name}: record {i}: {e}") from None
    return out
