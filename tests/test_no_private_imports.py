"""Scripts use the package's public names only: no file in scripts/ imports a name starting with
``_`` from sparrow_jax, nor reads one as an attribute of something it imported from there (a
script must not re-implement, or reach into, the engine's internals)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Namedtuple methods: public API despite their underscore.
ALLOWED = {"_replace", "_fields", "_asdict", "_make", "_field_defaults"}


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of every private sparrow_jax name ``source`` imports or reads."""
    tree = ast.parse(source)
    bound: set[str] = set()     # local names standing for sparrow_jax modules or objects
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "sparrow_jax":
                    bound.add(a.asname or "sparrow_jax")
                    found += [(node.lineno, a.name) for part in a.name.split(".")
                              if part.startswith("_")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == \
                "sparrow_jax":
            found += [(node.lineno, node.module) for part in node.module.split(".")
                      if part.startswith("_")]
            for a in node.names:
                bound.add(a.asname or a.name)
                if a.name.startswith("_"):
                    found.append((node.lineno, f"{node.module}.{a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__") and node.attr not in ALLOWED:
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
    return sorted(found)


def test_the_scan_finds_each_kind_of_private_use():
    source = """
import sparrow_jax.rollout.engine as eng
from sparrow_jax.rollout import engine
from sparrow_jax.rollout.engine import _Loop, generate
import numpy as np
eng._run_chunk(1)
x = engine.RolloutConfig._fields    # namedtuple API: allowed
y = np._private                      # not sparrow_jax
z = generate.__doc__
w = engine.sub._hidden
"""
    assert private_uses(source) == [(4, "sparrow_jax.rollout.engine._Loop"),
                                    (6, "eng._run_chunk"), (10, "engine.sub._hidden")]


@pytest.mark.parametrize("path", sorted((REPO / "scripts").glob("*.py")), ids=lambda p: p.name)
def test_scripts_use_public_names_only(path):
    assert private_uses(path.read_text()) == [], path
