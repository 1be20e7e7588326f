"""The CUDA C kernels' libraries (pallas_kernels/cuda_build.py) where nvcc is, no GPU needed:
each builds for sm_90 alone, its kernels spill nothing, its FFI handler's symbol is there, and
a second call reuses the cached build. On a Hopper GPU: each kernel's own function, called
first thing in a fresh process, registers its handler itself."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys

import pytest

from pallas_kernels import sparse_attend_cuda, sparse_select_cuda
from pallas_kernels.cuda_build import build_library, find_nvcc

# name: (source, kernel name in ptxas' log, its instances, handler symbol)
KERNELS = {"attend": (sparse_attend_cuda.SOURCE, "attend_kernel", 1, "SparrowSparseAttend"),
           "select": (sparse_select_cuda.SOURCE, "select_kernel", 7, "SparrowSparseSelect")}


@pytest.mark.skipif(find_nvcc() is None, reason="no nvcc here to build the CUDA kernels")
@pytest.mark.parametrize("name", list(KERNELS))
def test_library_builds_without_spills_and_exports_its_handler(tmp_path, monkeypatch, name):
    source, kernel, instances, symbol = KERNELS[name]
    monkeypatch.setenv("SPARROW_CACHE", str(tmp_path))
    lib = build_library(source, find_nvcc())
    log = lib.with_suffix(".log").read_text()
    assert len(re.findall(rf"Compiling entry function '\w*{kernel}\w*' for 'sm_90'",
                          log)) == instances
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", log)
    assert len(spills) == 2 * instances and all(n == "0" for n in spills)
    assert hasattr(ctypes.CDLL(str(lib)), symbol)
    assert build_library(source, find_nvcc()) == lib
    assert len(list(tmp_path.iterdir())) == 2


FIRST_CALLS = {
    "attend": """
from pallas_kernels.sparse_attend_cuda import attend_page_lists_cuda
q = jnp.ones((1, 8, 128), jnp.bfloat16)
pages = jnp.ones((1, 4, 16, 128), jnp.bfloat16)
lists = jnp.zeros((1, 1, 4), jnp.int32)
out = attend_page_lists_cuda(q, pages, pages, lists, lists, jnp.ones((1, 1, 1), jnp.int32),
                             jnp.asarray([16], jnp.int32))
assert bool(jnp.all(out == 1)), out
""",
    "select": """
from pallas_kernels.sparse_select_cuda import select_from_keys_cuda
# 8 pages: slots 1-5 eligible (the scoring's INT_MIN elsewhere), slot 5 the largest key
keys = jnp.asarray([[[-2 ** 31, 1, 2, 3, 4, 5, -2 ** 31, -2 ** 31]]], jnp.int32)
phys, slots, count, _ = select_from_keys_cuda(keys, 10 + jnp.arange(8, dtype=jnp.int32)[None],
                                              jnp.asarray([128]), jnp.asarray([4]),
                                              page_size=16, max_pages=4, kpad=4)
assert slots[0, 0, :4].tolist() == [0, 5, 6, 7] and int(count[0, 0, 0]) == 4, slots
assert phys[0, 0, :4].tolist() == [10, 15, 16, 17], phys
""",
}


@pytest.mark.skipif(sparse_attend_cuda.unavailable() is not None,
                    reason=f"the CUDA kernels {sparse_attend_cuda.unavailable()}")
@pytest.mark.parametrize("name", list(FIRST_CALLS))
def test_first_call_registers_its_handler(name):
    """Not through the step (whose choice of kernel registers the handler on the way): a
    notebook's direct call, as bench_decode's breakdown makes (which found a kernel's handler
    unregistered, run AO)."""
    done = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp\n" + FIRST_CALLS[name]],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
