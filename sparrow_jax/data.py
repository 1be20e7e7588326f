"""Prompt sources: local files through ``datasets``, and built-in synthetic verifiable tasks.

Synthetic tasks are token-level (no tokenizer) and generated from a seed, so a run is
reproducible from its config alone. The demo task, :class:`NeedleTask`, is a long-context
retrieval problem: a prompt of filler tokens hides a few "needles" (a marker followed by a value)
and the answer is the needle values in order, then EOS.

:class:`PromptIterator` walks a prompt set in a seeded order per epoch; its whole state is
``(epoch, position, seed)``, saved in checkpoints so that a resumed run sees the same batches.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from sparrow_jax.config import ConfigError

# ------------------------------------------------------------------------------ token layout
# Shared by the synthetic tasks (and the demo model pre-trained on them).
EOS = 0          # ends every answer
BOS = 1          # first token of every prompt
MARK = 2         # precedes a needle's value
QUERY = 3        # last prompt token: "now answer"
VALUE_START = 4  # value tokens are VALUE_START .. VALUE_START + num_values - 1; filler follows


@dataclasses.dataclass(frozen=True)
class NeedleConfig:
    """Token layout: ``[BOS] filler... MARK v1 filler... MARK v2 ... [QUERY]``, answer
    ``[v1, v2, ..., EOS]``. Values are drawn independently and uniformly, filler holds neither
    markers nor values, so only reading the context beats chance (1 / num_values per needle)."""

    vocab_size: int = 40
    num_values: int = 16
    num_needles: int = 3
    min_prompt_len: int = 192
    max_prompt_len: int = 256

    def __post_init__(self):
        if self.num_values < 2 or self.num_needles < 1:
            raise ConfigError(f"needle task needs num_values >= 2 and num_needles >= 1, got "
                              f"{self.num_values}, {self.num_needles}")
        if self.filler_start >= self.vocab_size:
            raise ConfigError(f"vocab_size {self.vocab_size} leaves no filler tokens after "
                              f"{self.num_values} values (need > {self.filler_start})")
        if not 2 + 2 * self.num_needles <= self.min_prompt_len <= self.max_prompt_len:
            raise ConfigError(f"need 2 + 2*num_needles <= min_prompt_len <= max_prompt_len, got "
                              f"{self.num_needles}, {self.min_prompt_len}, {self.max_prompt_len}")

    @property
    def filler_start(self) -> int:
        return VALUE_START + self.num_values


class NeedleTask:
    """The demo's long-context retrieval task; see :class:`NeedleConfig` for the layout."""

    name = "needle"

    def __init__(self, config: NeedleConfig = NeedleConfig()):
        self.config = config

    def sample(self, rng: np.random.Generator, n: int) -> tuple[list[list[int]], list[list[int]]]:
        """-> (n prompts, n answers), token lists; answers are the needle values then EOS."""
        c = self.config
        prompts, answers = [], []
        for _ in range(n):
            length = int(rng.integers(c.min_prompt_len, c.max_prompt_len + 1))
            body_len = length - 2
            body = rng.integers(c.filler_start, c.vocab_size, body_len)
            values = rng.integers(VALUE_START, c.filler_start, c.num_needles)
            # Sorted distinct picks among body_len - k slots, shifted by their rank: needles
            # (2 tokens each) land in order without overlapping.
            picks = np.sort(rng.choice(body_len - c.num_needles, c.num_needles, replace=False))
            for i, (start, v) in enumerate(zip(picks + np.arange(c.num_needles), values)):
                body[start], body[start + 1] = MARK, v
            prompts.append([BOS, *body.tolist(), QUERY])
            answers.append([*values.tolist(), EOS])
        return prompts, answers

    def reward(self, response: Sequence[int], answer: Sequence[int]) -> float:
        return positional_credit(response, answer)

    def context_free_ceiling(self) -> float:
        """The best expected reward of a policy that ignores the prompt: each value is uniform
        and independent, so any guess is right with probability 1 / num_values."""
        return 1.0 / self.config.num_values


@dataclasses.dataclass(frozen=True)
class ReverseConfig:
    """``[BOS] v1 .. vL [QUERY]`` -> ``[vL .. v1, EOS]`` over the value tokens."""

    num_values: int = 16
    min_len: int = 4
    max_len: int = 8

    def __post_init__(self):
        if not 1 <= self.min_len <= self.max_len or self.num_values < 2:
            raise ConfigError(f"reverse task needs 1 <= min_len <= max_len and num_values >= 2, "
                              f"got {self.min_len}, {self.max_len}, {self.num_values}")


class ReverseTask:
    """A short sanity task: reverse a sequence of value tokens."""

    name = "reverse"

    def __init__(self, config: ReverseConfig = ReverseConfig()):
        self.config = config

    def sample(self, rng: np.random.Generator, n: int) -> tuple[list[list[int]], list[list[int]]]:
        c = self.config
        prompts, answers = [], []
        for _ in range(n):
            seq = rng.integers(VALUE_START, VALUE_START + c.num_values,
                               int(rng.integers(c.min_len, c.max_len + 1))).tolist()
            prompts.append([BOS, *seq, QUERY])
            answers.append([*seq[::-1], EOS])
        return prompts, answers

    def reward(self, response: Sequence[int], answer: Sequence[int]) -> float:
        return positional_credit(response, answer)


def positional_credit(response: Sequence[int], answer: Sequence[int], eos: int = EOS) -> float:
    """Fraction of the answer's tokens (its trailing EOS excluded) that the response reproduces
    at the same position, the response read up to its first EOS. A response that stops early
    misses the rest; tokens after the answer's length are ignored."""
    target = list(answer)
    if target and target[-1] == eos:
        target = target[:-1]
    if not target:
        raise ValueError("answer holds no token to match")
    got = list(response)
    if eos in got:
        got = got[:got.index(eos)]
    return sum(int(a == b) for a, b in zip(got, target)) / len(target)


SYNTHETIC_TASKS = {"needle": NeedleTask, "reverse": ReverseTask}


# ------------------------------------------------------------------------------ configs, sets
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """``task`` names a built-in synthetic task; ``task: null`` reads ``path`` (parquet, JSONL
    or a ``datasets.save_to_disk`` folder), tokenised with the model's tokenizer (and its chat
    template unless ``chat_template: false``). Evaluation uses ``eval_path`` or else the last
    ``num_eval`` records of the file.

    ``recipe`` (with ``task: null``) trains on a math recipe of :mod:`sparrow_jax.recipes`
    (``polaris``, ``dapo``, ...): its fields and answers, its local copy at ``path`` (None: the
    Hugging Face cache), each problem put in ``prompt_template`` (None: the paper's). ``eval_sets``
    maps recipe names to their local copies (null: the cache), the held-out sets of
    :func:`build_eval_sets`; given, they are also the evaluation set (all of them in one).
    ``enable_thinking`` goes to the chat template (Qwen3's thinking switch; None: the template's
    default)."""

    task: str | None = "needle"
    needle: NeedleConfig = NeedleConfig()
    reverse: ReverseConfig = ReverseConfig()
    num_train: int = 4096            # synthetic prompts in the training set
    num_eval: int = 64
    path: str | None = None
    eval_path: str | None = None
    split: str = "train"
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    chat_template: bool = True
    system_prompt: str | None = None
    recipe: str | None = None
    eval_sets: dict[str, Any] = dataclasses.field(default_factory=dict)
    prompt_template: str | None = None
    enable_thinking: bool | None = None
    prompts_per_step: int = 8
    seed: int = 0

    def __post_init__(self):
        if self.task is None and self.path is None and self.recipe is None:
            raise ConfigError("data: give a synthetic `task`, a file `path` or a `recipe`")
        if self.task is not None and self.task not in SYNTHETIC_TASKS:
            raise ConfigError(f"data.task must be one of {sorted(SYNTHETIC_TASKS)} or null, got "
                              f"{self.task!r}")
        for name in ("num_train", "prompts_per_step"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"data.{name} must be positive, got {getattr(self, name)}")
        if self.num_eval < 0:
            raise ConfigError(f"data.num_eval must be >= 0, got {self.num_eval}")
        from sparrow_jax.recipes import get_recipe, render_prompt

        if self.recipe is not None:
            if self.task is not None:
                raise ConfigError(f"data.recipe={self.recipe!r} needs task: null (got task "
                                  f"{self.task!r})")
            try:
                get_recipe(self.recipe)
            except ConfigError as e:
                raise ConfigError(f"data.recipe: {e}") from None
        for name, where in self.eval_sets.items():
            try:
                get_recipe(name)
            except ConfigError as e:
                raise ConfigError(f"data.eval_sets: {e}") from None
            if where is not None and not isinstance(where, str):
                raise ConfigError(f"data.eval_sets.{name}: expected a path or null, got "
                                  f"{where!r}")
        if self.prompt_template is not None:
            try:
                render_prompt(self.prompt_template, "")
            except ConfigError as e:
                raise ConfigError(f"data.prompt_template: {e}") from None


class PromptSet(NamedTuple):
    prompts: list[list[int]]
    answers: list[Any]            # token lists (synthetic) or the answer column's values


def synthetic_task(config: DataConfig):
    return SYNTHETIC_TASKS[config.task](getattr(config, config.task))


def build_prompt_sets(config: DataConfig, tokenizer=None) -> tuple[PromptSet, PromptSet]:
    """-> (train, eval) prompt sets. Synthetic sets come from independent streams of
    ``config.seed``; file and recipe sets need ``tokenizer``."""
    if config.task is not None:
        task = synthetic_task(config)
        train = PromptSet(*task.sample(np.random.default_rng([config.seed, 0]), config.num_train))
        held = PromptSet(*task.sample(np.random.default_rng([config.seed, 1]), config.num_eval))
        return train, held
    if tokenizer is None:
        raise ConfigError(f"data.{'recipe' if config.recipe else 'path'} needs a tokenizer (the "
                          "model folder's tokenizer.json)")
    if config.recipe is not None:
        train = recipe_prompt_set(config.recipe, config.path, tokenizer, config)
        if config.eval_sets:
            sets = build_eval_sets(config, tokenizer).values()
            return train, PromptSet([p for s in sets for p in s.prompts],
                                    [a for s in sets for a in s.answers])
        cut = len(train.prompts) - config.num_eval
        if cut <= 0:
            raise ConfigError(f"recipe {config.recipe} has {len(train.prompts)} records, not "
                              f"more than num_eval={config.num_eval}")
        return (PromptSet(train.prompts[:cut], train.answers[:cut]),
                PromptSet(train.prompts[cut:], train.answers[cut:]))
    records = load_records(config.path, config.split)
    if config.eval_path is not None:
        held = load_records(config.eval_path, config.split)
    else:
        cut = len(records) - config.num_eval
        if cut <= 0:
            raise ConfigError(f"{config.path} has {len(records)} records, not more than "
                              f"num_eval={config.num_eval}")
        records, held = records[:cut], records[cut:]
    return (tokenize_records(records, tokenizer, config),
            tokenize_records(held, tokenizer, config))


def recipe_prompt_set(name: str, path: str | None, tokenizer, config: DataConfig) -> PromptSet:
    """A math recipe's problems as prompts (its template, the chat template as configured) and
    its gold answers as text."""
    from sparrow_jax.recipes import MATH_PROMPT, load_recipe, render_prompt

    template = config.prompt_template or MATH_PROMPT
    examples = load_recipe(name, path)
    prompts = [encode_prompt(render_prompt(template, e.problem), tokenizer, config.chat_template,
                             config.system_prompt, config.enable_thinking) for e in examples]
    return PromptSet(prompts, [e.answer for e in examples])


def build_eval_sets(config: DataConfig, tokenizer) -> dict[str, PromptSet]:
    """The held-out sets of ``config.eval_sets``, by recipe name, in the config's order."""
    return {name: recipe_prompt_set(name, where, tokenizer, config)
            for name, where in config.eval_sets.items()}


def load_records(path: str | Path, split: str = "train") -> list[dict]:
    """Rows of a parquet file, a JSON/JSONL file or a ``save_to_disk`` folder, via ``datasets``."""
    try:
        import datasets
    except ImportError:
        raise ImportError("reading prompt files needs `datasets`: pip install datasets") from None
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file not found: {path}")
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ConfigError(f"{path} has splits {sorted(ds)}, not {split!r}")
            ds = ds[split]
    else:
        return load_files([path])
    return list(ds)


def load_files(paths: Sequence[str | Path]) -> list[dict]:
    """Rows of data files of one kind (parquet, JSON/JSONL or arrow), in order, via
    ``datasets``."""
    import datasets

    kinds = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
    paths = [Path(p) for p in paths]
    for p in paths:
        if p.suffix not in kinds:
            raise ConfigError(f"unsupported prompt file type {p.suffix!r} ({p}); use "
                              f"{sorted(kinds)} or a saved dataset folder")
    found = {kinds[p.suffix] for p in paths}
    if len(found) != 1:
        raise ConfigError(f"data files of one kind expected, got {sorted(found)}: "
                          f"{[str(p) for p in paths]}")
    ds = datasets.load_dataset(found.pop(), data_files=[str(p) for p in paths], split="train")
    return list(ds)


def tokenize_records(records: Sequence[dict], tokenizer, config: DataConfig) -> PromptSet:
    """Prompt column -> token ids (through the chat template unless disabled); a prompt column
    that already holds a list of chat messages is used as the conversation."""
    prompts, answers = [], []
    for i, rec in enumerate(records):
        for col in (config.prompt_column, config.answer_column):
            if col not in rec:
                raise ConfigError(f"record {i} has no column {col!r}; columns: {sorted(rec)}")
        prompt = rec[config.prompt_column]
        if config.prompt_template is not None and isinstance(prompt, str):
            from sparrow_jax.recipes import render_prompt

            prompt = render_prompt(config.prompt_template, prompt)
        prompts.append(encode_prompt(prompt, tokenizer, config.chat_template,
                                     config.system_prompt, config.enable_thinking))
        answers.append(rec[config.answer_column])
    return PromptSet(prompts, answers)


def encode_prompt(prompt: str | list[dict], tokenizer, chat_template: bool = True,
                  system_prompt: str | None = None,
                  enable_thinking: bool | None = None) -> list[int]:
    """Any tokenizer with ``encode`` and ``apply_chat_template`` (returning text or ids);
    ``enable_thinking`` goes to the template when not None (Qwen3's thinking switch)."""
    if not chat_template:
        if not isinstance(prompt, str):
            raise ConfigError("a prompt given as chat messages needs chat_template: true")
        return list(tokenizer.encode(prompt))
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if system_prompt is not None:
        messages = [{"role": "system", "content": system_prompt}, *messages]
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    return list(tokenizer.encode(out)) if isinstance(out, str) else [int(t) for t in out]


# ------------------------------------------------------------------------------ iteration
class PromptIterator:
    """Batches of prompt indices, each epoch a fresh permutation seeded by ``(seed, epoch)``.

    An epoch's tail shorter than a batch is skipped (every batch has the same size, so the
    rollout shapes stay fixed). ``state_dict()`` is all it takes to resume exactly.
    """

    def __init__(self, num_items: int, batch_size: int, seed: int = 0):
        if not 0 < batch_size <= num_items:
            raise ValueError(f"batch_size must be in [1, {num_items}] (the prompt count), got "
                             f"{batch_size}")
        self.num_items, self.batch_size = num_items, batch_size
        self.seed, self.epoch, self.position = seed, 0, 0

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_items)

    def next_indices(self) -> np.ndarray:
        if self.position + self.batch_size > self.num_items:
            self.epoch, self.position = self.epoch + 1, 0
        idx = self._order()[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return idx

    def next_batch(self, prompt_set: PromptSet) -> tuple[list[list[int]], list[Any]]:
        idx = self.next_indices()
        return [prompt_set.prompts[i] for i in idx], [prompt_set.answers[i] for i in idx]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"iterator state was saved with seed {state['seed']}, this "
                             f"iterator has seed {self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def evaluate_mean_at_k(sample_fn: Callable[[list[list[int]], int], list[list[int]]],
                       prompt_set: PromptSet, reward_fn: Callable[..., float], k: int,
                       batch_size: int = 8) -> dict[str, float]:
    """mean@k: the mean reward over k samples of every held-out prompt (and best@k, the mean
    over prompts of the best of its k).

    ``sample_fn(prompts, k)`` returns ``len(prompts) * k`` responses, the k of a prompt adjacent;
    ``reward_fn(prompt_ids, response_ids, answer)`` scores one.
    """
    if k <= 0 or not prompt_set.prompts:
        raise ValueError(f"evaluation needs k > 0 and a non-empty prompt set (k={k}, "
                         f"{len(prompt_set.prompts)} prompts)")
    per_prompt = []
    for start in range(0, len(prompt_set.prompts), batch_size):
        prompts = prompt_set.prompts[start:start + batch_size]
        responses = sample_fn(prompts, k)
        if len(responses) != len(prompts) * k:
            raise ValueError(f"sample_fn returned {len(responses)} responses for "
                             f"{len(prompts)} prompts x k={k}")
        for i, prompt in enumerate(prompts):
            answer = prompt_set.answers[start + i]
            per_prompt.append([reward_fn(prompt, r, answer) for r in responses[i * k:(i + 1) * k]])
    scores = np.asarray(per_prompt, np.float64)
    return {"mean_at_k": float(scores.mean()), "best_at_k": float(scores.max(1).mean())}
