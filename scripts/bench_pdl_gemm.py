"""Probe: the decode layer's four weight GEMMs on Mosaic GPU, with and without programmatic
dependent launch (PDL), against the Pallas (Triton) GEMM the engine runs.

Question (notes/kernel_notes.md, "What the rollout target asks"): a decode step pays each
launch's fill and drain (~1.3-2.1 us a GEMM at 19 rows, four a layer). A kernel launched with
PDL starts while its predecessor drains; here it fetches its first weight tiles (which never
depend on the previous kernel) before ``griddepcontrol.wait``, and only then its input. Pallas'
Triton lowering cannot ask for that; Mosaic GPU can (jax 0.11.2). The chain is a decode step's
28 layers of QKV, O, gate-up and down at Qwen3-1.7B's shapes, each GEMM's split-K partial sums
reduced into the next one's input by a small XLA fusion (as the layer's own small kernels sit
between them); one jitted chain, its wall time the median of ``--repeats`` (CUDA graphs on, as
the engine runs), beside the weights' read time at the measured ceiling.

    PYTHONPATH=. python3 scripts/bench_pdl_gemm.py --out $OUT/pdl_gemm.json
    JAX_PLATFORMS=cpu PYTHONPATH=. python3 scripts/bench_pdl_gemm.py --check   # interpret mode

``--check`` runs the Mosaic GPU GEMM (without PDL: the interpreter has no rule for it) on small
shapes against float64 NumPy. On a GPU every variant is first checked against XLA's product.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_gemm_gpu import gemm_partials_pallas
from sparrow_jax.benchmarking import median_seconds, read_ceiling, write_record

ROWS = 64           # a Hopper matrix instruction's rows: the decode rows padded to them
LAYER = {"qkv": (2048, 4096), "o": (2048, 2048), "gate_up": (2048, 12288), "down": (6144, 2048)}
LAYERS = 28


def mgpu_splits(k: int, n: int, bn: int, programs: int = 128) -> int:
    """Split-K parts so that (N / bn) x splits programs fill about one wave."""
    s = 1
    while (n // bn) * s < programs and (k // (2 * s)) % 128 == 0:
        s *= 2
    return s


@functools.partial(jax.jit, static_argnames=("splits", "bn", "bk", "stages", "pdl",
                                             "interpret"))
def gemm_partials_mgpu(x64, w, *, splits, bn=64, bk=128, stages=4, pdl=False,
                       interpret=False):
    """x ``[64, K]``, w ``[K, N]`` (bf16) -> partial sums ``[splits, 64, N]`` float32; grid
    (N / bn, splits), each program streaming its K range's tiles of w and x by TMA through
    ``stages`` shared-memory slots, wgmma into a float32 accumulator. ``pdl``: the first tiles
    of w are requested before ``griddepcontrol.wait``, those of x after it."""
    k, n = w.shape
    steps = k // splits // bk
    ahead0 = min(stages - 1, steps)

    def body(x_ref, w_ref, o_ref, x_smem, w_smem, o_smem, x_bar, w_bar):
        ni, si = lax.axis_index("n"), lax.axis_index("s")
        cols = pl.ds(ni * bn, bn)

        def fetch_w(i, slot):
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds((si * steps + i) * bk, bk), cols],
                                    w_smem.at[slot], w_bar.at[slot])

        def fetch_x(i, slot):
            plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds((si * steps + i) * bk, bk)],
                                    x_smem.at[slot], x_bar.at[slot])

        for i in range(ahead0):
            fetch_w(i, i)
        if pdl:
            plgpu.griddepcontrol_wait()     # x is the previous kernel's output; w never is
        for i in range(ahead0):
            fetch_x(i, i)

        def step(i, acc):
            slot = lax.rem(i, stages)
            ahead = i + stages - 1

            @pl.when(ahead < steps)
            def _():
                fetch_w(ahead, lax.rem(ahead, stages))
                fetch_x(ahead, lax.rem(ahead, stages))

            plgpu.barrier_wait(w_bar.at[slot])
            plgpu.barrier_wait(x_bar.at[slot])

            def product(ref):
                plgpu.wgmma(ref, x_smem.at[slot], w_smem.at[slot])
                plgpu.wgmma_wait(0)
                return ref[...]

            return acc + pl.run_scoped(product, plgpu.ACC((ROWS, bn), jnp.float32))

        acc = lax.fori_loop(0, steps, step, plgpu.layout_cast(
            jnp.zeros((ROWS, bn), jnp.float32), plgpu.Layout.WGMMA))
        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[si, :, cols])
        plgpu.wait_smem_to_gmem(0)

    # 128-byte swizzled 8 x 64 tiles: the layout the matrix unit reads from shared memory.
    layout = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, ROWS, n), jnp.float32),
        scratch_types=[plgpu.SMEM((stages, ROWS, bk), w.dtype, transforms=layout),
                       plgpu.SMEM((stages, bk, bn), w.dtype, transforms=layout),
                       plgpu.SMEM((ROWS, bn), jnp.float32),
                       plgpu.Barrier(num_arrivals=1, num_barriers=stages),
                       plgpu.Barrier(num_arrivals=1, num_barriers=stages)],
        grid=(n // bn, splits), grid_names=("n", "s"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(x64, w)


def _next_input(parts, rows, k, silu=False):
    """A GEMM's partial sums ``[S, R, N]`` -> the next one's input ``[rows, k]`` bf16 (SiLU x up
    of the two halves after gate-up), scaled to keep the chain's values finite."""
    y = parts.sum(0)[:rows]
    if silu:
        half = y.shape[1] // 2
        y = jax.nn.silu(y[:, :half]) * y[:, half:]
    return (y[:, :k] * 1e-2).astype(jnp.bfloat16)


def step_chain(gemm, rows: int):
    """One decode step's GEMMs: ``gemm(x [rows, K], w) -> [S, R, N]`` over every layer's four
    weights, each output feeding the next input."""
    order = ["qkv", "o", "gate_up", "down"]
    nxt = {"qkv": "o", "o": "gate_up", "gate_up": "down", "down": "qkv"}

    def run(x, weights):
        for layer in weights:
            for name in order:
                parts = gemm(name, x, layer[name])
                x = _next_input(parts, rows, LAYER[nxt[name]][0], silu=name == "gate_up")
        return x
    return jax.jit(run)


def variants(args):
    def pallas(name, x, w):
        return gemm_partials_pallas(x, w)

    def mgpu(pdl):
        def gemm(name, x, w):
            k, n = w.shape
            x64 = jnp.pad(x, ((0, ROWS - x.shape[0]), (0, 0)))
            return gemm_partials_mgpu(x64, w, splits=mgpu_splits(k, n, args.bn), bn=args.bn,
                                      bk=args.bk, stages=args.stages, pdl=pdl)
        return gemm
    return {"pallas": pallas, "mgpu": mgpu(False), "mgpu_pdl": mgpu(True)}


def check(args):
    rng = np.random.default_rng(0)
    for k, n, splits in [(512, 128, 2), (256, 64, 1), (1024, 128, 4)]:
        x = jnp.asarray(rng.normal(size=(ROWS, k)), jnp.bfloat16)
        w = jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), jnp.bfloat16)
        got = np.asarray(gemm_partials_mgpu(x, w, splits=splits, bk=args.bk,
                                            stages=args.stages, interpret=True)).sum(0)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        err = float(np.abs(got - want).max() / np.abs(want).max())
        print(f"mgpu k{k} n{n} s{splits}: max rel err {err:.1e}")
        assert err < 1e-5, err


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[19, 48])
    ap.add_argument("--bn", type=int, default=64)
    ap.add_argument("--bk", type=int, default=128)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--only", nargs="+", default=None, help="variants to run")
    ap.add_argument("--check", action="store_true", help="CPU: interpret-mode check only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.check:
        check(args)
        return
    rng = np.random.default_rng(0)
    weights = [{name: jnp.asarray(rng.normal(size=kn) / np.sqrt(kn[0]), jnp.bfloat16)
                for name, kn in LAYER.items()} for _ in range(LAYERS)]
    weight_bytes = sum(w.nbytes for layer in weights for w in layer.values())
    ceiling = read_ceiling()
    floor_ms = weight_bytes / (ceiling * 1e9) * 1e3
    print(f"{LAYERS} layers, {weight_bytes / 1e9:.2f} GB of weights; read ceiling "
          f"{ceiling:.0f} GB/s: {floor_ms:.3f} ms a step", flush=True)
    results = []
    chosen = {k: v for k, v in variants(args).items() if not args.only or k in args.only}
    for rows in args.rows:
        x = jnp.asarray(rng.normal(size=(rows, LAYER["qkv"][0])), jnp.bfloat16)
        for name, gemm in chosen.items():
            try:
                for shape, w in weights[0].items():      # the product, against XLA's
                    xin = jnp.asarray(rng.normal(size=(rows, w.shape[0])), jnp.bfloat16)
                    got = np.asarray(gemm(shape, xin, w).sum(0)[:rows], np.float64)
                    want = np.asarray(jnp.dot(xin, w, preferred_element_type=jnp.float32),
                                      np.float64)
                    err = float(np.abs(got - want).max() / np.abs(want).max())
                    assert err < 1e-2, f"{name} {shape}: max rel err {err:.1e}"
                ms = median_seconds(step_chain(gemm, rows), (x, weights), args.repeats) * 1e3
            except Exception as e:      # a variant the device cannot run: say so, go on
                print(f"rows {rows:3d} {name:9s} failed: {str(e)[:300]}", flush=True)
                results.append(dict(rows=rows, variant=name, error=str(e)[:2000]))
                continue
            results.append(dict(rows=rows, variant=name, step_ms=ms,
                                floor_fraction=floor_ms / ms))
            print(f"rows {rows:3d} {name:9s} {ms:.3f} ms a step's GEMMs "
                  f"({floor_ms / ms:.0%} of the weights' read time; "
                  f"{ms * 1e3 / (4 * LAYERS):.2f} us a GEMM)", flush=True)
    write_record(args.out, ceiling_gb_s=ceiling, weight_bytes=weight_bytes, bn=args.bn,
                 bk=args.bk, stages=args.stages, results=results)


if __name__ == "__main__":
    main()
