"""Pallas GPU kernels launched by our own custom call, consecutive kernels as one chain with
programmatic dependent launch (Hopper's PDL) between them (GPU only; an experiment, see
notes/kernel_notes.md).

XLA launches each Pallas-Triton kernel as a node of its own and never with PDL, so every
kernel of the sparse step starts only after the previous one has drained. :func:`as_chain`
runs a function's Pallas kernels differently: it traces the function, lowers each
``pallas_call`` to Triton IR as JAX does, compiles that IR with the installed ``triton`` to a
cubin, and launches each run of consecutive kernels (only kernels, or reshapes of their
results, in between) with one FFI custom call (``cubin_chain.cc``). With ``pdl=True`` each
kernel but the first of a chain is launched with the PDL attribute and begins with
``griddepcontrol.wait`` (it reads the previous kernel's writes only after it), and each kernel
but the last begins with ``griddepcontrol.launch_dependents`` (the next may be scheduled as soon
as every program of this one is running). Everything else the function does runs as XLA ops.

The library is built with the host's C++ compiler on first use (into ``$SPARROW_CACHE`` or
``~/.cache/sparrow_jax``), against the FFI headers jaxlib ships and the ``cuda.h`` that the
triton package carries; it opens the driver with dlopen. Kernel ids are process-local: do not
put a function using this in JAX's persistent compilation cache.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

TARGET = "sparrow_cubin_chain"
SOURCE = Path(__file__).with_name("cubin_chain.cc")
# A Triton kernel whose first op is this waits for the kernel before it (PDL); one whose first
# op is the second lets the next kernel be scheduled. Their results are unused; `pure = false`
# keeps them.
_ASM = ('    %{name} = tt.elementwise_inline_asm "griddepcontrol.{op}; // $0" '
        '{{constraints = "=r", packed_element = 1 : i32, pure = false}} -> i32\n')


class Kernel(NamedTuple):
    """A ``pallas_call`` as the Triton lowering gives it: its IR and launch settings."""
    name: str
    ttir: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int


class Compiled(NamedTuple):
    """A kernel compiled to a cubin and registered with the library."""
    id: int
    name: str
    shared: int
    params: int        # kernel parameters in the cubin (the IR's pointers, then scratch)
    ptx: str


def with_grid_control(ttir: str, *, wait: bool, trigger: bool) -> str:
    """The Triton IR ``ttir`` with ``griddepcontrol`` ops at the top of its kernel."""
    lines = ttir.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("tt.func public"))
    if not lines[at].rstrip().endswith("{"):
        raise ValueError("unexpected Triton IR: the kernel's signature spans several lines")
    ops = ((_ASM.format(name="gdc_launch", op="launch_dependents") if trigger else "")
           + (_ASM.format(name="gdc_wait", op="wait") if wait else ""))
    return "".join(lines[:at + 1]) + ops + "".join(lines[at + 1:])


def lower_kernel(eqn) -> Kernel:
    """The Triton IR and launch settings of a ``pallas_call`` equation, lowered for CUDA."""
    from jax._src.pallas.triton import lowering as triton_lowering
    got = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def spy(*a, **kw):
        result = original(*a, **kw)
        got.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    avals = [v.aval for v in eqn.invars]
    triton_lowering.lower_jaxpr_to_triton_module = spy
    try:
        text = jax.jit(lambda *xs: eqn.primitive.bind(*xs, **eqn.params)).trace(
            *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]).lower(
            lowering_platforms=("cuda",)).as_text()
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = original
    grid = re.search(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32", text)
    launch = re.search(r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)
    if len(got) != 1 or not grid or not launch:
        raise ValueError(f"expected one Triton kernel in {eqn.params.get('name')}, got {len(got)}")
    return Kernel(launch.group(1), got[0], tuple(int(g) for g in grid.groups()),
                  int(launch.group(3)), int(launch.group(2)))


def compile_kernel(kernel: Kernel, *, wait: bool, trigger: bool, arch: int = 90,
                   register: bool = True) -> Compiled:
    """``kernel`` compiled by the installed triton for sm_``arch``; registered with the library
    unless ``register`` is False (id -1)."""
    import triton
    from triton.backends.compiler import GPUTarget
    ttir = with_grid_control(kernel.ttir, wait=wait, trigger=trigger)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{kernel.name}.ttir"
        path.write_text(ttir)
        out = triton.compile(str(path), target=GPUTarget("cuda", arch, 32),
                             options=dict(num_warps=kernel.num_warps,
                                          num_stages=kernel.num_stages))
    meta = out.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise ValueError(f"{kernel.name} needs Triton's global scratch, which the chain does "
                         "not allocate")
    ptx = out.asm["ptx"]
    entry = re.search(r"\.entry\s+" + re.escape(meta.name) + r"\s*\(([^)]*)\)", ptx)
    params = entry.group(1).count(".param")
    cid = -1
    if register:
        cubin = out.asm["cubin"]
        cid = library().cubin_chain_register(cubin, len(cubin), meta.name.encode(), meta.shared)
    return Compiled(cid, meta.name, int(meta.shared), params, ptx)


def _cuda_include() -> str:
    """A folder holding cuda.h: CUDA_HOME's, /usr/local/cuda's, or the one triton carries."""
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")]
    try:
        import triton
        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                       "include"))
    except ImportError:
        pass
    for folder in candidates:
        if os.path.exists(os.path.join(folder, "cuda.h")):
            return folder
    raise FileNotFoundError(f"no cuda.h in {candidates}: install triton or set CUDA_HOME")


def build(out_dir: str | None = None) -> Path:
    """Compiles ``cubin_chain.cc`` (once per source and jaxlib) and returns the library's path."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + jax.__version__.encode()).hexdigest()[:16]
    folder = Path(out_dir or os.environ.get("SPARROW_CACHE",
                                            Path.home() / ".cache" / "sparrow_jax"))
    path = folder / f"libcubin_chain-{key}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O2", "-shared", "-fPIC",
               f"-I{jax.ffi.include_dir()}", f"-I{_cuda_include()}", str(SOURCE), "-o",
               str(tmp), "-ldl"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, path)
    return path


@functools.cache
def library() -> ctypes.CDLL:
    """The built library, its FFI target registered for CUDA."""
    lib = ctypes.CDLL(str(build()))
    lib.cubin_chain_register.restype = ctypes.c_int64
    lib.cubin_chain_register.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p,
                                         ctypes.c_int64]
    jax.ffi.register_ffi_target(
        TARGET, {"initialize": jax.ffi.pycapsule(lib.cubin_chain_initialize),
                 "execute": jax.ffi.pycapsule(lib.cubin_chain_execute)}, platform="CUDA")
    return lib


@functools.cache
def _compiled(kernel: Kernel, wait: bool, trigger: bool, arch: int) -> Compiled:
    return compile_kernel(kernel, wait=wait, trigger=trigger, arch=arch)


class _Pending(NamedTuple):
    """A result of a kernel in the chain being built: its result slot, seen as ``aval``."""
    chain: int
    slot: int
    aval: object


class _Chain:
    """The kernels of one custom call as they are traced, and what they read and write."""

    def __init__(self, number: int):
        self.number = number
        self.operands: list = []
        self.results: list = []          # avals of the call's results
        self.aliases: dict[int, int] = {}
        self.launches: list = []         # (Kernel, [("arg" | "ret", index)])

    def operand(self, x, fresh=False) -> tuple[str, int]:
        if not fresh:
            for i, y in enumerate(self.operands):
                if y is x and i not in self.aliases:
                    return ("arg", i)
        self.operands.append(x)
        return ("arg", len(self.operands) - 1)

    def result(self, aval) -> int:
        self.results.append(aval)
        return len(self.results) - 1


class _Runner:
    """Evaluates a jaxpr, collecting runs of ``pallas_call`` equations into chains."""

    def __init__(self, pdl: bool, wait: bool, arch: int):
        self.pdl, self.wait, self.arch = pdl, wait, arch
        self.chain = _Chain(0)
        self.done: dict[tuple[int, int], jax.Array] = {}

    def ready(self, x):
        if not isinstance(x, _Pending):
            return x
        if x.chain == self.chain.number:
            self.flush()
        value = self.done[(x.chain, x.slot)]
        return value.reshape(x.aval.shape) if value.shape != x.aval.shape else value

    def flush(self):
        chain = self.chain
        self.chain = _Chain(chain.number + 1)
        if not chain.launches:
            return
        if self.arch is None:
            self.arch = int(jax.devices()[0].compute_capability.replace(".", ""))
        base = len(chain.operands)
        program = [len(chain.launches)]
        last = len(chain.launches) - 1
        for i, (kernel, params) in enumerate(chain.launches):
            pdl = self.pdl and len(chain.launches) > 1
            c = _compiled(kernel, pdl and self.wait and i > 0, pdl and i < last, self.arch)
            index = [j if kind == "arg" else base + j for kind, j in params]
            if c.params < len(index):
                raise ValueError(f"{c.name}: {c.params} parameters, {len(index)} buffers")
            index += [-1] * (c.params - len(index))     # Triton's scratch pointers
            program += [c.id, *kernel.grid, 32 * kernel.num_warps, c.shared,
                        int(pdl and i > 0), len(index), *index]
        outs = jax.ffi.ffi_call(
            TARGET, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in chain.results],
            input_output_aliases=chain.aliases)(*chain.operands,
                                                program=np.asarray(program, np.int64))
        for slot, value in enumerate(outs):
            self.done[(chain.number, slot)] = value

    def kernel(self, eqn, ins):
        chain = self.chain
        kernel = lower_kernel(eqn)
        aliases = dict(eqn.params.get("input_output_aliases", ()))
        params = []
        for i, x in enumerate(ins):
            if isinstance(x, _Pending) and x.chain == chain.number:
                params.append(("ret", x.slot))
            else:
                params.append(chain.operand(self.ready(x), fresh=i in aliases))
        outs = []
        for j, v in enumerate(eqn.outvars):
            into = [i for i, o in aliases.items() if o == j]
            if into:
                kind, index = params[into[0]]
                if kind == "arg":
                    slot = chain.result(v.aval)
                    chain.aliases[index] = slot
                    params[into[0]] = ("ret", slot)
                else:
                    slot = index
            else:
                slot = chain.result(v.aval)
            outs.append(_Pending(chain.number, slot, v.aval))
        chain.launches.append((kernel, params + [("ret", o.slot) for o in outs]))
        return outs

    def eval(self, jaxpr, consts, args):
        from jax._src import core
        env = {}

        def read(v):
            return v.val if isinstance(v, core.Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            if name in ("jit", "pjit"):
                inner = eqn.params["jaxpr"]
                outs = self.eval(inner.jaxpr, inner.consts, ins)
            elif name == "pallas_call":
                outs = self.kernel(eqn, ins)
            elif name == "reshape" and isinstance(ins[0], _Pending):
                outs = [ins[0]._replace(aval=eqn.outvars[0].aval)]
            else:
                params = eqn.primitive.get_bind_params(eqn.params)
                outs = eqn.primitive.bind(*map(self.ready, ins), **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]


def as_chain(fn, *, pdl: bool = True, wait: bool = True, arch: int | None = None):
    """``fn`` with its Pallas GPU kernels launched by this module's custom call, each run of
    consecutive kernels as one chain (PDL between them if ``pdl``). Same arguments and result
    as ``fn``; use under ``jax.jit``. ``wait=False``: no ``griddepcontrol.wait``, for kernels
    that wait for each other's results themselves (``GpuDecodeTuning(flags=True)``); any
    other kernel would then read its inputs before they are written. ``arch``: the GPU's
    compute capability as an integer (default: the first device's)."""
    def run(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        runner = _Runner(pdl, wait, arch)
        outs = runner.eval(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), [runner.ready(x) for x in outs])

    return run
