"""The CUDA attention's library (pallas_kernels/cuda_build.py) where nvcc is, no GPU needed: it
builds for sm_90 alone, its kernels spill nothing, its FFI handlers' symbols are there, and a
second call reuses the cached build. On a Hopper GPU: the kernel's own function, called first
thing in a fresh process, registers its handler itself."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys

import pytest

from pallas_kernels import sparse_attend_cuda
from pallas_kernels.cuda_build import build_library, find_nvcc


@pytest.mark.skipif(find_nvcc() is None, reason="no nvcc here to build the CUDA attention")
def test_library_builds_without_spills_and_exports_its_handler(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path))
    lib = build_library(sparse_attend_cuda.SOURCE, find_nvcc())
    log = lib.with_suffix(".log").read_text()
    # Each of the kernel's four instantiations (with or without the cluster merge, and the
    # choice of pages inside) once, for sm_90 alone.
    entries = re.findall(r"Compiling entry function '(\w*attend_kernel\w*)' for '(\w+)'", log)
    assert len(entries) == len({name for name, _ in entries}) == 4
    assert {arch for _, arch in entries} == {"sm_90"}
    # The selection kernel alone: two blocks of 256 threads an SM fit its registers; the
    # scoring and selection kernel: four.
    for kernel, most in (("select_kernel", 128), ("score_select_kernel", 64)):
        used = re.search(rf"entry function '\w*?\d{kernel}\w*' for 'sm_90'\n(?:.*\n){{0,3}}?"
                         r".*Used (\d+) registers", log)
        assert used and int(used.group(1)) <= most, kernel
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", log)
    assert spills and all(n == "0" for n in spills)
    assert all(hasattr(ctypes.CDLL(str(lib)), name)
               for name in ("SparrowSparseAttend", "SparrowSparseSelectAttend",
                            "SparrowSparseSelectLists", "SparrowSparseSelectListsAttend",
                            "SparrowSparseScoreSelectAttend"))
    assert build_library(sparse_attend_cuda.SOURCE, find_nvcc()) == lib
    assert len(list(tmp_path.iterdir())) == 2


FIRST_CALL = """
import jax.numpy as jnp
from pallas_kernels.sparse_attend_cuda import attend_page_lists_cuda
q = jnp.ones((1, 8, 128), jnp.bfloat16)
pages = jnp.ones((1, 4, 16, 128), jnp.bfloat16)
lists = jnp.zeros((1, 1, 4), jnp.int32)
out = attend_page_lists_cuda(q, pages, pages, lists, lists, jnp.ones((1, 1, 1), jnp.int32),
                             jnp.asarray([16], jnp.int32))
assert bool(jnp.all(out == 1)), out
"""


@pytest.mark.skipif(sparse_attend_cuda.unavailable() is not None,
                    reason=f"the CUDA attention {sparse_attend_cuda.unavailable()}")
def test_first_call_registers_its_handler():
    """Not through the step (whose choice of kernel registers the handler on the way): a
    notebook's direct call, as bench_decode's breakdown makes (which found a kernel's handler
    unregistered, run AO)."""
    done = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
