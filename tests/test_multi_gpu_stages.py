"""scripts/multi_gpu.py's stages: the two 1.7B GRPO runs never share a stage on GPUs too small
to hold both (on two 80 GB H100s the fsdp=2 run ran out of memory beside the one-GPU run, then
hung in NCCL's clique set-up until the driver killed it)."""

from __future__ import annotations

import argparse
import sys

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def multi_gpu():
    try:
        yield load_script("multi_gpu")
    finally:
        sys.modules.pop("multi_gpu", None)


def grpo_stages(multi_gpu, memory, tmp_path, monkeypatch, only=None):
    monkeypatch.setattr(multi_gpu, "gpu_memory_gib", lambda: memory)
    stages = multi_gpu.build_stages(argparse.Namespace(only=only), multi_gpu.Shapes(),
                                    tmp_path, tmp_path)
    return [sorted(i.key for i in items if i.key.startswith("grpo:")) for _, items in stages]


@pytest.mark.parametrize("memory", [79.6, 40.0])
def test_small_gpus_run_each_grpo_alone(multi_gpu, memory, tmp_path, monkeypatch):
    stages = grpo_stages(multi_gpu, memory, tmp_path, monkeypatch)
    assert [keys for keys in stages if keys] == [["grpo:one"], ["grpo:1,-1,1"]]
    only = grpo_stages(multi_gpu, memory, tmp_path, monkeypatch, only=["grpo"])
    assert only == [["grpo:one"], ["grpo:1,-1,1"]]


@pytest.mark.parametrize("memory", [None, 139.8])
def test_large_gpus_or_the_cpu_run_share_the_stage(multi_gpu, memory, tmp_path, monkeypatch):
    stages = grpo_stages(multi_gpu, memory, tmp_path, monkeypatch)
    assert [keys for keys in stages if keys] == [["grpo:1,-1,1", "grpo:one"]]


@pytest.mark.parametrize("memory, given, rows", [(79.6, None, 16), (139.8, None, 24),
                                                 (None, None, 24), (79.6, 20, 20)])
def test_rollout_rows_fit_the_gpu(multi_gpu, memory, given, rows, monkeypatch):
    """24 rows a GPU at 32K ran out of memory on 80 GB H100s; unless the rows are given, GPUs
    under 120 GiB get 16 (a CPU run, no nvidia-smi, keeps the default)."""
    monkeypatch.setattr(multi_gpu, "gpu_memory_gib", lambda: memory)
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    multi_gpu.add_shape_flags(ap)
    argv = [] if given is None else ["--rollout-rows-per-gpu", str(given)]
    assert multi_gpu.shapes_of(ap.parse_args(argv)).rollout_rows_per_gpu == rows
