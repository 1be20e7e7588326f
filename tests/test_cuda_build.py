"""The CUDA C kernels' libraries (pallas_kernels/cuda_build.py) where nvcc is, no GPU needed:
each builds for sm_90 alone, its kernel spills nothing, its FFI handler's symbol is there, and
a second call reuses the cached build. On a Hopper GPU: each kernel's own function, called first
thing in a fresh process, registers its handler itself."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys

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
    "score": """
from pallas_kernels.sparse_score_cuda import score_keys_cuda
keys = score_keys_cuda(jnp.ones((1, 8, 128), jnp.bfloat16), jnp.ones((1, 8, 128), jnp.bfloat16),
                       jnp.arange(8, dtype=jnp.int32)[None], jnp.asarray([128], jnp.int32),
                       page_size=16)
assert int((keys[0, 0] != -(2 ** 31)).sum()) == 5, keys
""",
}


@pytest.mark.skipif(sparse_score_cuda.unavailable() is not None,
                    reason=f"the CUDA kernels {sparse_score_cuda.unavailable()}")
@pytest.mark.parametrize("name", list(FIRST_CALLS))
def test_first_call_registers_its_handler(name):
    """Not through the step (whose choice of kernel registers the handler on the way): a
    notebook's direct call, as bench_decode's breakdown makes (which found it unregistered)."""
    code = "import jax.numpy as jnp\n" + FIRST_CALLS[name]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
