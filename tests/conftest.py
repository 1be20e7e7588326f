"""Shared test helpers: the engine tests' tiny model and prompts, scripts loaded as modules, the
committed HF fixtures and the optional transformers reference venv."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from sparrow_jax.config import ModelConfig

# The precision policy of the tests (docs/design.md, section 1): float32 matmuls at full
# precision. On Ampere/Hopper GPUs JAX's default runs them as TF32 (~1e-3 relative), which the
# float64 references and the decode-vs-teacher-forced comparisons would read as errors; on CPU
# this changes nothing.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module. Every XLA:CPU executable keeps its
    machine code in memory mappings of its own; the whole suite in one process compiled enough
    of them to near Linux's 65530 mappings per process (vm.max_map_count): 34K at 42% of the
    suite, 46K at 53%; its last test then crashed (segmentation fault) in XLA:CPU's compiler,
    most likely when mmap failed. Freed per module, a process holds a few hundred."""
    yield
    jax.clear_caches()
    gc.collect()


# The engine tests' model: two layers, GQA 4/2, small enough to compile in seconds on CPU.
TINY_ENGINE = ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16)


def random_prompts(lengths, vocab: int = TINY_ENGINE.vocab_size, seed: int = 0) -> list:
    """One prompt of each length in ``lengths``: token ids drawn uniformly from 1..vocab-1
    (0 left out) by a NumPy generator of ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


REPO = Path(__file__).resolve().parents[1]
SIMULATED_DEVICES = 8
HF_FIXTURES = REPO / "tests" / "fixtures" / "hf"
HF_PYTHON = REPO / ".venv-hf" / "bin" / "python"


def load_script(name: str):
    """``scripts/<name>.py`` as a module, for tests that call its functions; registered in
    ``sys.modules`` under its name (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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


def run_on_simulated_devices(script: str | Path, *args: str, timeout: int = 900) -> str:
    """Runs the test file ``script`` as a script in a subprocess on ``SIMULATED_DEVICES`` CPU
    devices -> its stdout. XLA fixes the device count when it starts, and the suite's own
    process has one device; a failure fails the calling test with the script's output."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        os.environ.get("XLA_FLAGS", "") +
        f" --xla_force_host_platform_device_count={SIMULATED_DEVICES}").strip())
    proc = subprocess.run([sys.executable, str(script), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        pytest.fail(f"{Path(script).name} on {SIMULATED_DEVICES} simulated devices failed:\n"
                    f"{proc.stdout[-2000:]}{proc.stderr[-6000:]}")
    return proc.stdout


def tiny_train_config(run_dir: str | Path, **over) -> dict:
    """A `sparrow train` config of the 2-layer tiny model on the reverse task (sparse past
    layer 0): seconds a step on CPU. ``over`` replaces top-level keys."""
    from sparrow_jax.config import ModelConfig

    cfg = {
        "run_dir": str(run_dir), "steps": 2, "seed": 0, "reward": "reverse",
        "model": {"hf_config": {**ModelConfig.preset("tiny").to_hf_dict(), "vocab_size": 24,
                                "num_hidden_layers": 2}},
        "data": {"task": "reverse", "reverse": {"num_values": 8, "min_len": 2, "max_len": 4},
                 "num_train": 8, "num_eval": 2, "prompts_per_step": 2},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 6,
                    "engine": {"page_size": 4, "dense_layers": [0]}},
        "update": {"micro_batch_size": 4, "length_multiple": 16},
        "tensorboard": False, "progress": False,
    }
    return {**cfg, **over}
