"""The Triton sparse decode kernels (pallas_kernels/triton_decode_kernels.py, launched as planned
by pallas_kernels/sparse_decode_triton.py) against the float64 NumPy reference of
docs/design.md, section 3 (tests/reference_np.py), on the cases of tests/test_sparse_kernel.py.

On a GPU the launches go through jax-triton. On CPU the same launches run in Triton's
interpreter (``TRITON_INTERPRET=1``) on NumPy arrays; that needs the ``triton`` package (not a
dependency of the CPU install: ``pip install triton==3.6.0``), and the tests skip without it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_decode_triton import (SUMMARIES, TritonDecodeTuning, plan,
                                                 run_launches, sparse_decode_triton)
from pallas_kernels.paged_attend_gpu import merge_splits
from sparrow_jax.attention.sparse import sparse_decode
from reference_np import (KERNEL_BUDGETS, KERNEL_LENGTHS, assert_kernel_close, select_pages_np,
                          sparse_decode_np)
from test_sparse_kernel import P, as64, make_case, reference

ON_GPU = jax.default_backend() == "gpu"
kernels_run = pytest.mark.skipif(
    not ON_GPU and importlib.util.find_spec("triton") is None,
    reason="no GPU here, and no triton package for Triton's interpreter (pip install "
           "triton==3.6.0 to run these kernels on CPU)")
if not ON_GPU:
    # Read when @triton.jit wraps the kernels: set before their module is imported.
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True, scope="module")
def _interpreter_fixes():
    """Two gaps of Triton 3.6's interpreter, filled while these tests run: it turns a scalar
    into a Python int (a loop bound) by ``int(array)``, which NumPy 2.5 refuses for the
    1-element arrays its scalars are (read the element instead); and its ``tl.dot`` multiplies
    bf16 operands as their raw uint16 bits (widen them to float32 first: exact, as the GPU's
    bf16 products accumulated in float32 are)."""
    if ON_GPU or importlib.util.find_spec("triton") is None:
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter
    patch_lang = interpreter._patch_lang
    dot = interpreter.InterpreterBuilder.create_dot

    def patched_lang(fn):
        scope = patch_lang(fn)
        scope.set_attr(tl.core.tensor, "__index__",
                       lambda self: int(self.handle.data.reshape(-1)[0]))
        return scope

    def widened(h):
        if h.dtype != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32),
                                        tl.float32)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_patch_lang", patched_lang)
        mp.setattr(interpreter.InterpreterBuilder, "create_dot",
                   lambda self, a, b, *rest: dot(self, widened(a), widened(b), *rest))
        yield


class _HostTensor:
    """A NumPy array as Triton's interpreter takes a CPU torch tensor: a data pointer, a dtype
    name, and a storage that is the array itself (so the kernels write into it)."""

    def __init__(self, a: np.ndarray):
        assert a.flags.c_contiguous
        self.a = a
        self.dtype = f"torch.{a.dtype.name}"

    def data_ptr(self):
        return self.a.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def new_empty(self, *_, **__):
        return self

    def set_(self, *_):
        return self

    def copy_(self, _):
        return self

    def storage_offset(self):
        return 0

    def size(self):
        return self.a.shape

    def stride(self):
        return tuple(s // self.a.itemsize for s in self.a.strides)


def run_interpreted(launches, buffers):
    """:func:`run_launches` in Triton's interpreter, on NumPy copies of the buffers."""
    from pallas_kernels import triton_decode_kernels as kernels
    buf = {k: np.ascontiguousarray(np.asarray(v)) for k, v in buffers.items()}
    for launch in launches:
        outs = [np.zeros(shape, dtype) for _, shape, dtype in launch.outputs]
        getattr(kernels, launch.kernel)[launch.grid](
            *(_HostTensor(buf[name]) for name in launch.inputs), *map(_HostTensor, outs),
            **dict(launch.constants))
        buf.update(zip((name for name, _, _ in launch.outputs), outs))
    return buf


def run(q, k, v, summaries, table, lengths, budgets, *, max_pages=None,
        tuning=TritonDecodeTuning()):
    """Every buffer of one step (page lists, partial results) and its output ``[B, Hq, D]``;
    ``summaries`` the centroids, or Quest's pair (kmin, kmax)."""
    b, hq, d = q.shape
    hkv, n_total = k.shape[:2]
    max_pages = max_pages or table.shape[1]
    cdt = jnp.promote_types(q.dtype, k.dtype)
    scorer = "quest" if isinstance(summaries, tuple) else "centroid"
    launches = plan(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, pages_total=n_total,
                    page_size=P, table_width=table.shape[1], max_pages=max_pages,
                    compute_dtype=cdt, tuning=tuning, scorer=scorer)
    named = zip(SUMMARIES[scorer], summaries if scorer == "quest" else (summaries,))
    buffers = dict(q=jnp.asarray(q).astype(cdt), k=k, v=v, **dict(named),
                   table=jnp.asarray(table, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32),
                   budgets=jnp.asarray(budgets, jnp.int32))
    buf = (jax.jit(lambda bufs: run_launches(launches, bufs))(buffers) if ON_GPU
           else run_interpreted(launches, buffers))
    out = merge_splits(*(jnp.asarray(buf[x]) for x in "oml"), hq // hkv).astype(q.dtype)
    return buf, out


def check(rng, *, lengths, budgets, hkv, r, d, dtype, tuning=TritonDecodeTuning()):
    q, k, v, cent, table, lengths = make_case(rng, lengths=lengths, hkv=hkv, r=r, d=d,
                                              dtype=dtype)
    budgets = jnp.asarray(budgets, jnp.int32)
    buf, out = run(q, k, v, cent, table, lengths, budgets, tuning=tuning)
    want, pages = reference(q, k, v, cent, table, lengths, budgets)
    assert lists(buf) == pages
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_kernel_close(as64(out), want, low_precision=dtype == jnp.bfloat16)
    if ON_GPU:
        # The public entry point runs the same launches; only the split merge may round
        # differently (XLA fuses it with the launches inside one jit there; H100: 1 ulp).
        public = as64(sparse_decode_triton(q, k, v, table, lengths, budgets, page_size=P,
                                           centroids=cent, tuning=tuning))
        ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -22
        np.testing.assert_allclose(public, as64(out), rtol=ulp, atol=1e-7)


def lists(buf):
    """{(b, h): chosen slots in order} from the page lists of one step."""
    count, slots = np.asarray(buf["count"]), np.asarray(buf["slots"])
    hkv = buf["o"].shape[1]
    return {(row // hkv, row % hkv): slots[row, :count[row]].tolist()
            for row in range(len(count))}


@kernels_run
@pytest.mark.parametrize("r,d,dtype", [(1, 64, jnp.float32), (5, 128, jnp.float32),
                                       (4, 128, jnp.bfloat16), (8, 64, jnp.bfloat16)])
def test_matches_float64_reference(r, d, dtype):
    rng = np.random.default_rng(r * 1000 + d)
    check(rng, lengths=KERNEL_LENGTHS, budgets=KERNEL_BUDGETS, hkv=2, r=r, d=d, dtype=dtype)


@kernels_run
@pytest.mark.parametrize("r,d,dtype", [(5, 128, jnp.float32), (2, 64, jnp.bfloat16)])
def test_quest_matches_float64_reference(r, d, dtype):
    """scorer="quest": each page's bound from its elementwise min and max of keys, the largest
    over the group's heads; lists page for page and output against the float64 reference,
    which scores from the keys themselves."""
    rng = np.random.default_rng(r * 100 + d)
    q, k, v, _, table, lengths = make_case(rng, lengths=KERNEL_LENGTHS, hkv=2, r=r, d=d,
                                           dtype=dtype)
    budgets = jnp.asarray(KERNEL_BUDGETS, jnp.int32)
    minmax = (jnp.min(k, axis=2), jnp.max(k, axis=2))
    buf, out = run(q, k, v, minmax, table, lengths, budgets)
    want, pages = sparse_decode_np(as64(q), as64(k), as64(v), np.asarray(table),
                                   np.asarray(lengths), np.asarray(budgets), page_size=P,
                                   scorer="quest", return_pages=True)
    assert lists(buf) == pages
    assert_kernel_close(as64(out), want, low_precision=dtype == jnp.bfloat16)
    if ON_GPU:
        public = sparse_decode(q, k, v, table, lengths, budgets, page_size=P, scorer="quest",
                               impl="triton")
        assert_kernel_close(as64(public), want, low_precision=dtype == jnp.bfloat16)


@kernels_run
@pytest.mark.parametrize("tuning", [
    TritonDecodeTuning(histogram=False, block_pages=2, splits=5, score_chunk=16),
    TritonDecodeTuning(block_pages=8, splits=1, score_chunk=128, select_warps=4),
    TritonDecodeTuning(histogram=False, splits=3, score_chunk=32)])
def test_settings_do_not_change_the_result(tuning):
    """Both threshold searches, block sizes, splits (also ones that leave some empty), scoring
    chunks and warps are tuning only."""
    rng = np.random.default_rng(7)
    check(rng, lengths=[700, 33, 260], budgets=[17, 5, 9], hkv=1, r=3, d=64,
          dtype=jnp.float32, tuning=tuning)


@kernels_run
@pytest.mark.parametrize("tuning", [TritonDecodeTuning(),
                                    TritonDecodeTuning(histogram=False)])
def test_ties_and_signs_order_as_the_reference(tuning):
    """Scores with many exact ties and both zeros (-0.0 equal to 0.0): every budget from the
    minimum to all pages picks the reference's pages (ties to the lower page index)."""
    d = 16
    vals = [0.0, -3.0, -0.0, 1.5, -1.0, 0.0, -0.0, 2.5, -7.0, 9.0, 0.0, 0.0, 2.5, 2.5, -1.0,
            1.5, 0.0, -0.0]
    n = len(vals)
    cent = np.zeros((1, n, d), np.float32)
    cent[0, :, 0] = vals
    q = np.zeros((1, 1, d), np.float32)
    q[0, 0, 0] = 1.0
    budgets = np.arange(3, n + 1, dtype=np.int32)                 # one row per budget
    rows = len(budgets)
    pages = jnp.zeros((1, n, P, d), jnp.float32)
    buf, _ = run(jnp.asarray(np.repeat(q, rows, 0)), pages, pages, jnp.asarray(cent),
                 np.tile(np.arange(n, dtype=np.int32), (rows, 1)), np.full(rows, n * P),
                 budgets, tuning=tuning)
    got = lists(buf)
    scores = np.full(n, -np.inf)
    scores[1:n - 2] = cent[0, 1:n - 2, 0]                         # qbar = e_0
    for i, budget in enumerate(budgets):
        assert got[i, 0] == select_pages_np(scores, n, int(budget)), budget


@kernels_run
def test_zero_length_row_gives_zeros():
    """A row of length 0 (padding inside jit) attends to nothing and returns zeros, not NaN."""
    rng = np.random.default_rng(3)
    q, k, v, cent, table, _ = make_case(rng, lengths=[40, 40], hkv=1, r=2, d=64,
                                        dtype=jnp.float32)
    buf, out = run(q, k, v, cent, table, [40, 0], [3, 3])
    assert np.asarray(buf["count"]).tolist() == [3, 0]
    out = np.asarray(out)
    assert np.isfinite(out).all() and (out[1] == 0).all() and (out[0] != 0).any()


@pytest.mark.parametrize("change,match", [(dict(block_pages=3), "block_pages"),
                                          (dict(splits=0), "splits"),
                                          (dict(score_chunk=8), "score_chunk"),
                                          (dict(select_warps=3), "select_warps"),
                                          (dict(attend_stages=0), "attend_stages")])
def test_bad_tuning_is_named(change, match):
    with pytest.raises(ValueError, match=match):
        TritonDecodeTuning(**change)


def test_missing_packages_give_one_line(monkeypatch):
    """impl="triton" without jax-triton names what to install (jax-triton is imported only
    when that impl runs)."""
    monkeypatch.setitem(sys.modules, "jax_triton", None)
    rng = np.random.default_rng(1)
    q, k, v, _, table, lengths = make_case(rng, lengths=[40], hkv=1, r=2, d=16,
                                           dtype=jnp.float32)
    with pytest.raises(ImportError, match=r"pip install 'sparrow-jax\[triton\]'"):
        sparse_decode(q, k, v, table, lengths, jnp.asarray([3]), page_size=P, impl="triton")


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: jax-triton launches compiled kernels only")
def test_dispatch_runs_the_triton_kernels():
    """sparse_decode(impl="triton") under jit equals the reference on the kernel matrix."""
    rng = np.random.default_rng(2)
    q, k, v, cent, table, lengths = make_case(rng, lengths=KERNEL_LENGTHS, hkv=2, r=4, d=64,
                                              dtype=jnp.float32)
    budgets = jnp.asarray(KERNEL_BUDGETS, jnp.int32)
    step = jax.jit(functools.partial(sparse_decode, page_size=P, centroids=cent),
                   static_argnames="impl")
    got = step(q, k, v, table, lengths, budgets, impl="triton")
    want = step(q, k, v, table, lengths, budgets, impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


_COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pallas_kernels import triton_decode_kernels as kernels
from pallas_kernels.sparse_decode_triton import TritonDecodeTuning, plan
from ptxas import ptxas_usage

TYPES = dict(bfloat16="bf16", float32="fp32", int32="i32", uint32="u32")
DTYPES = dict(q="bfloat16", k="bfloat16", v="bfloat16", centroids="bfloat16", kmin="bfloat16",
              kmax="bfloat16", table="int32", lengths="int32", budgets="int32", keys="uint32",
              phys="int32", slots="int32", count="int32")
out = {}
# Issue 5's shape: batch 32 at 32K tokens, budget 128 pages, GQA 32/8, head_dim 128.
shape = dict(batch=32, q_heads=32, kv_heads=8, head_dim=128, pages_total=65600, page_size=16,
             table_width=2049, max_pages=128, compute_dtype="bfloat16",
             tuning=TritonDecodeTuning())
launches = {l.kernel: l for scorer in ("centroid", "quest") for l in plan(**shape, scorer=scorer)}
for launch in launches.values():
    fn = getattr(kernels, launch.kernel)
    args = [(n, DTYPES[n]) for n in launch.inputs] + [(n, d) for n, _, d in launch.outputs]
    consts = dict(launch.constants)
    sig = {p: "*" + TYPES[d] for p, (_, d) in zip(fn.arg_names, args)}
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    out[launch.kernel] = ptxas_usage(k.asm["ptx"])
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="needs the triton package (its compiler and ptxas; no GPU needed)")
def test_kernels_compile_for_hopper_without_spills(tmp_path):
    """Every launch (both scorers) compiles for sm_90 at issue 5's shape (no GPU needed:
    Triton's compiler and its bundled ptxas) and keeps its values in registers: a spill would
    add local-memory traffic to loops whose time is their reads."""
    import json
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "tests"),
                                         env.get("PYTHONPATH", "")])
    # Triton caches compiled kernels under $HOME, which a GPU machine's image may not let it
    # write: a fresh folder of the test's own.
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(got) == {"score_kernel", "quest_score_kernel", "select_kernel", "attend_kernel"}
    assert all(k["spilled"] == 0 and 0 < k["regs"] <= 255 for k in got.values()), got
