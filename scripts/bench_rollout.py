"""Rollout benchmark: the engine's decode step on a Qwen3-1.7B-shaped model (random bf16
weights), dense vs the paper's sparse schedule, timed on the GPU in one process.

Phases (``--phase``; each writes one JSON file and prints its tables):

* ``profile``: one random KV cache as wide as a 32K generation for every row (the page table,
  pool and loop state of ``generate(max_new_tokens=32768)``), at the largest batch that fits the
  device (``--batch 0``: computed from the free memory). For each mode the engine's own jitted
  chunk (``rollout.engine._run_chunk``: ``decode_step`` + LM head + sampling + bookkeeping, in
  the engine's ``while_loop``, so consecutive steps are chained) runs at fixed contexts; per step
  = chunk time / steps. Integrated over a 0..32K generation (every row generating to 32K,
  linear interpolation between the measured contexts): tokens/s = batch * 32768 / sum of step
  times, and the sparse/dense ratio. Split of the step: the same loop with attention replaced by
  the query itself (KV still written) and, further, with the LM head and sampling replaced by an
  argmax over 256 hidden units: attention = step - no_attention, LM head + sampling =
  no_attention - no_attention_no_head, the rest of the layers (matmuls, norms, RoPE, KV write)
  = no_attention_no_head.
* ``check``: the same fixed-context timings on the shapes of ``generate(max_new_tokens=N)``
  (default 8192), then one real ``generate`` run per mode (short random prompts, no EOS, same
  batch); the step times integrated over the run predict its wall time (compilation, timed
  through JAX's monitoring events, subtracted). Also the 32K-wide profile's times integrated
  over the same lengths (``--profile-json``) when given.

Bytes per step (for the roofline column): every weight once (embedding counted once, as the
tied LM head) plus the K/V read: dense, ``context`` tokens per layer; a sparse layer, the
centroids of the scored pages plus its budget's pages of K and V. Floor = bytes / read ceiling
(the faster of a sum and a max over a 4 GiB array, measured in the same run).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. python3 scripts/bench_rollout.py \
        --phase profile --out $OUT/rollout_profile.json

CPU smoke test (tiny shapes): ``--model tiny --contexts 40 80 --max-new 128 --batch 2``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.benchmarking import peak_bytes, read_ceiling
from sparrow_jax.attention.allocator import PageAllocator
from sparrow_jax.attention.paged_cache import PagedKVCache, append_token
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rollout import engine
from sparrow_jax.rollout.engine import RolloutConfig, generate
from sparrow_jax.schedule import BudgetSchedule

MODES = ("dense", "sparse")
PROFILE_CONTEXTS = (128, 2048, 4096, 6144, 8192, 12288, 16384, 20480, 24576, 28672, 32768)
TABLE_CONTEXTS = (2048, 4096, 8192, 16384, 32768)
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_seconds = [0.0]
DTYPE = [jnp.bfloat16]   # model, cache and pages (--dtype float32 for CPU smoke tests)


def _on_event(event, duration, **_):
    if event in _COMPILE_EVENTS:
        _compile_seconds[0] += duration


jax.monitoring.register_event_duration_secs_listener(_on_event)


# ------------------------------------------------------------------------------ set-up
BUCKET = [256]   # RolloutConfig.table_bucket_pages (--table-bucket)


def rollout_config(max_new: int, prompt_len: int) -> RolloutConfig:
    """Training-style sampling (temperature 1, no EOS), the engine's defaults otherwise."""
    del prompt_len
    return RolloutConfig(n=1, max_new_tokens=max_new, temperature=1.0, eos_ids=(),
                         table_bucket_pages=BUCKET[0])


def static_for(rc: RolloutConfig, cfg: ModelConfig, schedule, width: int) -> engine._Static:
    """The engine's static settings, built as ``generate`` builds them (same jit cache key)."""
    return engine._Static(
        sampling=rc.sampling, eos_ids=rc.eos_ids, stop_sequences=rc.stop_sequences,
        top_k=min(rc.logprob_top_k, cfg.vocab_size), schedule=schedule,
        dense_layers=rc.dense_layers, scorer=rc.scorer, impl=rc.impl,
        max_budget_pages=engine._max_budget_pages(schedule, width),
        prefill_chunk=rc.prefill_chunk, lora=False)


def layout(rc: RolloutConfig, cfg: ModelConfig, batch: int, prompt_len: int):
    """(num_pages, width, padded prompt length, allocation) as ``generate`` computes them."""
    p = rc.page_size
    lengths = np.full(batch, prompt_len, np.int32)
    prompt_pad = engine._round_up(prompt_len, rc.prompt_multiple)
    width = -(-(prompt_pad + rc.max_new_tokens) // p)
    num_pages = engine.pool_size(rc, cfg, lengths, DTYPE[0])
    alloc = PageAllocator(num_pages, p).allocate(lengths, 1, rc.max_new_tokens,
                                                 max_pages_per_seq=width)
    return num_pages, width, prompt_pad, alloc


def bytes_per_row(cfg: ModelConfig, rc: RolloutConfig, prompt_len: int) -> int:
    """Device bytes one row of a ``generate`` call holds: its pages (K, V, centroid) and its loop
    state (tokens, log-probs, top-k, budgets, partial page sums)."""
    p = rc.page_size
    per_page = (cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * (2 * p + 1)
                * jnp.dtype(DTYPE[0]).itemsize)
    pages = int(engine.pages_needed(np.array([prompt_len]), 1, rc.max_new_tokens, p)[0])
    r, k = rc.max_new_tokens, rc.logprob_top_k
    state = 4 * (r + 64) + 4 * r * (2 + 2 * k) + 4 * cfg.num_hidden_layers * (
        cfg.num_key_value_heads * cfg.head_dim)
    return pages * per_page + state


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _random_layer(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _random_pages(key, shape, dtype):
    """Normal random arrays, one per layer: ``shape = (L, ...)`` -> L arrays ``shape[1:]``."""
    return tuple(_random_layer(jax.random.fold_in(key, layer), shape[1:], dtype)
                 for layer in range(shape[0]))


def random_state(cfg: ModelConfig, rc: RolloutConfig, batch: int, prompt_len: int, key):
    """The engine's loop state for ``batch`` rows of a ``generate(max_new_tokens=R)`` call,
    with a random cache (keys, values and centroids normal) in every page; contexts are set
    with :func:`at_context`."""
    num_pages, width, prompt_pad, alloc = layout(rc, cfg, batch, prompt_len)
    L, H, D, P = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, rc.page_size)
    dtype = DTYPE[0]
    keys = jax.random.split(key, 6)
    cache = PagedKVCache(
        k_pages=_random_pages(keys[0], (L, H, num_pages, P, D), dtype),
        v_pages=_random_pages(keys[1], (L, H, num_pages, P, D), dtype),
        page_table=jnp.asarray(alloc.page_table),
        lengths=jnp.full((batch,), prompt_len, jnp.int32),
        centroids=_random_pages(keys[2], (L, H, num_pages, D), dtype),
        partial_sum=jnp.zeros((L, batch, H, D), jnp.float32), page_size=P)
    r, k = rc.max_new_tokens, min(rc.logprob_top_k, cfg.vocab_size)
    tokens = jax.random.randint(keys[3], (batch, prompt_pad + r), 0, cfg.vocab_size, jnp.int32)
    state = engine._Loop(
        cache=cache, tokens=tokens, prompt_lengths=jnp.full((batch,), prompt_len, jnp.int32),
        last=tokens[:, 0], response_lengths=jnp.ones((batch,), jnp.int32),
        finish=jnp.full((batch,), engine._UNFINISHED, jnp.int32),
        logprobs=jnp.zeros((batch, r), jnp.float32), topk_ids=jnp.zeros((batch, r, k), jnp.int32),
        topk_logprobs=jnp.full((batch, r, k), -jnp.inf, jnp.float32),
        budgets=jnp.zeros((batch, r), jnp.int32), streams=jax.random.split(keys[4], batch))
    return jax.block_until_ready(state), (width, np.asarray(alloc.page_table))


def at_context(state: engine._Loop, length: int) -> engine._Loop:
    """Every row with ``length`` tokens in its cache (prompt + response - 1, as in the loop)."""
    b = state.last.shape[0]
    p = state.prompt_lengths
    return state._replace(
        cache=state.cache.replace(lengths=jnp.full((b,), length, jnp.int32)),
        response_lengths=jnp.full((b,), length, jnp.int32) - p + 1,
        finish=jnp.full((b,), engine._UNFINISHED, jnp.int32))


# ------------------------------------------------------------------------------ timing
@functools.partial(jax.jit, static_argnames=("graphdef", "num_steps", "static", "variant"),
                   donate_argnames=("state",))
def _variant_chunk(graphdef, params, state, num_steps, *, static, variant):
    """The engine's loop body with attention replaced by the query (K/V still written) and,
    for ``variant="no_attention_no_head"``, the LM head + sampling + bookkeeping replaced by an
    argmax over 256 hidden units (the next step still depends on this one)."""
    model = nnx.merge(graphdef, params)
    head = model.head_weight()

    def body(_, st):
        pos = st.cache.lengths
        active = st.active
        cache = st.cache.replace(lengths=pos + active.astype(jnp.int32))

        def attend(layer, q, k, v, c):
            return q, append_token(c, layer, k[:, 0], v[:, 0], pos, active)

        hidden, cache = model.forward(st.last[:, None], pos[:, None], attend=attend, state=cache,
                                      lora=static.lora)
        hidden = hidden[:, 0]
        st = st._replace(cache=cache)
        if variant == "no_attention":
            return engine._emit(st, hidden, head, jnp.zeros_like(st.last), static)
        token = jnp.argmax(hidden[:, :256].astype(jnp.float32), axis=-1).astype(jnp.int32)
        return st._replace(last=token)

    return jax.lax.fori_loop(0, num_steps, body, state)


def run_chunk(graphdef, params, state, steps, static, variant="engine"):
    if variant == "engine":
        state, _ = engine._run_chunk(graphdef, params, state, steps, static=static)
        return state
    return _variant_chunk(graphdef, params, state, steps, static=static, variant=variant)


def time_contexts(graphdef, params, state, static, contexts, *, steps, repeats, limit, table,
                  variant="engine", label=""):
    """Per-step seconds at each context: ``repeats`` chunks of ``steps`` chained steps from a
    start placed so that their mean context is the one asked for (clamped so no row reaches
    the response capacity), each chunk seeing the page-table width ``generate`` would give
    it (``table = (full width, host table)``; the width that holds the last chunk). -> (state,
    rows)."""
    rows = []
    warmed = set()
    width, host_table = table
    page_size = state.cache.page_size
    for ctx in contexts:
        span = steps * repeats
        start = max(1, min(ctx - span // 2, limit - span - 1))
        w = engine._table_width(start + span + 1, page_size, width, BUCKET[0])
        if state.cache.page_table.shape[1] != w:
            state = state._replace(cache=state.cache.replace(
                page_table=jnp.asarray(host_table[:, :w])))
        static = static._replace(max_budget_pages=engine._max_budget_pages(static.schedule, w))
        state = at_context(state, start)
        if w not in warmed:
            warmed.add(w)
            c0 = _compile_seconds[0]
            t0 = time.perf_counter()
            state = jax.block_until_ready(run_chunk(graphdef, params, state, steps, static,
                                                    variant))
            print(f"  {label} {variant} table width {w}: compile + first chunk "
                  f"{time.perf_counter() - t0:.1f} s (compile {_compile_seconds[0] - c0:.1f} s)",
                  flush=True)
            state = at_context(state, start)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            state = jax.block_until_ready(run_chunk(graphdef, params, state, steps, static,
                                                    variant))
            times.append((time.perf_counter() - t0) / steps)
        active = bool(jnp.all(state.active))
        got = int(state.cache.lengths[0])
        if not active or got != start + span:
            raise RuntimeError(f"{label} {variant} at {ctx}: rows stopped (active={active}, "
                               f"length {got}, expected {start + span})")
        mean_ctx = start + span / 2
        t = statistics.median(times)
        rows.append(dict(context=ctx, mean_context=mean_ctx, table_width=w, step_ms=1e3 * t,
                         step_ms_all=[1e3 * x for x in times]))
        print(f"  {label} {variant} ctx {mean_ctx:.0f}: {1e3 * t:.3f} ms/step "
              f"(spread {1e3 * (max(times) - min(times)):.3f})", flush=True)
    return state, rows


def integrate(rows, first: int, last: int) -> float:
    """Seconds of the decode steps at lengths ``first .. last`` (inclusive), linear interpolation
    between measured mean contexts (flat beyond them)."""
    xs = np.array([r["mean_context"] for r in rows])
    ys = np.array([r["step_ms"] for r in rows]) / 1e3
    lengths = np.arange(first, last + 1)
    return float(np.interp(lengths, xs, ys).sum())


def emit_breakdown(model, batch, static, iters=200):
    """ms per step of the LM head and sampling pieces, each in a chained loop (the next hidden
    state is the embedding of the token drawn): head (logits + argmax), + log_softmax,
    + sampling, + top-k (the engine's ``lax.top_k``), and the two-stage top-k instead."""
    from sparrow_jax.models.qwen3 import logits_from_hidden
    from sparrow_jax.rollout.sampling import sample_from_logprobs, scaled_log_softmax

    head = model.head_weight()
    k = static.top_k
    h0 = jax.random.normal(jax.random.key(5), (batch, head.shape[1]), head.dtype)
    out = {}
    for kind in ("head", "log_softmax", "sample", "top_k", "top_k_two_stage"):
        def body(_, carry, kind=kind):
            h, key = carry
            logits = logits_from_hidden(h, head)
            if kind == "head":
                tok = jnp.argmax(logits, axis=-1)
            else:
                logp = scaled_log_softmax(logits, static.sampling.temperature)
                if kind == "log_softmax":
                    tok = jnp.argmax(logp, axis=-1)
                else:
                    key, sub = jax.random.split(key)
                    tok, lp = sample_from_logprobs(sub, logp, static.sampling)
                    if kind != "sample":
                        top = (jax.lax.top_k(logp, k) if kind == "top_k"
                               else engine.top_k(logp, k))
                        tok = jnp.where(top[0][:, 0] + lp > -jnp.inf, tok, top[1][:, 1])
            return head[tok.astype(jnp.int32)], key

        f = jax.jit(lambda h, key: jax.lax.fori_loop(0, iters, body, (h, key)))
        jax.block_until_ready(f(h0, jax.random.key(0)))
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(f(h0, jax.random.key(0)))
            times.append((time.perf_counter() - t0) / iters)
        out[kind] = 1e3 * statistics.median(times)
        print(f"  emit breakdown {kind}: {out[kind]:.3f} ms/step", flush=True)
    # Same ids and values as lax.top_k.
    logp = jax.nn.log_softmax(logits_from_hidden(h0, head).astype(jnp.float32), axis=-1)
    a, b = jax.lax.top_k(logp, k), engine.top_k(logp, k)
    out["two_stage_matches"] = bool(jnp.all(a[1] == b[1]) & jnp.all(a[0] == b[0]))
    return out


# ------------------------------------------------------------------------------ roofline
def weight_bytes(model) -> int:
    params = nnx.state(model, nnx.Param)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    if not model.config.tie_word_embeddings:
        total -= model.embed_tokens[...].nbytes   # the embedding is gathered, not read
    return int(total)


def kv_bytes(cfg: ModelConfig, batch: int, ctx: int, schedule, dense_layers, page_size=16):
    """K/V (and centroid) bytes one decode step reads at context ``ctx``, all layers."""
    h, d, e = cfg.num_key_value_heads, cfg.head_dim, jnp.dtype(DTYPE[0]).itemsize
    dense = batch * h * ctx * d * e * 2
    if schedule is None:
        return cfg.num_hidden_layers * dense
    n = -(-ctx // page_size)
    k = int(np.asarray(schedule.budget_pages(np.array([ctx])))[0])
    sparse = dense if n <= k else batch * h * ((n - 3) * d * e + k * page_size * d * e * 2)
    nd = len([x for x in dense_layers if x < cfg.num_hidden_layers])
    return nd * dense + (cfg.num_hidden_layers - nd) * sparse


# ------------------------------------------------------------------------------ phases
def pick_batch(cfg, rc, prompt_len, model, margin_gib):
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        raise SystemExit("--batch 0 needs a device that reports its memory; give --batch")
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    per_row = bytes_per_row(cfg, rc, prompt_len)
    batch = int((free - margin_gib * 2 ** 30) // per_row)
    info = dict(bytes_limit=stats["bytes_limit"], bytes_in_use=stats.get("bytes_in_use", 0),
                free=free, per_row_bytes=per_row, margin_gib=margin_gib, batch=batch)
    print(f"memory: limit {stats['bytes_limit'] / 2**30:.1f} GiB, in use "
          f"{stats.get('bytes_in_use', 0) / 2**30:.1f} GiB, a {rc.max_new_tokens}-token row "
          f"{per_row / 2**30:.3f} GiB -> batch {batch}", flush=True)
    return batch, info


def schedule_for(mode):
    return None if mode == "dense" else BudgetSchedule.paper("qwen3-1.7b")


def phase_profile(args, model, cfg, graphdef, params, ceiling, wbytes, out):
    rc = rollout_config(args.max_new, args.prompt_len)
    if args.batch:
        batch, mem = args.batch, {}
    else:
        batch, mem = pick_batch(cfg, rc, args.prompt_len, model, args.margin_gib)
    out.update(batch=batch, memory=mem, max_new=args.max_new)
    state, table = random_state(cfg, rc, batch, args.prompt_len, jax.random.key(1))
    width = table[0]
    out["peak_bytes_after_cache"] = peak_bytes()
    limit = args.prompt_len + args.max_new - 1   # a row finishes when its length reaches this
    contexts = [c for c in args.contexts if c < limit + args.steps] or args.contexts
    out["modes"] = {}
    for mode in args.modes:
        sched = schedule_for(mode)
        static = static_for(rc, cfg, sched, width)
        state, rows = time_contexts(graphdef, params, state, static, contexts, steps=args.steps,
                                    repeats=args.repeats, limit=limit, table=table, label=mode)
        for r in rows:
            kb = kv_bytes(cfg, batch, int(r["mean_context"]), sched, rc.dense_layers)
            r.update(bytes=wbytes + kb, floor_ms=1e3 * (wbytes + kb) / (ceiling * 1e9))
        total = integrate(rows, 1, args.max_new)
        out["modes"][mode] = dict(rows=rows, integrated_s=total,
                                  tokens_per_s=batch * args.max_new / total,
                                  peak_bytes=peak_bytes())
    if set(MODES) <= set(out["modes"]):
        out["ratio"] = (out["modes"]["sparse"]["tokens_per_s"]
                        / out["modes"]["dense"]["tokens_per_s"])
    if args.split:
        static = static_for(rc, cfg, None, width)
        split_ctx = [min(args.contexts[-1], 16384)]
        split = {}
        for variant in ("no_attention", "no_attention_no_head"):
            state, rows = time_contexts(graphdef, params, state, static, split_ctx,
                                        steps=args.steps, repeats=args.repeats, limit=limit,
                                        table=table, variant=variant, label="split")
            split[variant] = rows[0]["step_ms"]
        out["split"] = split
    if args.emit_breakdown:
        out["emit_breakdown"] = emit_breakdown(model, batch, static_for(rc, cfg, None, width))
    out["peak_bytes"] = peak_bytes()
    del state


def phase_check(args, model, cfg, graphdef, params, ceiling, wbytes, out):
    rc = rollout_config(args.max_new, args.prompt_len)
    batch = args.batch
    if not batch:
        full = rollout_config(32768, args.prompt_len)
        batch, mem = pick_batch(cfg, full, args.prompt_len, model, args.margin_gib)
        out["memory"] = mem
    out.update(batch=batch, max_new=args.max_new)
    limit = args.prompt_len + args.max_new - 1
    contexts = sorted({min(c, limit) for c in args.contexts})
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (batch, args.prompt_len)).tolist()
    profile = None
    if args.profile_json:
        with open(args.profile_json) as f:
            profile = json.load(f)
    out["modes"] = {}
    for mode in args.modes:
        sched = schedule_for(mode)
        state, table = random_state(cfg, rc, batch, args.prompt_len, jax.random.key(2))
        static = static_for(rc, cfg, sched, table[0])
        state, rows = time_contexts(graphdef, params, state, static, contexts, steps=args.steps,
                                    repeats=args.repeats, limit=limit, table=table, label=mode)
        del state
        # Decode steps of the run: the first token comes from the prefill; step j (1-based)
        # attends to prompt + j tokens.
        first, last = args.prompt_len + 1, args.prompt_len + args.max_new - 1
        predicted = integrate(rows, first, last)
        c0 = _compile_seconds[0]
        t0 = time.perf_counter()
        rollout = generate(model, prompts, rc, jax.random.key(3), schedule=sched)
        jax.block_until_ready(rollout.tokens)
        wall = time.perf_counter() - t0
        compile_s = _compile_seconds[0] - c0
        lengths = np.asarray(rollout.response_lengths)
        budgets = np.asarray(rollout.budget_pages)
        measured = wall - compile_s
        entry = dict(rows=rows, predicted_s=predicted, generate_wall_s=wall,
                     generate_compile_s=compile_s, generate_s=measured,
                     error=measured / predicted - 1,
                     tokens_per_s=float(lengths.sum()) / measured,
                     response_lengths=[int(lengths.min()), int(lengths.max())],
                     budget_pages_last=int(budgets[0, -1]), peak_bytes=peak_bytes())
        if profile is not None and mode in profile.get("modes", {}):
            entry["predicted_from_profile_s"] = integrate(profile["modes"][mode]["rows"], first,
                                                          last)
        out["modes"][mode] = entry
        print(f"  {mode}: generate {measured:.2f} s (+{compile_s:.1f} s compile), predicted "
              f"{predicted:.2f} s ({100 * entry['error']:+.1f}%)"
              + (f", from the 32K profile {entry['predicted_from_profile_s']:.2f} s"
                 if "predicted_from_profile_s" in entry else ""), flush=True)
        del rollout
    out["peak_bytes"] = peak_bytes()


# ------------------------------------------------------------------------------ report
def report(out):
    lines = []
    b = out["batch"]
    ceiling = out["read_ceiling_gb_s"]
    if out["phase"] == "profile":
        modes = out["modes"]
        lines.append(f"batch {b}, weights {out['weight_bytes'] / 1e9:.2f} GB, read ceiling "
                     f"{ceiling:.0f} GB/s; ms per decode step (floor = bytes / ceiling)")
        lines.append("| context | " + " | ".join(f"{m} ms (floor)" for m in modes)
                     + (" | sparse/dense |" if len(modes) == 2 else " |"))
        lines.append("| --- " * (1 + len(modes) + (len(modes) == 2)) + "|")
        by_ctx = {m: {r["context"]: r for r in modes[m]["rows"]} for m in modes}
        for ctx in sorted(set().union(*[set(v) for v in by_ctx.values()])):
            cells = []
            for m in modes:
                r = by_ctx[m].get(ctx)
                cells.append("" if r is None else f"{r['step_ms']:.3f} ({r['floor_ms']:.3f})")
            ratio = ""
            if len(modes) == 2 and all(ctx in by_ctx[m] for m in modes):
                d, sp = by_ctx["dense"][ctx]["step_ms"], by_ctx["sparse"][ctx]["step_ms"]
                ratio = f" | {d / sp:.2f}"
            lines.append(f"| {ctx} | " + " | ".join(cells) + ratio + " |")
        for m in modes:
            lines.append(f"{m}: 0..{out['max_new']} integrated {modes[m]['integrated_s']:.1f} s, "
                         f"{modes[m]['tokens_per_s']:.0f} tokens/s")
        if "ratio" in out:
            lines.append(f"sparse/dense tokens/s over 0..{out['max_new']}: {out['ratio']:.2f}x "
                         "(target >= 2.2x)")
        if "split" in out:
            s = out["split"]
            lines.append(f"split: no_attention {s['no_attention']:.3f} ms, "
                         f"no_attention_no_head {s['no_attention_no_head']:.3f} ms "
                         f"(LM head + sampling {s['no_attention'] - s['no_attention_no_head']:.3f}"
                         f" ms); attention = step - {s['no_attention']:.3f}")
    else:
        for m, e in out["modes"].items():
            lines.append(f"{m}: generate {out['max_new']} tokens x {b} rows in "
                         f"{e['generate_s']:.2f} s ({e['tokens_per_s']:.0f} tokens/s; compile "
                         f"{e['generate_compile_s']:.1f} s excluded), predicted "
                         f"{e['predicted_s']:.2f} s ({100 * e['error']:+.1f}%)")
    if "emit_breakdown" in out:
        e = out["emit_breakdown"]
        lines.append("LM head + sampling pieces (ms/step, cumulative): " + ", ".join(
            f"{k} {v:.3f}" for k, v in e.items() if k != "two_stage_matches")
            + f"; two-stage top-k matches lax.top_k: {e['two_stage_matches']}")
    if out.get("peak_bytes"):
        lines.append(f"peak device memory {out['peak_bytes'] / 2**30:.2f} GiB")
    print("\n".join(lines), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=("profile", "check"), default="profile")
    ap.add_argument("--model", default="qwen3-1.7b", help="a preset of configs/models")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    ap.add_argument("--max-new", type=int, default=None,
                    help="response capacity R (profile: 32768; check: 8192)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=0, help="0: the largest whose 32K cache fits")
    ap.add_argument("--margin-gib", type=float, default=3.0,
                    help="device memory left free when sizing the batch")
    ap.add_argument("--steps", type=int, default=64,
                    help="steps per timed chunk (64: the engine's steps_per_call, so the check "
                         "phase shares its compilation with generate)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--split", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--profile-json", default=None,
                    help="check: also integrate this profile's step times over the run")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="weights and cache (float32: CPU smoke tests; XLA:CPU has no bf16 dots "
                         "to float32 in the prefill)")
    ap.add_argument("--table-bucket", type=int, default=256,
                    help="RolloutConfig.table_bucket_pages (0: always the full table width)")
    ap.add_argument("--emit-breakdown", action=argparse.BooleanOptionalAction, default=True,
                    help="profile: time the LM head and the sampling pieces apart")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.max_new is None:
        args.max_new = 32768 if args.phase == "profile" else 8192
    if args.contexts is None:
        args.contexts = (list(PROFILE_CONTEXTS) if args.phase == "profile"
                         else [128, 2048, 4096, 6144, 8192])

    dev = jax.devices()[0]
    print(f"device {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}",
          flush=True)
    cfg = ModelConfig.preset(args.model)
    small = jax.default_backend() == "cpu"
    DTYPE[0] = jnp.dtype(args.dtype)
    BUCKET[0] = args.table_bucket or None
    model = init_model(cfg, dtype=DTYPE[0], param_dtype=DTYPE[0])
    graphdef, params = nnx.split(model)
    ceiling = read_ceiling(small=small)
    wbytes = weight_bytes(model)
    print(f"read ceiling {ceiling:.0f} GB/s; weights {wbytes / 1e9:.2f} GB", flush=True)
    out = dict(phase=args.phase, argv=sys.argv[1:], device=dev.device_kind,
               backend=jax.default_backend(), jax=jax.__version__,
               date=datetime.date.today().isoformat(), model=args.model,
               read_ceiling_gb_s=ceiling, weight_bytes=wbytes, prompt_len=args.prompt_len,
               steps=args.steps, repeats=args.repeats)
    t0 = time.perf_counter()
    try:
        if args.phase == "profile":
            phase_profile(args, model, cfg, graphdef, params, ceiling, wbytes, out)
        else:
            phase_check(args, model, cfg, graphdef, params, ceiling, wbytes, out)
    finally:
        out["seconds"] = time.perf_counter() - t0
        out["compile_seconds"] = _compile_seconds[0]
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    report(out)


if __name__ == "__main__":
    main()
