"""The Pallas GPU kernels lowered to Triton for an H100 on this CPU-only host: JAX lowers a
``pallas_call`` to Triton IR when the abstract mesh names a GPU device, so what the Triton
lowering cannot take (a primitive, a shape, a dtype) fails here, in CI, and not first on a GPU
machine. Where the triton package is installed, the lowered kernels also go through Triton's
compiler and its bundled ptxas for sm_90 (no GPU needed), which report registers and spills.
What only a GPU shows (speed, the driver's load) still needs the GPU lane (scripts/test_gpu.sh).
The interpret-mode tests check what the kernels compute; these check that the GPU can be handed
them. The sparse step's attention is pinned to the Pallas kernel (``attend="pallas"``): on a
Hopper GPU "auto" takes the CUDA one, which is not Triton (tests/test_sparse_attend_cuda.py
lowers that call), and these tests must say the same on every host."""

from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import mesh as mesh_lib
from jax._src.pallas.triton import lowering as triton_lowering

from pallas_kernels.decode_gemm_gpu import add_norm_pallas, gemm_partials_pallas
from pallas_kernels.decode_mlp_gpu import gate_up_silu_pallas
from pallas_kernels.paged_append_gpu import append_token_pallas, prep_append_token_pallas
from pallas_kernels.sparse_decode_gpu import GpuDecodeTuning, sparse_decode_pallas
from sparrow_jax.attention.paged_dense import paged_attention_pallas
from ptxas import ptxas_usage
from pallas_kernels.teacher_forced_gpu import (TeacherForcedTuning, page_masked_attention,
                                               select_pages_kernel)

H100_SHARED_BYTES = 227 * 1024   # a program's shared memory on sm_90 (the opt-in maximum)
H100 = mesh_lib.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                               platform="gpu")


def triton_kernels(fn, *args) -> list[str]:
    """The names of the Triton kernels in ``fn(*args)`` lowered for an H100 (raises where the
    Triton lowering cannot take a kernel)."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H100)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r'name = "([a-z_]+)", num_stages', text)


def decode_case(*, b=2, hq=8, hkv=2, d=128, p=16, pages=60, m=24, dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((hkv, pages, p, d)), dtype)
    return dict(q=jnp.asarray(rng.standard_normal((b, hq, d)), dtype), k=k, v=k,
                cent=jnp.mean(k.astype(jnp.float32), axis=2).astype(dtype),
                table=jnp.asarray(rng.permutation(pages)[:b * m].reshape(b, m), jnp.int32),
                lengths=jnp.asarray([m * p, 5 * p + 3][:b], jnp.int32),
                budget=jnp.full((b,), 8, jnp.int32))


@pytest.mark.parametrize("tuning,dtype,hq", [
    (GpuDecodeTuning(attend="pallas"), jnp.bfloat16, 8),
    (GpuDecodeTuning(block_pages=8, splits=2, attend_stages=2, attend_warps=4, attend="pallas"),
     jnp.float16, 8),
    (GpuDecodeTuning(score_chunk=128, select_warps=8, attend="pallas"), jnp.bfloat16,
     10)])   # a group of 5
def test_sparse_decode_lowers_for_h100(tuning, dtype, hq):
    c = decode_case(dtype=dtype, hq=hq)

    def step(q, k, v, cent, table, lengths, budget):
        return sparse_decode_pallas(q, k, v, table, lengths, budget, page_size=16,
                                    centroids=cent, max_budget_pages=8, tuning=tuning)

    attend = (["sparse_decode_attend"] if tuning.splits else
              ["sparse_decode_attend_balanced"])   # the default, merge included
    assert triton_kernels(step, *c.values()) == [
        "sparse_decode_score", "sparse_decode_select", *attend]


@pytest.mark.parametrize("hq", [8, 10])    # groups of 4 and 5
def test_quest_lowers_for_h100(hq):
    c = decode_case(hq=hq)

    def step(q, k, v, kmin, kmax, table, lengths, budget):
        return sparse_decode_pallas(q, k, v, table, lengths, budget, page_size=16,
                                    scorer="quest", summaries=(kmin, kmax), max_budget_pages=8,
                                    tuning=GpuDecodeTuning(attend="pallas"))

    assert triton_kernels(step, c["q"], c["k"], c["v"], c["cent"], c["cent"],
                          *list(c.values())[4:]) == [
        "sparse_decode_score", "sparse_decode_select", "sparse_decode_attend_balanced"]


def dense_shapes(*, b=64, width=516, pages=16449):
    """Dense decode in the 8K refill's chunks: 64 slots, a 516-page table (no power of two),
    Qwen3-1.7B's GQA 16/8."""
    return [jax.ShapeDtypeStruct(s, t) for s, t in [
        ((b, 16, 128), jnp.bfloat16), ((8, pages, 16, 128), jnp.bfloat16),
        ((8, pages, 16, 128), jnp.bfloat16), ((b, width), jnp.int32), ((b,), jnp.int32)]]


def test_dense_paged_attention_lowers_for_h100():
    assert triton_kernels(paged_attention_pallas, *dense_shapes(pages=1000)) == [
        "dense_decode_attend"]


def test_teacher_forced_kernels_lower_for_h100():
    """The selection kernel and the attention's forward and backward (through ``jax.grad``)."""
    rng = np.random.default_rng(1)
    b, t, hq, hkv, d, p = 1, 128, 4, 2, 64, 16
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
               for h in (hq, hkv, hkv))
    words = jnp.full((b, hkv, 1, t), -1, jnp.int32)
    scores = jnp.asarray(rng.standard_normal((b, hkv, 16, t // p)), jnp.float32)

    def loss(q, k, v, words):
        out = page_masked_attention(q, k, v, words, p, TeacherForcedTuning())
        return jnp.sum(out.astype(jnp.float32))

    names = triton_kernels(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, words)
    assert len(names) == 3 and all(names), names     # forward, dk/dv, dq
    names = triton_kernels(
        lambda s: select_pages_kernel(s, jnp.full((16,), t // p, jnp.int32),
                                      jnp.full((b, 16), 4, jnp.int32)), scores)
    assert len(names) == 1, names


def append_shapes(*, layers=28, b=19, h=8, d=128, pages=38951, p=16):
    """The rollout's Qwen3-1.7B cache at batch 19 (a 32K pool): page, slot, k, v, running sums,
    one layer's K and V pages and centroids."""
    return [jax.ShapeDtypeStruct(s, t) for s, t in [
        ((b,), jnp.int32), ((b,), jnp.int32), ((b, h, d), jnp.bfloat16),
        ((b, h, d), jnp.bfloat16), ((layers, b, h, d), jnp.float32),
        ((h, pages, p, d), jnp.bfloat16), ((h, pages, p, d), jnp.bfloat16),
        ((h, pages, d), jnp.bfloat16)]]


def append_step(page, slot, k, v, sums, kp, vp, cent):
    return append_token_pallas(page, slot, k, v, sums, kp, vp, cent, layer=3, page_size=16)


def prep_append_shapes(*, hq=16, h=8, d=128, pages=38951, **kw):
    """As :func:`append_shapes`, the projections (``hq`` query heads) in place of k and v,
    then the norms' weights and this token's cos and sin."""
    page, slot, k, _, *cache = append_shapes(h=h, d=d, pages=pages, **kw)
    b = page.shape[0]
    return [page, slot, jax.ShapeDtypeStruct((b, hq + 2 * h, d), jnp.bfloat16),
            *[jax.ShapeDtypeStruct((d,), jnp.float32)] * 2,
            *[jax.ShapeDtypeStruct((b, d), jnp.float32)] * 2, *cache]


def prep_append_step(page, slot, qkv, qw, kw, cos, sin, sums, kp, vp, cent):
    return prep_append_token_pallas(page, slot, qkv, qw, kw, cos, sin, sums, kp, vp, cent,
                                    layer=3, page_size=16, eps=1e-6)


def with_quest(shapes):
    """``shapes`` (ending in a layer's cache arrays) plus a Quest cache's running min and max
    ``[L, B, H, D]`` and the layer's kmin and kmax ``[H, N, D]``."""
    def quest_shapes(**kw):
        args = shapes(**kw)
        acc, pages = args[-4], args[-3]
        summary = jax.ShapeDtypeStruct(pages.shape[:2] + pages.shape[3:], pages.dtype)
        return [*args, *[jax.ShapeDtypeStruct(acc.shape, pages.dtype)] * 2, summary, summary]
    return quest_shapes


def quest_append_step(page, slot, k, v, sums, kp, vp, cent, *quest):
    return append_token_pallas(page, slot, k, v, sums, kp, vp, cent, quest, layer=3,
                               page_size=16)


def quest_prep_append_step(page, slot, qkv, qw, kw, cos, sin, sums, kp, vp, cent, *quest):
    return prep_append_token_pallas(page, slot, qkv, qw, kw, cos, sin, sums, kp, vp, cent,
                                    quest, layer=3, page_size=16, eps=1e-6)


def qkv_shapes(*, hq=16, h=8, d=128, hidden=2048, **kw):
    """The decode step's attention input: the normed hidden rows and the q, k, v weights, then
    :func:`prep_append_shapes`' arguments after the projections."""
    page, slot, qkv, *rest = prep_append_shapes(hq=hq, h=h, d=d, **kw)
    b = page.shape[0]
    return [jax.ShapeDtypeStruct((b, hidden), jnp.bfloat16),
            *[jax.ShapeDtypeStruct((hidden, n * d), jnp.bfloat16) for n in (hq, h, h)],
            page, slot, *rest]


def qkv_step(x, wq, wk, wv, page, slot, qw, kw, cos, sin, sums, kp, vp, cent):
    """One GEMM for the three projections, its partial sums into the fused q/k kernel."""
    return prep_append_token_pallas(page, slot, gemm_partials_pallas(x, (wq, wk, wv)), qw, kw,
                                    cos, sin, sums, kp, vp, cent, layer=3, page_size=16,
                                    eps=1e-6, dtype=jnp.bfloat16)


def gate_up_shapes(*, m=19, k=2048, f=6144, dtype=jnp.bfloat16):
    """Qwen3-1.7B's MLP input half at the rollout's 19 rows: x, gate, up."""
    return [jax.ShapeDtypeStruct(s, dtype) for s in [(m, k), (k, f), (k, f)]]


def gate_up_step(x, gate, up):
    return gate_up_silu_pallas(x, gate, up)


def residual_shapes(*, m=48, k=6144, n=2048):
    """Qwen3-1.7B's down projection at refill's 48 slots, then its add-norm: h, w, the
    residual, the norm's weight."""
    return [jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((m, n), jnp.bfloat16), jax.ShapeDtypeStruct((n,), jnp.float32)]


def residual_step(h, w, residual, weight):
    return add_norm_pallas(gemm_partials_pallas(h, w), residual, weight, eps=1e-6)


@pytest.mark.parametrize("m,k,n", [(19, 2048, 2048), (64, 6144, 2048), (128, 6144, 2560)])
def test_decode_residual_kernels_lower_for_h100(m, k, n):
    """O at the rollout's 19 rows, down at 64, Qwen3-4B's width (not a power of two) at 128
    rows. (Not the shapes the ptxas test compiles: a lowering cached here would hide its
    module.)"""
    assert triton_kernels(residual_step, *residual_shapes(m=m, k=k, n=n)) == [
        "decode_gemm", "decode_add_norm"]


@pytest.mark.parametrize("rows", [48, 128])        # 4 warps, and 8 above 64 rows
def test_decode_gate_up_lowers_for_h100(rows):
    assert triton_kernels(gate_up_step, *gate_up_shapes(m=rows)) == ["decode_gate_up_silu"]


def test_paged_append_lowers_for_h100():
    # Not the shapes the ptxas test compiles: a lowering cached here would hide its module.
    assert triton_kernels(append_step, *append_shapes(pages=1000)) == ["paged_append"]


@pytest.mark.parametrize("hq", [16, 32])    # 16 + 2 x 8 heads of projections, and 48 (Qwen3-8B)
def test_fused_prep_and_append_lowers_for_h100(hq):
    assert triton_kernels(prep_append_step, *prep_append_shapes(hq=hq, pages=1000)) == [
        "paged_prep_append"]
    assert triton_kernels(qkv_step, *qkv_shapes(hq=hq, pages=1000)) == [
        "decode_gemm", "paged_prep_append"]


def test_an_unlowerable_kernel_fails_here():
    """The check can fail: a kernel using what the Triton lowering lacks (a sort) raises."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.sort(x_ref[...])

    def fn(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    with pytest.raises(Exception, match="sort"):
        triton_kernels(fn, jnp.zeros((16,), jnp.float32))


def triton_modules(fn, *args, monkeypatch) -> list[tuple[str, int, int]]:
    """(Triton IR text, warps, stages) of each kernel in ``fn(*args)`` lowered for an H100: the
    modules JAX's lowering builds (it passes them on as bytecode in the custom call)."""
    got = []
    lower = triton_lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        result = lower(*a, **kw)
        got.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", capture)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H100)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # Each kernel's launch settings, matched by its name (the custom calls' order in the text
    # need not be the order the kernels were lowered in).
    launch: dict[str, list[tuple[int, int]]] = {}
    for name, stages, warps in re.findall(
            r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text):
        launch.setdefault(name, []).append((int(warps), int(stages)))
    assert sum(map(len, launch.values())) == len(got), (launch, len(got))
    return [(ir, *launch[re.search(r"tt.func public @(\w+)", ir).group(1)].pop(0))
            for ir in got]


def ptxas_report(fn, *args, tmp_path, monkeypatch) -> dict[str, dict[str, int]]:
    """{kernel: registers, spilled bytes, shared memory bytes} of each kernel in ``fn(*args)``,
    lowered for an H100 and compiled for sm_90 by Triton's compiler and its bundled ptxas (no
    GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget

    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_cache"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    report = {}
    for i, (ir, warps, stages) in enumerate(triton_modules(fn, *args, monkeypatch=monkeypatch)):
        name = re.search(r"tt.func public @(\w+)", ir).group(1)
        path = tmp_path / f"{i}_{name}.ttir"
        path.write_text(ir)
        kernel = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps, num_stages=stages))
        report[f"{i}_{name}"] = ptxas_usage(kernel.asm["ptx"]) | {
            "shared": kernel.metadata.shared}
    return report


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs the triton package (its compiler and ptxas; no "
                                         "GPU needed)")


def fits_h100(report) -> bool:
    """Every kernel keeps its values in registers (a spill adds local-memory traffic to loops
    whose time is their reads) and its buffers in a program's shared memory (else the launch
    fails: RESOURCE_EXHAUSTED)."""
    return all(r["spilled"] == 0 and 0 < r["regs"] <= 255 and r["shared"] <= H100_SHARED_BYTES
               for r in report.values())


def issue5_shapes(b=32, m=2049, d=128):
    """Issue 5's step: batch 32 at 32K tokens (2049 pages), GQA 32/8, head_dim 128: q, K and V
    pages, centroids, page table, lengths, budgets."""
    pages = b * m
    return [jax.ShapeDtypeStruct(s, t) for s, t in [
        ((b, 32, d), jnp.bfloat16), ((8, pages, 16, d), jnp.bfloat16),
        ((8, pages, 16, d), jnp.bfloat16), ((8, pages, d), jnp.bfloat16),
        ((b, m), jnp.int32), ((b,), jnp.int32), ((b,), jnp.int32)]]


@needs_triton
@pytest.mark.parametrize("balanced", [None, False])
def test_sparse_decode_compiles_for_hopper_without_spills(tmp_path, monkeypatch, balanced):
    """Issue 5's shape (batch 32 at 32K tokens, budget 128 pages, GQA 32/8, head_dim 128), the
    default settings (the balanced attention, merging in its last programs) and even splits:
    the kernels compile for sm_90 without spills."""
    shapes = issue5_shapes()

    def step(q, k, v, cent, table, lengths, budget):
        return sparse_decode_pallas(q, k, v, table, lengths, budget, page_size=16,
                                    centroids=cent, max_budget_pages=128,
                                    tuning=GpuDecodeTuning(balanced=balanced, attend="pallas"))

    report = ptxas_report(step, *shapes, tmp_path=tmp_path, monkeypatch=monkeypatch)
    attend = (["sparse_decode_attend"] if balanced is False else
              ["sparse_decode_attend_balanced"])
    assert [k.split("_", 1)[1] for k in report] == [
        "sparse_decode_score", "sparse_decode_select", *attend]
    assert fits_h100(report), report


@needs_triton
def test_quest_scoring_compiles_for_hopper_without_spills(tmp_path, monkeypatch):
    """Quest at issue 5's shape (two summaries a page, a group of 4 heads): the scoring kernel
    compiles for sm_90 without spills."""
    q, k, v, cent, *rest = issue5_shapes()

    def step(q, k, v, kmin, kmax, table, lengths, budget):
        return sparse_decode_pallas(q, k, v, table, lengths, budget, page_size=16,
                                    scorer="quest", summaries=(kmin, kmax),
                                    max_budget_pages=128, tuning=GpuDecodeTuning(attend="pallas"))

    report = ptxas_report(step, q, k, v, cent, cent, *rest, tmp_path=tmp_path,
                          monkeypatch=monkeypatch)
    assert [k.split("_", 1)[1] for k in report][0] == "sparse_decode_score"
    assert fits_h100(report), report


@needs_triton
@pytest.mark.parametrize("fn,shapes,name", [
    (paged_attention_pallas, dense_shapes, "dense_decode_attend"),
    (append_step, append_shapes, "paged_append"),
    (prep_append_step, prep_append_shapes, "paged_prep_append"),
    (quest_append_step, with_quest(append_shapes), "paged_append"),
    (quest_prep_append_step, with_quest(prep_append_shapes), "paged_prep_append"),
    (gate_up_step, gate_up_shapes, "decode_gate_up_silu"),
    (residual_step, residual_shapes, "decode_gemm decode_add_norm"),
    (qkv_step, qkv_shapes, "decode_gemm paged_prep_append")])
def test_kernels_compile_for_hopper_without_spills(fn, shapes, name, tmp_path, monkeypatch):
    """Dense decode attention, the cache write (alone, and with q/k-norm and RoPE; centroid and
    Quest caches), the MLP's gate-up kernel, the residual projection's two and the q, k, v GEMM
    into the fused q/k kernel at the rollout's shapes."""
    report = ptxas_report(fn, *shapes(), tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert [k.split("_", 1)[1] for k in report] == name.split()
    assert fits_h100(report), report


@needs_triton
@pytest.mark.parametrize("dtype,rows", [(jnp.float32, 64), (jnp.float32, 128),
                                        (jnp.bfloat16, 256)])
def test_gate_up_fits_hopper_up_to_its_row_limit(dtype, rows, tmp_path, monkeypatch):
    """The most rows each dtype takes (bfloat16 at 256 with two pipeline stages, not three;
    float32 at 128 with its own K step) launch within shared memory (the suite's float32
    dots run at full precision, which spills at these rows: float32 must run, bfloat16 must be
    fast). Six K steps or more, so that Triton's pipeliner is not capped by the loop's
    length."""
    report = ptxas_report(gate_up_step, *gate_up_shapes(m=rows, k=768, f=128, dtype=dtype),
                          tmp_path=tmp_path, monkeypatch=monkeypatch)
    (usage,) = report.values()
    assert usage["shared"] <= H100_SHARED_BYTES, report
    if dtype == jnp.bfloat16:
        assert fits_h100(report), report


@needs_triton
def test_teacher_forced_kernels_compile_for_hopper(tmp_path, monkeypatch):
    """The Qwen3-1.7B shape (GQA 16/8, head_dim 128) at 4096 tokens: the selection and the
    attention's forward and backward compile for sm_90; all but dk/dv without spills. The dk/dv
    kernel spills at the default backward blocks (64 x 64, 4 warps; 32-key blocks would not),
    which the H100 sweep nevertheless found fastest (BENCHMARKS.md, DistillSparse)."""
    b, t, hq, hkv, d, p = 1, 4096, 16, 8, 128, 16
    q, k, v = (jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16) for h in (hq, hkv, hkv))
    words = jax.ShapeDtypeStruct((b, hkv, 1, t), jnp.int32)

    def loss(q, k, v, words):
        out = page_masked_attention(q, k, v, words, p, TeacherForcedTuning())
        return jnp.sum(out.astype(jnp.float32))

    report = ptxas_report(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, words,
                          tmp_path=tmp_path, monkeypatch=monkeypatch)
    scores = jax.ShapeDtypeStruct((b, hkv, 16, t // p), jnp.float32)
    report |= ptxas_report(
        lambda s: select_pages_kernel(s, jnp.full((16,), t // p, jnp.int32),
                                      jnp.full((b, 16), 4, jnp.int32)), scores,
        tmp_path=tmp_path / "select", monkeypatch=monkeypatch)
    names = sorted(k.split("_", 1)[1] for k in report)
    assert names == ["teacher_forced_dkv", "teacher_forced_dq", "teacher_forced_forward",
                     "teacher_forced_select"], report
    assert fits_h100({k: r for k, r in report.items() if not k.endswith("_dkv")}), report


@needs_triton
def test_balanced_attention_compiles_for_hopper_without_spills(tmp_path, monkeypatch):
    """``GpuDecodeTuning(balanced=True)``: the step's attention on a flat grid shared out by
    list length, each list merged by its last program (pallas_kernels/paged_attend_gpu.py),
    compiles for sm_90 without
    spills: issue 5's shape at the rollout's batch of 19 (152 lists, their counts read padded
    to 256)."""
    def step(q, k, v, cent, table, lengths, budget):
        return sparse_decode_pallas(q, k, v, table, lengths, budget, page_size=16,
                                    centroids=cent, max_budget_pages=128,
                                    tuning=GpuDecodeTuning(balanced=True, attend="pallas"))

    report = ptxas_report(step, *issue5_shapes(b=19), tmp_path=tmp_path,
                          monkeypatch=monkeypatch)
    assert [k.split("_", 1)[1] for k in report] == [
        "sparse_decode_score", "sparse_decode_select", "sparse_decode_attend_balanced"]
    assert fits_h100(report), report


@needs_triton
def test_balanced_dense_attention_compiles_for_hopper_without_spills(tmp_path, monkeypatch):
    """The same for dense decode over whole page tables (``paged_attention_pallas``) in the
    8K refill's chunks (64 slots: 512 lists, a 516-page table)."""
    def step(q, k, v, table, lengths):
        return paged_attention_pallas(q, k, v, table, lengths,
                                      tuning=GpuDecodeTuning(balanced=True))

    report = ptxas_report(step, *dense_shapes(), tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert [k.split("_", 1)[1] for k in report] == [
        "dense_decode_attend_balanced"]
    assert fits_h100(report), report
