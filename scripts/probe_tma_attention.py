"""Probe: does a TMA page gather pay in the sparse attention? (GPU; issue 18's open route.)

jaxlib launches Triton kernels with a null global scratch pointer, so a kernel that builds a
TMA descriptor on the device (``tl.make_tensor_descriptor``) cannot run through jax-triton.
This probe launches Triton kernels itself: ``cubin_chain.cc`` (an XLA FFI custom call that
launches registered cubins on XLA's stream) with a scratch buffer of the size Triton asks for
passed as one of the call's results. Two attention kernels of the same structure (grid rows x
splits, online softmax over a row's page list, partial results merged in XLA) differ only in
how a page reaches the SM: ``ptr``, the Triton path's ``attend_kernel`` (computed pointers,
BP pages a step); ``tma``, one TMA copy of a 4 KB page of K and of V, STAGES deep in Triton's
pipeline. Each is checked against a float64 NumPy reference, then timed by the marginal of a
chain (the calls alias their outputs, so XLA neither merges nor reorders them) against the
read ceiling timed alike.

    PYTHONPATH=. python3 scripts/probe_tma_attention.py --batches 32 8 1 --out $OUT/tma.json

``--compile-only`` compiles every variant for sm_90 and prints its registers, shared memory
and scratch (no GPU needed).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pallas_kernels.paged_attend_gpu import merge_splits, sm_count  # noqa: E402
from pallas_kernels.triton_decode_kernels import MASK_VALUE, attend_kernel  # noqa: E402
from sparrow_jax.benchmarking import marginal_seconds, read_ceiling, write_record  # noqa: E402

TARGET = "sparrow_probe_cubin_chain"
SOURCE = Path(__file__).with_name("cubin_chain.cc")
HKV, HQ, D, P = 8, 32, 128, 16
R, RPAD = HQ // HKV, 16


@triton.jit
def attend_tma(q_ptr, k_ptr, v_ptr, phys_ptr, slot_ptr, count_ptr, len_ptr, o_ptr, m_ptr,
               l_ptr, HKV: tl.constexpr, HQ: tl.constexpr, R: tl.constexpr,
               RPAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
               MAXP: tl.constexpr, BP: tl.constexpr, S: tl.constexpr, SCALE: tl.constexpr,
               STAGES: tl.constexpr, WS: tl.constexpr):
    """``attend_kernel`` with each page of K and V fetched by one TMA copy (a [P, D] box of
    the pool seen as [HKV * N * P, D]); BP pages a loop step, each its own softmax update."""
    row = tl.program_id(0)
    s = tl.program_id(1)
    b = row // HKV
    h = row % HKV
    count = tl.load(count_ptr + row)
    length = tl.load(len_ptr + b)
    blocks = tl.cdiv(count, BP)
    per_split = tl.cdiv(blocks, S)
    start = s * per_split
    stop = tl.minimum(start + per_split, blocks)
    r = tl.arange(0, RPAD)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * HQ + h * R + r)[:, None] * D + d[None, :], mask=(r < R)[:, None],
                other=0.0)
    kd = tl.make_tensor_descriptor(k_ptr, shape=[HKV * N * P, D], strides=[D, 1],
                                   block_shape=[P, D])
    vd = tl.make_tensor_descriptor(v_ptr, shape=[HKV * N * P, D], strides=[D, 1],
                                   block_shape=[P, D])
    tok = tl.arange(0, P)
    o = tl.zeros((RPAD, D), tl.float32)
    m = tl.full((RPAD,), MASK_VALUE, tl.float32)
    l = tl.zeros((RPAD,), tl.float32)
    for i in tl.range(start, stop, num_stages=STAGES, warp_specialize=WS):
        for j in tl.static_range(BP):
            entry = i * BP + j
            listed = entry < count
            phys = tl.load(phys_ptr + row * MAXP + entry, mask=listed, other=0)
            slot = tl.load(slot_ptr + row * MAXP + entry, mask=listed, other=0)
            base = (h * N + phys) * P
            k = kd.load([base, 0])
            v = vd.load([base, 0])
            logits = tl.dot(q, tl.trans(k))
            ok = listed & (slot * P + tok < length)
            logits = tl.where(ok[None, :], logits * SCALE, MASK_VALUE)
            m_new = tl.maximum(m, tl.max(logits, axis=1))
            corr = tl.exp(m - m_new)
            p = tl.exp(logits - m_new[:, None])
            l = corr * l + tl.sum(p, axis=1)
            o = corr[:, None] * o + tl.dot(p.to(v.dtype), v)
            m = m_new
    part = row * S + s
    tl.store(o_ptr + (part * RPAD + r)[:, None] * D + d[None, :], o)
    tl.store(m_ptr + part * RPAD + r, m)
    tl.store(l_ptr + part * RPAD + r, l)


ARGS = (("q_ptr", "*bf16"), ("k_ptr", "*bf16"), ("v_ptr", "*bf16"), ("phys_ptr", "*i32"),
        ("slot_ptr", "*i32"), ("count_ptr", "*i32"), ("len_ptr", "*i32"), ("o_ptr", "*fp32"),
        ("m_ptr", "*fp32"), ("l_ptr", "*fp32"))


class Variant(NamedTuple):
    kind: str          # "ptr" or "tma"
    bp: int
    warps: int
    stages: int
    ws: bool = False

    @property
    def label(self):
        return f"{self.kind}_bp{self.bp}_w{self.warps}_s{self.stages}" + ("_ws" if self.ws else "")


class Compiled(NamedTuple):
    id: int
    name: str
    shared: int
    params: int
    scratch: int       # global scratch bytes a program
    regs: int
    spills: int


def compile_variant(v: Variant, n_pages: int, maxp: int, splits: int, arch: int = 90,
                    register: bool = True) -> Compiled:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    const = dict(HKV=HKV, HQ=HQ, R=R, RPAD=RPAD, D=D, P=P, N=n_pages, MAXP=maxp, BP=v.bp,
                 S=splits, SCALE=D ** -0.5)
    if v.kind == "tma":
        const.update(STAGES=v.stages, WS=v.ws)
        fn = attend_tma
    else:
        const.update(IEEE=False)
        fn = attend_kernel
    sig = dict(ARGS) | {k: "constexpr" for k in const}
    names = list(sig)
    src = ASTSource(fn, sig, constexprs={(names.index(k),): c for k, c in const.items()})
    out = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                         options=dict(num_warps=v.warps, num_stages=v.stages))
    meta = out.metadata
    ptx = out.asm["ptx"]
    entry = re.search(r"\.entry\s+" + re.escape(meta.name) + r"\s*\(([^)]*)\)", ptx)
    params = entry.group(1).count(".param")
    cid = -1
    if register:
        cubin = out.asm["cubin"]
        cid = library().cubin_chain_register(cubin, len(cubin), meta.name.encode(), meta.shared)
        try:
            out._init_handles()     # loads the cubin through Triton's driver: its registers
        except Exception:  # noqa: BLE001 - registers are only reported
            pass
    return Compiled(cid, meta.name, int(meta.shared), params,
                    int(getattr(meta, "global_scratch_size", 0) or 0),
                    int(getattr(out, "n_regs", -1) or -1), int(getattr(out, "n_spills", -1)))


def _cuda_include() -> str:
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
    for f in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include"), folder):
        if os.path.exists(os.path.join(f, "cuda.h")):
            return f
    raise FileNotFoundError("no cuda.h")


@functools.cache
def library() -> ctypes.CDLL:
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"libprobe_cubin_chain_{os.getpid()}.so"
    cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O2", "-shared", "-fPIC",
           f"-I{jax.ffi.include_dir()}", f"-I{_cuda_include()}", str(SOURCE), "-o", str(path),
           "-ldl"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"building {SOURCE.name} failed:\n{done.stderr[-4000:]}")
    lib = ctypes.CDLL(str(path))
    lib.cubin_chain_register.restype = ctypes.c_int64
    lib.cubin_chain_register.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p,
                                         ctypes.c_int64]
    jax.ffi.register_ffi_target(
        TARGET, {"initialize": jax.ffi.pycapsule(lib.cubin_chain_initialize),
                 "execute": jax.ffi.pycapsule(lib.cubin_chain_execute)}, platform="CUDA")
    return lib


def attention_call(c: Compiled, warps: int, grid: tuple[int, int]):
    """``run(carry, q, k, v, phys, slot, count, lengths) -> carry``, carry = (o, m, l,
    scratch), each written in place (aliased), so chained calls depend on each other."""
    # Operands: carry (4), then the 7 inputs; results: the carry again.
    params = [4, 5, 6, 7, 8, 9, 10, 11 + 0, 11 + 1, 11 + 2]
    params += [11 + 3 if c.scratch else -1]        # Triton's global scratch
    params += [-1] * (c.params - len(params))       # its profile scratch
    program = np.asarray([1, c.id, grid[0], grid[1], 1, 32 * warps, c.shared, 0,
                          len(params), *params], np.int64)

    def run(carry, *inputs):
        return tuple(jax.ffi.ffi_call(
            TARGET, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in carry],
            input_output_aliases={i: i for i in range(4)})(*carry, *inputs, program=program))
    return run


def pallas_call(name: str, batch: int, budget_pages: int):
    """The Pallas attention (the sparse step's default ``balanced``, or ``even`` splits) on
    the probe's inputs, merge included: ``run(q, k, v, phys, slot, count, lengths) -> out``
    ``[B, Hq, D]``, q's shape and dtype, so that chained calls feed each other."""
    from pallas_kernels.paged_attend_gpu import attend_page_lists
    from pallas_kernels.sparse_decode_gpu import GpuDecodeTuning
    tuning = GpuDecodeTuning(balanced=name == "balanced").resolve(
        page_size=P, batch=batch, kv_heads=HKV, max_pages=budget_pages)

    def run(q, k, v, phys, slot, count, lengths):
        return attend_page_lists(q, k, v, phys.reshape(batch, HKV, -1),
                                 slot.reshape(batch, HKV, -1), count.reshape(batch, HKV, 1),
                                 lengths, page_size=P, tuning=tuning)
    return run


def make_case(batch: int, context: int, budget_pages: int, seed: int = 0):
    """K and V pools of ``batch`` sequences of ``context`` tokens, and each (row, KV head)'s
    page list: page 0, the last two and random others, ``budget_pages`` in page order."""
    rng = np.random.default_rng(seed)
    per_seq = context // P
    n = batch * per_seq
    key = jax.random.key(seed)
    kk, kv, kq = jax.random.split(key, 3)
    k = jax.random.normal(kk, (HKV, n, P, D), jnp.bfloat16)
    v = jax.random.normal(kv, (HKV, n, P, D), jnp.bfloat16)
    q = jax.random.normal(kq, (batch, HQ, D), jnp.bfloat16)
    rows = batch * HKV
    slots = np.zeros((rows, budget_pages), np.int32)
    for row in range(rows):
        middle = rng.choice(np.arange(1, per_seq - 2), budget_pages - 3, replace=False)
        slots[row] = np.sort(np.concatenate([[0, per_seq - 2, per_seq - 1], middle]))
    seq = np.arange(rows) // HKV
    phys = (seq[:, None] * per_seq + slots).astype(np.int32)    # a row's table is contiguous
    count = np.full((rows,), budget_pages, np.int32)
    lengths = np.full((batch,), context - 5, np.int32)          # the last page part full
    return dict(q=q, k=k, v=v, phys=jnp.asarray(phys), slot=jnp.asarray(slots),
                count=jnp.asarray(count), lengths=jnp.asarray(lengths))


def reference(case, rows_checked) -> np.ndarray:
    """float64 attention ``[len(rows_checked), R, D]`` of the listed pages' valid tokens."""
    k = np.asarray(case["k"].astype(jnp.float32), np.float64)
    v = np.asarray(case["v"].astype(jnp.float32), np.float64)
    q = np.asarray(case["q"].astype(jnp.float32), np.float64)
    phys, slot = np.asarray(case["phys"]), np.asarray(case["slot"])
    lengths = np.asarray(case["lengths"])
    out = []
    for row in rows_checked:
        b, h = divmod(row, HKV)
        kk = k[h, phys[row]].reshape(-1, D)
        vv = v[h, phys[row]].reshape(-1, D)
        pos = (slot[row][:, None] * P + np.arange(P)[None, :]).reshape(-1)
        logits = q[b, h * R:(h + 1) * R] @ kk.T * D ** -0.5
        logits = np.where(pos[None, :] < lengths[b], logits, -np.inf)
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        out.append((w / w.sum(axis=1, keepdims=True)) @ vv)
    return np.stack(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 8, 1])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget-pages", type=int, default=128)
    ap.add_argument("--variants", nargs="+", default=[
        "ptr_bp4_w2_s1", "ptr_bp4_w4_s2", "tma_bp1_w4_s3", "tma_bp1_w4_s5", "tma_bp2_w4_s3",
        "tma_bp1_w2_s4", "tma_bp4_w4_s2", "tma_bp1_w4_s3_ws"])
    ap.add_argument("--pallas", nargs="*", default=["balanced", "even"],
                    help="the Pallas attention kernels timed beside (merge included)")
    ap.add_argument("--splits", type=int, nargs="*", default=None,
                    help="splits a list at each batch (default: ~4 programs an SM)")
    ap.add_argument("--chain", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()

    def parse(label):
        label, _, splits = label.partition("@")
        parts = label.split("_")
        return Variant(parts[0], int(parts[1][2:]), int(parts[2][1:]), int(parts[3][1:]),
                       len(parts) > 4 and parts[4] == "ws"), int(splits or 0)
    variants = [parse(x)[0] for x in args.variants]
    sms = 132 if args.compile_only else sm_count()
    rows_all = {b: b * HKV for b in args.batches}
    results = []
    ceiling = None if args.compile_only else read_ceiling(marginal=True)
    if ceiling:
        print(f"read ceiling, marginal {ceiling:.0f} GB/s", flush=True)
    for bi, batch in enumerate(args.batches):
        rows = rows_all[batch]
        splits = (args.splits[bi] if args.splits else
                  max(1, min(args.budget_pages // 4, (4 * sms) // rows)))
        n_pages = batch * (args.context // P)
        if args.compile_only:
            for v in variants:
                try:
                    c = compile_variant(v, n_pages, args.budget_pages, splits, register=False)
                    print(batch, v.label, c._replace(id=None, name=None), flush=True)
                except Exception as e:  # noqa: BLE001 - a probe: report and go on
                    print(batch, v.label, "FAILED", str(e).splitlines()[-1][:300], flush=True)
            continue
        case = make_case(batch, args.context, args.budget_pages)
        inputs = [case[x] for x in ("q", "k", "v", "phys", "slot", "count", "lengths")]
        checked = sorted({0, rows - 1, rows // 2})
        ref = reference(case, checked)
        nbytes = rows * args.budget_pages * 2 * P * D * 2
        for name in args.pallas:
            t = marginal_seconds(pallas_call(name, batch, args.budget_pages), inputs,
                                 args.chain, args.repeats)
            got = np.asarray(pallas_call(name, batch, args.budget_pages)(*inputs)
                             .astype(jnp.float32)).reshape(rows, R, D)[checked]
            err = float(np.max(np.abs(got - ref)))
            rec = dict(batch=batch, variant=name, us=t * 1e6, gb_s=nbytes / t / 1e9,
                       of_ceiling=nbytes / t / 1e9 / ceiling, max_abs_err=err)
            results.append(rec)
            print(f"b{batch:<3} {name:22s} {'':10s} {t * 1e6:8.1f} us "
                  f"{rec['of_ceiling']:6.1%} of ceiling  err {err:.2e}", flush=True)
        for label in args.variants:
            v, vsplits = parse(label)
            vsplits = vsplits or splits
            try:
                c = compile_variant(v, n_pages, args.budget_pages, vsplits)
            except Exception as e:  # noqa: BLE001
                print(batch, v.label, "compile FAILED", str(e).splitlines()[-1][:300])
                continue
            run = attention_call(c, v.warps, (rows, vsplits))
            carry = (jnp.zeros((batch, HKV, vsplits, RPAD, D), jnp.float32),
                     jnp.zeros((batch, HKV, vsplits, RPAD), jnp.float32),
                     jnp.zeros((batch, HKV, vsplits, RPAD), jnp.float32),
                     jnp.zeros((max(c.scratch, 1) * rows * vsplits,), jnp.uint8))
            o, m, l, _ = jax.jit(run)(carry, *inputs)
            got = np.asarray(merge_splits(o, m, l, R)).reshape(rows, R, D)[checked]
            err = float(np.max(np.abs(got - ref)))
            t = marginal_seconds(lambda cy, *xs: run(cy, *xs), (carry, *inputs),
                                 args.chain, args.repeats)
            rec = dict(batch=batch, variant=label, splits=vsplits, us=t * 1e6,
                       gb_s=nbytes / t / 1e9, of_ceiling=nbytes / t / 1e9 / ceiling,
                       max_abs_err=err, regs=c.regs, spills=c.spills, shared=c.shared,
                       scratch=c.scratch)
            results.append(rec)
            print(f"b{batch:<3} {label:22s} splits {vsplits:3d} {t * 1e6:8.1f} us "
                  f"{rec['of_ceiling']:6.1%} of ceiling  err {err:.2e}  regs {c.regs} "
                  f"smem {c.shared}", flush=True)
    if args.out:
        write_record(args.out, ceiling_gb_s=ceiling, context=args.context,
                     budget_pages=args.budget_pages, results=results)


if __name__ == "__main__":
    main()
