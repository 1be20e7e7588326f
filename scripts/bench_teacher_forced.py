"""Teacher-forced sparse attention of one layer, by part, against cuDNN's dense causal
attention (docs/design.md, section 8; issue 16).

One layer at the Qwen3-1.7B attention shape (16 query heads, 8 KV heads, head_dim 128, bf16),
one row of ``--prompt-len`` prompt + ``--response-len`` response tokens, the schedule's budget
recorded at every response position. Median of ``--repeats`` timed calls after a warm-up:

- ``selection_s``: the page masks of every query, packed (XLA scores, the selection kernel,
  bits); ``scores_s``: the scores alone;
- ``kernel_forward_s`` / ``kernel_forward_backward_s``: the flash kernel under those masks;
- ``pallas_forward_s`` / ``pallas_forward_backward_s``: the whole layer (selection + kernel);
- ``xla_forward_s`` / ``xla_forward_backward_s``: the XLA formulation (``--no-xla`` skips);
- ``cudnn_forward_s`` / ``cudnn_forward_backward_s``: dense causal attention (the dense
  phase's), the baseline;
- ``visited``: the share of causal (query block, key block) pairs the kernel computes (a pair
  is skipped when no query of the block selected a page of the key block), and the matmul
  FLOP rates of the kernel against the H100's 989 TFLOP/s dense bf16 peak.

``--tunings`` times the kernel at several TeacherForcedTuning settings (``;``-separated lists
of ``field=value``) in the same run.

    PYTHONPATH=. python3 scripts/bench_teacher_forced.py --out $OUT/tf_layer.json

CPU smoke test: ``--response-len 256 --prompt-len 64 --heads 4,2 --head-dim 16 --repeats 1
--interpret``.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.teacher_forced_gpu import TeacherForcedTuning, page_masked_attention
from sparrow_jax.attention.dense import causal_attention
from sparrow_jax.benchmarking import median_seconds, write_record
from sparrow_jax.attention.selection import centroid_scores, page_centroids
from sparrow_jax.attention.teacher_forced import selection_words, teacher_forced_sparse_attention
from sparrow_jax.schedule import BudgetSchedule

H100_BF16_FLOPS = 989e12


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--response-len", type=int, default=8192)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--heads", default="16,8", help="query heads, KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--schedule", default="qwen3-1.7b")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=128, help="teacher-forced chunk_size")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tunings", default="", help="';'-separated TeacherForcedTuning settings")
    p.add_argument("--no-xla", action="store_true")
    p.add_argument("--interpret", action="store_true", help="kernels in the interpreter (CPU)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _median(fn, repeats):
    return median_seconds(fn, (), repeats)


def _tunings(spec: str) -> list[TeacherForcedTuning]:
    out = [TeacherForcedTuning()]
    for item in filter(None, spec.split(";")):
        out.append(TeacherForcedTuning(**{k: int(v) for k, v in
                                          (kv.split("=") for kv in item.split(","))}))
    return out


def _visited(words: np.ndarray, t: int, tuning: TeacherForcedTuning, page_size: int) -> float:
    """Share of causal (query block, key block) pairs of the forward with a selected page."""
    b, h, w, _ = words.shape
    bits = ((words.view(np.uint32)[..., None] >> np.arange(32, dtype=np.uint32)) & 1) > 0
    pages = bits.transpose(0, 1, 3, 2, 4).reshape(b, h, t, w * 32)     # [B, H, T, pages]
    per_block = max(tuning.block_k // page_size, 1)
    kb = pages[..., : (t // tuning.block_k) * per_block].reshape(b, h, t, -1, per_block).any(-1)
    qk = kb.reshape(b, h, t // tuning.block_q, tuning.block_q, -1).any(3)  # [B, H, nQ, nK]
    nq, nk = qk.shape[2:]
    causal = (np.arange(nk)[None, :] * tuning.block_k
              < (np.arange(nq)[:, None] + 1) * tuning.block_q)
    return float(qk[..., causal].mean())


def main(argv=None) -> dict:
    a = parse_args(argv)
    hq, hkv = (int(x) for x in a.heads.split(","))
    d, page = a.head_dim, a.page_size
    tunings = _tunings(a.tunings)
    mult = max(t.multiple for t in tunings)
    t = -(-(a.prompt_len + a.response_len) // mult) * mult
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, t, hq, d)), jnp.bfloat16)
    # Keys with page-level structure, so selections differ between queries as real keys do.
    topics = np.repeat(rng.standard_normal((1, t // page, hkv, d)), page, axis=1)
    k = jnp.asarray(rng.standard_normal((1, t, hkv, d)) + topics, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, t, hkv, d)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    schedule = BudgetSchedule.from_spec(a.schedule, page)
    budgets = jnp.asarray(np.asarray(schedule.budget_pages(np.arange(t)[None, :] + 1),
                                     np.int32))
    prompts = jnp.asarray([a.prompt_len], jnp.int32)
    interp = a.interpret

    def fb(f):
        """f(q, k, v) -> its gradient against the fixed cotangent g."""
        return jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](g))

    words_fn = jax.jit(lambda q, k: selection_words(q, k, budgets, prompts, page_size=page,
                                                    scorer="centroid",
                                                    chunk_size=a.chunk * page,
                                                    interpret=interp))
    words = words_fn(q, k)
    # The selection's first part alone: every query's page scores, as the reference computes them.
    scores_fn = jax.jit(lambda q, k: centroid_scores(
        q.reshape(1, t, hkv, hq // hkv, d).transpose(0, 2, 1, 3, 4),
        page_centroids(k.reshape(1, t // page, page, hkv, d).transpose(0, 3, 1, 2, 4))[:, :, None]))
    row = {"T": t, "heads": [hq, hkv], "head_dim": d,
           "selection_s": _median(lambda: words_fn(q, k), a.repeats),
           "scores_s": _median(lambda: scores_fn(q, k), a.repeats)}
    dense_flops = 4 * t * t / 2 * hq * d                     # causal QK^T and PV
    kernels = []
    for tuning in tunings:
        kern = lambda q, k, v, tuning=tuning: page_masked_attention(q, k, v, words, page,
                                                                    tuning, interp)
        fwd, bwd = jax.jit(kern), fb(kern)
        kt = {"tuning": tuning.__dict__, "visited": _visited(np.asarray(words), t, tuning, page),
              "forward_s": _median(lambda: fwd(q, k, v), a.repeats),
              "forward_backward_s": _median(lambda: bwd(q, k, v), a.repeats)}
        flops = dense_flops * kt["visited"]
        kt["forward_tflops"] = flops / kt["forward_s"] / 1e12
        # The backward's matmuls are 2.5x the forward's (dq, dk, dv, and s, dp recomputed).
        kt["forward_backward_tflops"] = 3.5 * flops / kt["forward_backward_s"] / 1e12
        kt["forward_peak_share"] = kt["forward_tflops"] * 1e12 / H100_BF16_FLOPS
        print(json.dumps(kt), flush=True)
        kernels.append(kt)
    row["kernels"] = kernels
    best = min(tunings, key=lambda x: kernels[tunings.index(x)]["forward_backward_s"])
    layer = {impl: (lambda q, k, v, impl=impl: teacher_forced_sparse_attention(
        q, k, v, budgets, prompts, page_size=page, chunk_size=a.chunk, impl=impl,
        tuning=best if impl == "pallas" else None, interpret=interp))
        for impl in ("pallas",) + (() if a.no_xla else ("xla",))}
    if jax.default_backend() == "gpu":
        layer["cudnn"] = lambda q, k, v: causal_attention(q, k, v, impl="cudnn")
    for name, f in layer.items():
        fwd, bwd = jax.jit(f), fb(f)
        row[f"{name}_forward_s"] = _median(lambda: fwd(q, k, v), a.repeats)
        row[f"{name}_forward_backward_s"] = _median(lambda: bwd(q, k, v), a.repeats)
        print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "kernels"}), flush=True)
    return write_record(a.out, schedule=a.schedule, results=row)


if __name__ == "__main__":
    main()
