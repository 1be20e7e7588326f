"""Shared test helpers: the committed HF fixtures and the optional transformers reference venv."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

# The precision policy of the tests (docs/design.md, section 1): float32 matmuls at full
# precision. On Ampere/Hopper GPUs JAX's default runs them as TF32 (~1e-3 relative), which the
# float64 references and the decode-vs-teacher-forced comparisons would read as errors; on CPU
# this changes nothing.
jax.config.update("jax_default_matmul_precision", "highest")

REPO = Path(__file__).resolve().parents[1]
HF_FIXTURES = REPO / "tests" / "fixtures" / "hf"
HF_PYTHON = REPO / ".venv-hf" / "bin" / "python"


def max_rel_err(actual, reference) -> float:
    """max |actual - reference| / max |reference| (float64): relative to the largest reference
    entry, so near-zero logits do not blow up the ratio."""
    a = np.asarray(actual, np.float64)
    b = np.asarray(reference, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max() / np.abs(b).max())


def hf_case(name: str) -> dict:
    """A fixture folder made by scripts/make_hf_fixtures.py and its reference arrays."""
    folder = HF_FIXTURES / name
    out = {"path": folder, "hf_config": json.loads((folder / "config.json").read_text())}
    for f in folder.glob("*.npy"):
        out[f.stem] = np.load(f)
    return out


def hf_case_names() -> list[str]:
    return json.loads((HF_FIXTURES / "manifest.json").read_text())["cases"]


@pytest.fixture
def hf_python() -> Path:
    """The transformers venv's interpreter, for tests marked ``hf`` (deselected by default):
    selecting them without the venv is an error, not a silent skip."""
    if not HF_PYTHON.exists():
        pytest.fail(f"tests marked hf need {HF_PYTHON}: run bash scripts/make_hf_venv.sh")
    return HF_PYTHON
