"""scripts/inspect_kernels.py on a CPU-only host: the sparse step lowered for an H100, compiled
by the triton package, and its cubins read back (registers, spills, SASS counts): the tool
for reading the GPU kernels' machine code without a GPU stays working."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import load_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs the triton package (its compiler and cuobjdump)")


def test_report_of_the_sparse_step(tmp_path):
    inspect_kernels = load_script("inspect_kernels")
    assert inspect_kernels.main(["--out", str(tmp_path), "--configs", "b4", "--batch", "2",
                                 "--context", "4096", "--budget", "512"]) == 0
    kernels = json.loads((tmp_path / "report.json").read_text())["kernels"]
    assert sorted(kernels) == ["kernel_b4_sparse_decode_attend_balanced",
                               "kernel_b4_sparse_decode_score",
                               "kernel_b4_sparse_decode_select"]
    for name, k in kernels.items():
        assert 0 < k["registers"] <= 255 and k["local_bytes"] == 0, (name, k)
        assert k["sass"]["instructions"] > 100 and (tmp_path / f"{name}.sass").exists()
    # The selection's threshold search is a chain of block-wide counts, each with barriers;
    # the balanced attention counts its arrivals with one atomic.
    select = kernels["kernel_b4_sparse_decode_select"]["sass"]
    assert select["BAR"] > kernels["kernel_b4_sparse_decode_score"]["sass"]["BAR"]
    assert kernels["kernel_b4_sparse_decode_attend_balanced"]["sass"]["ATOMG"] >= 1


def test_a_cuda_attention_variant_is_refused_in_one_line(tmp_path, capsys):
    inspect_kernels = load_script("inspect_kernels")
    with pytest.raises(SystemExit) as e:
        inspect_kernels.main(["--out", str(tmp_path / "k"), "--configs", "b4", "b4p0"])
    assert e.value.code == 2
    assert "--configs b4p0: the CUDA attention is nvcc's" in capsys.readouterr().err
    assert not (tmp_path / "k").exists()
