"""The CUDA C kernels' libraries (``*.cu`` beside their Python modules): found compiler,
build on first use into a cache, and registration of their XLA FFI handlers (GPU only).

A kernel's module keeps one ``functools.cache``'d call of :func:`register` and answers
"can it run here" with :func:`hopper_missing` first: the libraries hold sm_90 code alone
(ptxas compiles each target alone, so that code is the code measured; on sm_80 the
attention spilled).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-Xptxas", "-v",
         "-diag-suppress", "940,2473", "-gencode", "arch=compute_90,code=sm_90")


def find_nvcc() -> str | None:
    """``$NVCC``, else ``nvcc`` on the PATH, else ``$CUDA_HOME/bin/nvcc``; None if none."""
    found = os.environ.get("NVCC") or shutil.which("nvcc")
    if found:
        return found
    cuda = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    return cuda if os.path.exists(cuda) else None


def _cache_dir() -> Path:
    return Path(os.environ.get("SPARROW_CACHE", Path.home() / ".cache" / "sparrow_jax"))


def defines() -> list[str]:
    """``-D`` flags for the macros named in ``$SPARROW_CUDA_DEFINES`` (space-separated, e.g.
    ``SPARROW_TRACE``: :mod:`pallas_kernels.cuda_trace`); a name that is not one raises one
    line."""
    names = os.environ.get("SPARROW_CUDA_DEFINES", "").split()
    for name in names:
        if not name.isidentifier():
            raise RuntimeError(f"SPARROW_CUDA_DEFINES: {name!r} is not a macro name")
    return [f"-D{name}" for name in names]


def build_library(source: Path, nvcc: str) -> Path:
    """``source``'s shared library, built on first use (about 10 s) for sm_90, then cached
    under ``$SPARROW_CACHE`` (default ``~/.cache/sparrow_jax``) by a key of the source, the
    compiler and its flags (:func:`defines` among them); nvcc's output (ptxas' registers and
    spills among it) beside it as ``.log``."""
    flags = [*FLAGS, *defines(), f"-I{jax.ffi.include_dir()}"]
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(source.read_bytes() + version.encode()
                         + " ".join(flags).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        built = Path(tmp) / lib.name
        cmd = [nvcc, *flags, str(source), "-o", str(built)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        log = lib.with_suffix(".log")
        log.write_text(" ".join(cmd) + "\n" + done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"building {source.name} failed (nvcc exit {done.returncode}); "
                               f"its output is in {log}")
        os.replace(built, lib)      # atomic: another process may be building the same
    return lib


def register(source: Path, symbol: str, target: str, what: str) -> str | None:
    """Builds ``source`` and registers its handler ``symbol`` as the FFI target ``target``
    for CUDA; None, or why ``what`` cannot be used (one line)."""
    nvcc = find_nvcc()
    if nvcc is None:
        return f"no nvcc found (set NVCC or CUDA_HOME) to build {what}"
    try:
        lib = ctypes.CDLL(str(build_library(source, nvcc)))
    except (OSError, RuntimeError) as e:
        return str(e).splitlines()[0]
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                platform="CUDA")
    return None


def hopper_missing() -> str | None:
    """None on an NVIDIA GPU of compute capability 9.x (H100, H200), else why not."""
    dev = jax.devices()[0]
    if dev.platform != "gpu" or "NVIDIA" not in dev.device_kind.upper():
        return f"needs an NVIDIA GPU, have {dev.device_kind}"
    if not str(getattr(dev, "compute_capability", "0")).startswith("9."):
        return f"needs compute capability 9.x (Hopper), have {dev.compute_capability}"
    return None
