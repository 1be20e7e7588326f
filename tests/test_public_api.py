"""The public names (README.md, "Using it") resolve lazily; importing the package stays cheap."""

import subprocess
import sys

import sparrow_jax

PUBLIC_NAMES = ("load_qwen3", "sparse_decode", "acceptance_rate", "tail_statistic",
                "BudgetSchedule", "rollout_cost_dense", "rollout_cost_sparse", "generate")


def test_every_export_resolves():
    assert set(PUBLIC_NAMES) <= set(sparrow_jax.__all__)
    for name in sparrow_jax.__all__:
        assert getattr(sparrow_jax, name) is not None, name


def test_import_does_not_load_jax():
    code = "import sys, sparrow_jax; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
