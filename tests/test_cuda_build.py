"""The CUDA C kernels' libraries (pallas_kernels/cuda_build.py) where nvcc is, no GPU needed:
each builds for sm_90 alone, its kernel spills nothing, its FFI handler's symbol is there, and
a second call reuses the cached build."""

from __future__ import annotations

import ctypes
import re

import pytest

from pallas_kernels import sparse_attend_cuda, sparse_score_cuda
from pallas_kernels.cuda_build import build_library, find_nvcc

KERNELS = {"attend": (sparse_attend_cuda.SOURCE, "attend_kernel", "SparrowSparseAttend"),
           "score": (sparse_score_cuda.SOURCE, "score_kernel", "SparrowSparseScore")}


@pytest.mark.skipif(find_nvcc() is None, reason="no nvcc here to build the CUDA kernels")
@pytest.mark.parametrize("name", list(KERNELS))
def test_library_builds_without_spills_and_exports_its_handler(tmp_path, monkeypatch, name):
    source, kernel, symbol = KERNELS[name]
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path))
    lib = build_library(source, find_nvcc())
    log = lib.with_suffix(".log").read_text()
    assert len(re.findall(rf"Compiling entry function '\w*{kernel}\w*' for 'sm_90'", log)) == 1
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", log)
    assert spills and all(n == "0" for n in spills)
    assert hasattr(ctypes.CDLL(str(lib)), symbol)
    assert build_library(source, find_nvcc()) == lib and len(list(tmp_path.iterdir())) == 2
