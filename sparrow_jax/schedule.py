"""Length-indexed budget schedule (docs/design.md, section 4) and its search (section 6).

A schedule maps each sequence's ``lengths`` (prompt + generated, current token included) to its
page budget, reserved pages included. The cost model lives in :mod:`sparrow_jax.cost_model`; its
closed forms are re-exported here, where the public API names them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import yaml

from sparrow_jax.attention.selection import MIN_BUDGET_PAGES
from sparrow_jax.config import CONFIG_DIR, from_dict, to_dict
from sparrow_jax.cost_model import DecodeCost, rollout_cost_dense, rollout_cost_sparse

__all__ = ["BudgetSchedule", "PAPER_TABLES", "search_schedule", "DecodeCost",
           "rollout_cost_dense", "rollout_cost_sparse"]

# Top-k pages per 2000-token bin (threshold 0.86 with the `paper` estimator, page 16, 20 bins).
PAPER_TABLES = {
    "qwen3-1.7b": (29, 61, 93, 93, 125, 157, 189, 221, 221, 253) + (253,) * 10,
    "qwen3-4b": (29, 45, 61, 77, 93, 125, 157, 221, 253, 253, 317, 317, 317, 317, 381, 381, 381,
                 381, 509, 509),
    # The reference code has 385 in bin 17; every other entry is 16k - 3 (the budget in pages,
    # a multiple of 16, less the 3 reserved), so 385 reads as a typo for 381.
    "qwen3-8b": (29, 45, 61, 77, 125, 157, 189, 253, 253, 253, 253, 317, 317, 317, 317, 317, 317,
                 381, 445, 445),
    # 19 entries (docs/design.md, section 4), so its last (open-ended) bin starts at 36000
    # tokens.
    "qwen3-14b": (29, 45, 77, 125, 253) + (381,) * 9 + (509, 637, 637, 893, 893),
}

KINDS = ("table", "fixed", "fraction")


@dataclasses.dataclass(frozen=True)
class BudgetSchedule:
    """Per-sequence page budgets as a function of ``lengths``.

    kind ``"table"``: ``table[min(length // bin_tokens, len(table) - 1)] + 3`` (the table holds
    top-k page counts, the 3 reserved pages excluded). ``"fixed"``: ``pages`` (reserved
    included). ``"fraction"``: ``max(floor, ceil(fraction x ceil(length / page_size)))`` pages.
    """

    kind: str = "table"
    table: tuple[int, ...] = ()
    bin_tokens: int = 2000
    pages: int = 0
    fraction: float = 0.0
    floor: int = MIN_BUDGET_PAGES
    page_size: int = 16
    name: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown schedule kind {self.kind!r}; expected one of {KINDS}")
        if self.kind == "table":
            if not self.table or any(not isinstance(v, (int, np.integer)) or v < 0
                                     for v in self.table):
                raise ValueError(f"table must be a non-empty sequence of ints >= 0, got "
                                 f"{self.table!r}")
            if self.bin_tokens < 1:
                raise ValueError(f"bin_tokens must be positive, got {self.bin_tokens}")
            drops = [i for i in range(1, len(self.table)) if self.table[i] < self.table[i - 1]]
            if drops:
                # A longer sequence never gets fewer pages: every calibrated table is
                # non-decreasing, and a drop would re-read fewer pages than the step before.
                i = drops[0]
                raise ValueError(f"table must be non-decreasing, got {self.table[i - 1]} then "
                                 f"{self.table[i]} at bins {i - 1} and {i}")
        if self.kind == "fixed" and self.pages < MIN_BUDGET_PAGES:
            raise ValueError(f"a fixed budget needs >= {MIN_BUDGET_PAGES} pages, got {self.pages}")
        if self.kind == "fraction":
            if not 0.0 < self.fraction <= 1.0:
                raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
            if self.floor < MIN_BUDGET_PAGES:
                raise ValueError(f"floor must be >= {MIN_BUDGET_PAGES} pages, got {self.floor}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be positive, got {self.page_size}")

    @classmethod
    def paper(cls, name: str) -> "BudgetSchedule":
        """The paper's table for ``name`` (qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-14b)."""
        if name not in PAPER_TABLES:
            raise ValueError(f"no paper schedule {name!r}; known: {sorted(PAPER_TABLES)}")
        return cls(kind="table", table=PAPER_TABLES[name], name=name)

    @classmethod
    def from_table(cls, values, bin_tokens: int = 2000, **kwargs) -> "BudgetSchedule":
        """A table of top-k page counts per bin (reserved pages excluded)."""
        return cls(kind="table", table=tuple(int(v) for v in values), bin_tokens=bin_tokens,
                   **kwargs)

    @classmethod
    def fixed(cls, pages: int, **kwargs) -> "BudgetSchedule":
        """The same total budget of ``pages`` (reserved included) at every length."""
        return cls(kind="fixed", pages=int(pages), **kwargs)

    @classmethod
    def from_fraction(cls, f: float, floor: int = MIN_BUDGET_PAGES, **kwargs) -> "BudgetSchedule":
        """A fraction ``f`` of the context's pages, at least ``floor`` pages."""
        return cls(kind="fraction", fraction=float(f), floor=int(floor), **kwargs)

    @classmethod
    def from_spec(cls, spec: str, page_size: int = 16) -> "BudgetSchedule":
        """A command-line spelling: a page count (``"8"``: fixed), a paper schedule name
        (``"qwen3-1.7b"``) or a schedule YAML file (a path, or a name in
        ``configs/schedules/``). The schedule must count pages of ``page_size`` tokens."""
        spec = str(spec).strip()
        if spec.isdigit():
            schedule = cls.fixed(int(spec), page_size=page_size)
        elif spec in PAPER_TABLES:
            schedule = cls.paper(spec)
        elif Path(spec).is_file() or (CONFIG_DIR / "schedules" / f"{spec}.yaml").is_file():
            schedule = cls.from_yaml(Path(spec) if Path(spec).is_file() else spec)
        else:
            raise ValueError(f"schedule {spec!r} is neither a page count, a paper schedule "
                             f"({sorted(PAPER_TABLES)}) nor a YAML file")
        if schedule.page_size != page_size:
            raise ValueError(f"schedule {spec!r} counts pages of {schedule.page_size} tokens, "
                             f"not {page_size}")
        return schedule

    def budget_pages(self, lengths) -> jnp.ndarray:
        """lengths ``[...]`` int -> total budget pages ``[...]`` int32 (reserved included).
        Vectorised and usable inside jit."""
        lengths = jnp.asarray(lengths)
        if not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(f"lengths must be integer, got {lengths.dtype}")
        lengths = lengths.astype(jnp.int32)
        if self.kind == "table":
            table = jnp.asarray(self.table, jnp.int32) + MIN_BUDGET_PAGES
            return table[jnp.clip(lengths // self.bin_tokens, 0, len(self.table) - 1)]
        if self.kind == "fixed":
            return jnp.full(lengths.shape, self.pages, jnp.int32)
        pages = (lengths + self.page_size - 1) // self.page_size
        share = jnp.ceil(self.fraction * pages.astype(jnp.float32)).astype(jnp.int32)
        return jnp.maximum(share, self.floor)

    def to_dict(self) -> dict:
        """Only the fields this kind uses, ready for YAML."""
        used = {"table": ("table", "bin_tokens"), "fixed": ("pages",),
                "fraction": ("fraction", "floor")}[self.kind]
        data = to_dict(self)
        keep = ("kind", "page_size", "name") + used
        return {k: data[k] for k in keep if k != "name" or data[k]}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    @classmethod
    def from_yaml(cls, source: str | Path) -> "BudgetSchedule":
        """From YAML text, a path, or the name of a file in ``configs/schedules/``."""
        text = source
        if isinstance(source, Path) or not any(c in source for c in ":\n"):
            path = Path(source)
            if not path.exists():
                path = CONFIG_DIR / "schedules" / f"{source}.yaml"
            if not path.exists():
                raise ValueError(f"no schedule file {source!r} (nor {path})")
            text = path.read_text()
        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ValueError(f"a schedule YAML must be a mapping, got {type(data).__name__}")
        return from_dict(cls, data)


def search_schedule(tail_alpha, budgets, target: float = 0.86,
                    bin_tokens: int = 2000, name: str = "") -> BudgetSchedule:
    """The smallest table meeting ``target`` in every bin, from measured tail statistics.

    tail_alpha ``[num_bins, num_budgets]``: the tail statistic per bin (rows) when rolling out at
    each candidate top-k budget of ``budgets [num_budgets]`` (pages, reserved excluded); NaN
    marks a bin with too few tokens. Per bin the smallest budget whose tail alpha >= target (the
    largest candidate when none does); NaN bins carry the previous bin's choice (bins before the
    first measured one take its choice); then a cumulative max makes the table non-decreasing.
    Validate the result by measuring it again: a bin's alpha depends on earlier bins' budgets
    through the tokens they generated.
    """
    alpha = np.asarray(tail_alpha, np.float64)
    budgets = np.asarray(budgets)
    if alpha.ndim != 2 or alpha.shape[1] != budgets.shape[0]:
        raise ValueError(f"tail_alpha must be [num_bins, num_budgets={budgets.shape[0]}], got "
                         f"{alpha.shape}")
    order = np.argsort(budgets, kind="stable")
    alpha, budgets = alpha[:, order], budgets[order]
    measured = ~np.isnan(alpha).all(axis=1)
    if not measured.any():
        raise ValueError("no bin has a measured tail statistic")
    choice = np.zeros(alpha.shape[0], np.int64)
    for i, row in enumerate(alpha):
        ok = np.flatnonzero(row >= target)  # NaN compares False
        choice[i] = budgets[ok[0]] if ok.size else budgets[-1]
    first = np.flatnonzero(measured)[0]
    table = np.empty_like(choice)
    table[:first] = choice[first]
    for i in range(first, len(table)):
        table[i] = choice[i] if measured[i] else table[i - 1]
    return BudgetSchedule.from_table(np.maximum.accumulate(table), bin_tokens, name=name)
