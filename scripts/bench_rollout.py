"""Rollout benchmark: the engine's decode step on a Qwen3-1.7B-shaped model (random bf16
weights), dense vs the paper's sparse schedule, timed on the GPU in one process.

Phases (``--phase``; each writes one JSON file and prints its tables):

* ``profile``: one random KV cache as wide as a 32K generation for every row (the page table,
  pool and loop state of ``generate(max_new_tokens=32768)``, built by
  ``sparrow_jax.rollout.profile.fixed_context_batch``), at the largest batch that fits the
  device (``--batch 0``: computed from the free memory). For each mode the engine's own jitted
  chunk (``sparrow_jax.rollout.engine.decode_chunk``: ``decode_step`` + LM head + sampling +
  bookkeeping, in the engine's ``while_loop``, so consecutive steps are chained) runs at fixed
  contexts (``sparrow_jax.rollout.profile.time_context``); per step = chunk time / steps.
  ``--mesh 2,1,1`` / ``--mesh 1,1,2``: the same on generate's data / tensor mesh. Integrated
  over a 0..32K generation (every row generating to 32K, linear interpolation between the
  measured contexts): tokens/s = batch * 32768 / sum of step times, and the sparse/dense
  ratio. Split of the step: the same loop with attention replaced by
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
centroids of the scored pages (``--scorer quest``: their kmin and kmax) plus its budget's pages
of K and V. Floor = bytes / read ceiling (the faster of a sum and a max over a 4 GiB array,
measured in the same run).

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. python3 scripts/bench_rollout.py \
        --phase profile --out $OUT/rollout_profile.json

* ``refill``: refill vs the static engine on a length mix (``--rows`` prompts capped by
  ``--length-mix``, static batches of ``--batch``, ``--slots`` refill slots, the same pool); see
  :func:`phase_refill`.
* ``refill-model``: the same comparison priced rather than run (:func:`phase_refill_model`):
  both engines' chunks replayed on the host, fixed-context step times measured at both slot
  counts; ``--refill-json`` checks it against a ``refill`` run of the same arguments.

CPU smoke tests (tiny shapes): ``--model tiny --dtype float32 --contexts 40 80 --max-new 128
--batch 2 --steps 8``; ``--phase refill --model tiny --dtype float32 --max-new 64 --batch 4
--rows 8 --steps 8``; ``--phase refill-model`` with the same and ``--contexts 16 64 128``.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from sparrow_jax.attention.allocator import pages_needed
from sparrow_jax.attention.paged_cache import prep_and_append_token
from sparrow_jax.benchmarking import peak_bytes, read_ceiling
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rollout.decode_loop import emit, top_k
from sparrow_jax.rollout.chunk_time import SlotStepTimes, predict_seconds, static_chunks
from sparrow_jax.rollout.engine import RolloutConfig, generate, page_bytes, prompt_width
from sparrow_jax.rollout.length_mix import KINDS, length_mix
from sparrow_jax.rollout.profile import fixed_context_batch, time_context
from sparrow_jax.rollout.refill import run_refill
from sparrow_jax.rollout.refill_schedule import simulate_refill
from sparrow_jax.schedule import BudgetSchedule
from sparrow_jax.sharding import MeshConfig, make_mesh

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
STEPS = [64]     # RolloutConfig.steps_per_call (--steps)
SCORER = ["centroid"]   # RolloutConfig.scorer (--scorer)


def rollout_config(max_new: int) -> RolloutConfig:
    """Training-style sampling (temperature 1, no EOS), the engine's defaults otherwise."""
    return RolloutConfig(n=1, max_new_tokens=max_new, temperature=1.0, eos_ids=(),
                         table_bucket_pages=BUCKET[0], steps_per_call=STEPS[0],
                         cache_dtype=jnp.dtype(DTYPE[0]).name, scorer=SCORER[0])


def bytes_per_row(cfg: ModelConfig, rc: RolloutConfig, prompt_len: int) -> int:
    """Device bytes one row of a ``generate`` call holds: its pages (K, V, centroid; Quest's
    kmin and kmax) and its loop state (tokens, log-probs, top-k, budgets, partial page sums)."""
    per_page = page_bytes(cfg, rc.page_size, DTYPE[0], scorer=rc.scorer)
    pages = int(pages_needed(np.array([prompt_len]), 1, rc.max_new_tokens, rc.page_size)[0])
    r, k = rc.max_new_tokens, rc.logprob_top_k
    state = 4 * (r + 64) + 4 * r * (2 + 2 * k) + 4 * cfg.num_hidden_layers * (
        cfg.num_key_value_heads * cfg.head_dim)
    return pages * per_page + state


# ------------------------------------------------------------------------------ timing
@functools.partial(jax.jit, static_argnames=("graphdef", "num_steps", "settings", "variant"),
                   donate_argnames=("state",))
def _variant_chunk(graphdef, params, state, num_steps, *, settings, variant):
    """The engine's loop body with attention replaced by the query (K/V still written) and,
    for ``variant="no_attention_no_head"``, the LM head + sampling + bookkeeping replaced by an
    argmax over 256 hidden units (the next step still depends on this one)."""
    model = nnx.merge(graphdef, params)

    def body(_, st):
        pos = st.cache.lengths
        active = st.active
        cache = st.cache.replace(lengths=pos + active.astype(jnp.int32))

        def attend(layer, q, k, v, c, prep):
            q, c = prep_and_append_token(c, layer, q[:, 0], k[:, 0], v[:, 0], pos, active, prep)
            return q[:, None], c

        hidden, cache = model.forward(st.last[:, None], pos[:, None], attend=attend, state=cache,
                                      lora=settings.lora, decode_kernels="auto")
        hidden = hidden[:, 0]
        st = st._replace(cache=cache)
        if variant == "no_attention":
            return emit(st, model.logits(hidden), jnp.zeros_like(st.last), settings)
        token = jnp.argmax(hidden[:, :256].astype(jnp.float32), axis=-1).astype(jnp.int32)
        return st._replace(last=token)

    return jax.lax.fori_loop(0, num_steps, body, state)


def time_contexts(batch, graphdef, params, state, contexts, *, repeats, variant="engine",
                  label="", live=None):
    """Per-step seconds at each context (:func:`sparrow_jax.rollout.profile.time_context`: the
    engine's own chunk, or a variant of its body; ``live``: only that many rows running) ->
    (state, rows)."""
    def variant_chunk(st, reach):
        del reach   # the variants attend to nothing: any table width
        return _variant_chunk(graphdef, params, st, batch.config.steps_per_call,
                              settings=batch.settings, variant=variant)

    run = None if variant == "engine" else variant_chunk
    rows = []
    for ctx in contexts:
        c0 = _compile_seconds[0]
        state, timing = time_context(batch, graphdef, params, state, ctx, repeats=repeats,
                                     run=run, live=live)
        times = timing.step_seconds
        t = statistics.median(times)
        rows.append(dict(context=ctx, mean_context=timing.mean_context,
                         table_width=timing.table_width, gather_width=timing.gather_width,
                         step_ms=1e3 * t, step_ms_all=[1e3 * x for x in times]))
        print(f"  {label} {variant}{'' if live is None else f' ({live} running)'} ctx "
              f"{timing.mean_context:.0f} (table width "
              f"{timing.table_width}): {1e3 * t:.3f} ms/step (spread "
              f"{1e3 * (max(times) - min(times)):.3f}; first chunk "
              f"{timing.first_chunk_seconds:.1f} s, compile {_compile_seconds[0] - c0:.1f} s)",
              flush=True)
    return state, rows


def integrate(rows, first: int, last: int) -> float:
    """Seconds of the decode steps at lengths ``first .. last`` (inclusive), linear interpolation
    between measured mean contexts (flat beyond them)."""
    xs = np.array([r["mean_context"] for r in rows])
    ys = np.array([r["step_ms"] for r in rows]) / 1e3
    lengths = np.arange(first, last + 1)
    return float(np.interp(lengths, xs, ys).sum())


def emit_breakdown(model, batch, settings, iters=200):
    """ms per step of the LM head and sampling pieces, each in a chained loop (the next hidden
    state is the embedding of the token drawn): head (logits + argmax), + log_softmax,
    + sampling, + top-k (``lax.top_k``), and the engine's top-k by group maxima instead."""
    from sparrow_jax.models.qwen3 import logits_from_hidden
    from sparrow_jax.rollout.sampling import sample_from_logprobs, scaled_log_softmax

    head = model.head_weight()
    k = settings.top_k
    h0 = jax.random.normal(jax.random.key(5), (batch, head.shape[1]), head.dtype)
    out = {}
    for kind in ("head", "log_softmax", "sample", "top_k", "top_k_groups"):
        def body(_, carry, kind=kind):
            h, key = carry
            logits = logits_from_hidden(h, head)
            if kind == "head":
                tok = jnp.argmax(logits, axis=-1)
            else:
                logp = scaled_log_softmax(logits, settings.sampling.temperature)
                if kind == "log_softmax":
                    tok = jnp.argmax(logp, axis=-1)
                else:
                    key, sub = jax.random.split(key)
                    tok, lp = sample_from_logprobs(sub, logp, settings.sampling)
                    if kind != "sample":
                        top = (jax.lax.top_k(logp, k) if kind == "top_k"
                               else top_k(logp, k))
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
    a, b = jax.lax.top_k(logp, k), top_k(logp, k)
    out["groups_match"] = bool(jnp.all(a[1] == b[1]) & jnp.all(a[0] == b[0]))
    return out


# ------------------------------------------------------------------------------ roofline
def weight_bytes(model) -> int:
    params = nnx.state(model, nnx.Param)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    if not model.config.tie_word_embeddings:
        total -= model.embed_tokens[...].nbytes   # the embedding is gathered, not read
    return int(total)


def kv_bytes(cfg: ModelConfig, batch: int, ctx: int, schedule, dense_layers, page_size=16):
    """K/V (and page summary) bytes one decode step reads at context ``ctx``, all layers."""
    h, d, e = cfg.num_key_value_heads, cfg.head_dim, jnp.dtype(DTYPE[0]).itemsize
    dense = batch * h * ctx * d * e * 2
    if schedule is None:
        return cfg.num_hidden_layers * dense
    n = -(-ctx // page_size)
    k = int(np.asarray(schedule.budget_pages(np.array([ctx])))[0])
    summaries = 2 if SCORER[0] == "quest" else 1
    sparse = dense if n <= k else batch * h * ((n - 3) * d * e * summaries
                                               + k * page_size * d * e * 2)
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


def phase_profile(args, model, cfg, ceiling, wbytes, out, mesh):
    rc = rollout_config(args.max_new)
    if args.batch:
        batch, mem = args.batch, {}
    else:
        batch, mem = pick_batch(cfg, rc, args.prompt_len, model, args.margin_gib)
    out.update(batch=batch, memory=mem, max_new=args.max_new)
    limit = args.prompt_len + args.max_new - 1   # a row finishes when its length reaches this
    contexts = [c for c in args.contexts if c < limit + args.steps] or args.contexts
    out["modes"] = {}
    state = None
    for mode in args.modes:
        sched = schedule_for(mode)
        del state   # one batch's pool at a time
        plan, graphdef, params, state = fixed_context_batch(
            model, rc, rows=batch, prompt_len=args.prompt_len, key=jax.random.key(1),
            schedule=sched, mesh=mesh)
        out.setdefault("peak_bytes_after_cache", peak_bytes())
        state, rows = time_contexts(plan, graphdef, params, state, contexts,
                                    repeats=args.repeats, label=mode)
        for r in rows:
            kb = kv_bytes(cfg, batch, int(r["mean_context"]), sched, rc.dense_layers)
            r.update(bytes=wbytes + kb, floor_ms=1e3 * (wbytes + kb) / (ceiling * 1e9))
            if sched is not None:   # what `sparrow calibrate`'s step_times file reads
                r["budget_pages"] = int(sched.budget_pages(int(r["mean_context"])))
        total = integrate(rows, 1, args.max_new)
        out["modes"][mode] = dict(rows=rows, integrated_s=total,
                                  tokens_per_s=batch * args.max_new / total,
                                  peak_bytes=peak_bytes())
    if set(MODES) <= set(out["modes"]):
        out["ratio"] = (out["modes"]["sparse"]["tokens_per_s"]
                        / out["modes"]["dense"]["tokens_per_s"])
    if args.split:
        split_ctx = [min(args.contexts[-1], 16384)]
        split = {}
        for variant in ("no_attention", "no_attention_no_head"):
            state, rows = time_contexts(plan, graphdef, params, state, split_ctx,
                                        repeats=args.repeats, variant=variant, label="split")
            split[variant] = rows[0]["step_ms"]
        out["split"] = split
    if args.emit_breakdown:
        out["emit_breakdown"] = emit_breakdown(model, batch, plan.settings)
    out["peak_bytes"] = peak_bytes()
    del state


def phase_check(args, model, cfg, ceiling, wbytes, out, mesh):
    rc = rollout_config(args.max_new)
    batch = args.batch
    if not batch:
        full = rollout_config(32768)
        batch, mem = pick_batch(cfg, full, args.prompt_len, model, args.margin_gib)
        out["memory"] = mem
    out.update(batch=batch, max_new=args.max_new)
    contexts = sorted({min(c, args.prompt_len + args.max_new - 1) for c in args.contexts})
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (batch, args.prompt_len)).tolist()
    profile = None
    if args.profile_json:
        with open(args.profile_json) as f:
            profile = json.load(f)
    out["modes"] = {}
    for mode in args.modes:
        sched = schedule_for(mode)
        plan, graphdef, params, state = fixed_context_batch(
            model, rc, rows=batch, prompt_len=args.prompt_len, key=jax.random.key(2),
            schedule=sched, mesh=mesh)
        state, rows = time_contexts(plan, graphdef, params, state, contexts,
                                    repeats=args.repeats, label=mode)
        del state, params
        # Decode steps of the run: the first token comes from the prefill; step j (1-based)
        # attends to prompt + j tokens.
        first, last = args.prompt_len + 1, args.prompt_len + args.max_new - 1
        predicted = integrate(rows, first, last)
        c0 = _compile_seconds[0]
        t0 = time.perf_counter()
        rollout = generate(model, prompts, rc, jax.random.key(3), schedule=sched, mesh=mesh)
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


def _save(args, out) -> None:
    """``out`` to ``--out`` now (a run cut short keeps what it measured)."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1,
                      default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x))


def _timed(label, fn):
    """(result, seconds without compilation, compile seconds) of ``fn()``."""
    c0 = _compile_seconds[0]
    t0 = time.perf_counter()
    result = jax.block_until_ready(fn())
    wall = time.perf_counter() - t0
    compile_s = _compile_seconds[0] - c0
    print(f"  {label}: {wall - compile_s:.2f} s (+{compile_s:.1f} s compile)", flush=True)
    return result, wall - compile_s, compile_s


def mix_setup(args, mesh) -> tuple[RolloutConfig, np.ndarray, int]:
    """The refill phases' shared set-up -> (the engine config with the pool a static batch of
    ``--batch`` rows needs at full length, each row's cap from ``--length-mix``, the slots);
    ``--prefill-rows`` 0 resolved here (16, or the slots if fewer)."""
    if mesh is not None or not args.batch or args.rows % args.batch:
        raise SystemExit(f"--phase {args.phase}: no --mesh; --batch B with --rows a multiple "
                         "of B")
    rc = rollout_config(args.max_new)
    pool = int(pages_needed(np.array([args.prompt_len]), 1, args.max_new, rc.page_size)[0]
               * args.batch + 1)
    caps = length_mix(args.length_mix, args.rows, args.max_new, seed=0)
    slots = args.slots or args.batch
    args.prefill_rows = args.prefill_rows or min(16, slots)
    return dataclasses.replace(rc, num_pages=pool), caps, slots


def phase_refill(args, model, cfg, ceiling, wbytes, out, mesh):
    """Refill vs static on a length mix: ``--rows`` prompts (one sample each), each capped at a
    length of ``--length-mix``; the static engine in batches of ``--batch`` prompts one after
    the other, refill with ``--slots`` slots over all of them, both with the pool the static
    batch needs at full length (same memory). Tokens/s = generated tokens / seconds to the last
    row's end (compilation excluded)."""
    del ceiling, wbytes
    rc, caps, slots = mix_setup(args, mesh)
    pool = rc.num_pages
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (args.rows, args.prompt_len)).tolist()
    out.update(batch=args.batch, rows=args.rows, slots=slots, num_pages=pool,
               max_new=args.max_new, length_mix=args.length_mix,
               caps=dict(mean=float(caps.mean()), median=float(np.median(caps)),
                         at_cap=float(np.mean(caps == args.max_new))), modes={})
    key = jax.random.key(3)
    for mode in args.modes:
        sched = schedule_for(mode)

        def static():
            outs = [generate(model, prompts[i:i + args.batch], rc, key, schedule=sched,
                             prompt_ids=range(i, i + args.batch),
                             max_new_tokens=caps[i:i + args.batch])
                    for i in range(0, args.rows, args.batch)]
            return np.concatenate([np.asarray(o.response_lengths) for o in outs])

        trace, stats = [], []
        clock = [time.perf_counter(), _compile_seconds[0]]

        def on_chunk(info):
            # The host waited for the chunk's results: the interval since the last call is
            # this chunk plus the admissions before it (compilation apart).
            now, comp = time.perf_counter(), _compile_seconds[0]
            ctx = info["contexts"]
            trace.append(dict(width=info["width"], steps=info["steps"], rows=len(ctx),
                              slots=info["slots"],
                              context_sum=int(ctx.sum()), context_max=int(ctx.max()),
                              contexts=sorted(ctx.tolist()), prefills=info["prefills"],
                              chunk_seconds=info["chunk_seconds"],
                              seconds=now - clock[0] - (comp - clock[1])))
            clock[:] = now, comp

        def refill():
            clock[:] = time.perf_counter(), _compile_seconds[0]
            ro, st = run_refill(model, prompts, rc, key, schedule=sched, slots=slots,
                                max_new_tokens=caps, prefill_rows=args.prefill_rows,
                                tail_slots=args.tail_slots or None, on_chunk=on_chunk)
            stats.append(dataclasses.asdict(st))
            return np.asarray(ro.response_lengths)

        entry = out["modes"][mode] = {}
        for name, fn in (("static", static), ("refill", refill)):
            lengths, seconds, compile_s = _timed(f"{mode} {name}", fn)
            entry[name] = dict(seconds=seconds, compile_s=compile_s,
                               tokens=int(lengths.sum()),
                               tokens_per_s=float(lengths.sum()) / seconds,
                               peak_bytes=peak_bytes())
            entry[name + "_lengths"] = lengths
            _save(args, {**out, "modes": {m: {k: v for k, v in e.items()
                                              if not k.endswith("_lengths")}
                                          for m, e in out["modes"].items()}})
        same = np.array_equal(entry.pop("static_lengths"), entry.pop("refill_lengths"))
        entry.update(same_lengths=same, refill_stats=stats[-1], refill_trace=trace,
                     speedup=entry["refill"]["tokens_per_s"] / entry["static"]["tokens_per_s"])
        print(f"  {mode}: refill/static {entry['speedup']:.2f}x; {stats[-1]}", flush=True)
    out["peak_bytes"] = peak_bytes()


def phase_refill_model(args, model, cfg, ceiling, wbytes, out, mesh):
    """Refill vs static where the end-to-end runs would not fit the machine (the 32K cap): both
    runs' chunks replayed on the host (``simulate_refill``, ``static_chunks``; rows run to
    their caps, as in ``--phase refill``) and priced with fixed-context step times measured
    here (``sparrow_jax.rollout.chunk_time``): the static batch at a short context at every
    table width its chunks use and at ``--contexts``, all rows running and one (its per-step
    term, the longest row's cost and each further row's); the refill slots at a short context
    at every width refill's chunks use (their per-step term). ``--refill-json``: a ``--phase
    refill`` run of the same arguments, whose measured seconds the predictions are checked
    against."""
    del ceiling, wbytes
    rc, caps, slots = mix_setup(args, mesh)
    p, c, pool = rc.page_size, rc.steps_per_call, rc.num_pages
    lengths = np.full(args.rows, args.prompt_len)
    width = -(-(prompt_width(lengths, rc) + args.max_new) // p)
    runs = {"refill": simulate_refill(lengths, caps, n=1, slots=slots, num_pages=pool,
                                      page_size=p, steps_per_call=c, width=width,
                                      prefill_rows=args.prefill_rows,
                                      table_bucket_pages=rc.table_bucket_pages,
                                      page_seed=rc.page_seed,
                                      tail_slots=args.tail_slots or None)[0],
            "static": static_chunks(lengths, caps, batch=args.batch, page_size=p,
                                    steps_per_call=c, width=width,
                                    table_bucket_pages=rc.table_bucket_pages)}
    # time_context clamps a context near the cap to the last that stays running.
    contexts = sorted({min(x, args.prompt_len + args.max_new) for x in args.contexts})
    measured = None
    if args.refill_json:
        with open(args.refill_json) as f:
            measured = json.load(f)
    out.update(batch=args.batch, rows=args.rows, slots=slots, num_pages=pool,
               max_new=args.max_new, length_mix=args.length_mix, tokens=int(caps.sum()),
               chunks={k: len(v) for k, v in runs.items()}, modes={})

    def short_points(batch, graphdef, params, state, chunks):
        points = []
        for w in sorted({ch["width"] for ch in chunks}):
            state, timing = time_context(batch, graphdef, params, state, args.prompt_len + c,
                                         repeats=args.repeats, min_width=w)
            points.append((timing.table_width, 1e3 * statistics.median(timing.step_seconds)))
        return state, points

    def points(rows):
        return [(r["mean_context"], r["table_width"], r["step_ms"]) for r in rows]

    key = jax.random.key(1)
    for mode in args.modes:
        sched = schedule_for(mode)
        entry = out["modes"][mode] = {}
        batch, graphdef, params, state = fixed_context_batch(
            model, rc, rows=args.batch, prompt_len=args.prompt_len, key=key, schedule=sched)
        state, short = short_points(batch, graphdef, params, state, runs["static"])
        state, rows = time_contexts(batch, graphdef, params, state, contexts,
                                    repeats=args.repeats, label=f"{mode} static")
        state, lone = time_contexts(batch, graphdef, params, state, contexts,
                                    repeats=args.repeats, label=f"{mode} static", live=1)
        batch = state = None                 # the pool freed before the next is built
        times = {"static": SlotStepTimes.from_points(args.batch, short, points(rows),
                                                     lone=points(lone))}
        # Each slot count refill's chunks run at (fewer in a narrowed tail), its per-step term
        # at the widths they use; the slots hold a short context's pages only
        # (time_context's span past the start).
        slot_short = {}
        for count in sorted({ch["slots"] for ch in runs["refill"]}, reverse=True):
            batch, graphdef, params, state = fixed_context_batch(
                model, rc, rows=count, prompt_len=args.prompt_len, key=key, schedule=sched,
                max_context=args.prompt_len + c * (args.repeats + 3))
            _, slot_short[count] = short_points(
                batch, graphdef, params, state, [ch for ch in runs["refill"]
                                                 if ch["slots"] == count])
            batch = state = None
        times["refill"] = {count: times["static"].with_slots(count, points_)
                           for count, points_ in slot_short.items()}
        entry["per_row"], entry["lone_row"] = rows, lone
        for run, chunks in runs.items():
            seconds = predict_seconds(chunks, times[run])
            entry[run] = dict(slots=slots if run == "refill" else args.batch,
                              short=short if run == "static" else slot_short[slots],
                              seconds=seconds, tokens_per_s=int(caps.sum()) / seconds)
            if run == "refill" and len(slot_short) > 1:
                entry[run]["tail_short"] = {str(k): v for k, v in slot_short.items()
                                            if k != slots}
            got = (measured or {}).get("modes", {}).get(mode, {}).get(run)
            if got:
                entry[run].update(measured_s=got["seconds"], error=seconds / got["seconds"] - 1)
            print(f"  {mode} {run}: predicted {seconds:.2f} s, "
                  f"{entry[run]['tokens_per_s']:.0f} tokens/s"
                  + (f" (measured {got['seconds']:.2f} s, {100 * entry[run]['error']:+.1f}%)"
                     if got else ""), flush=True)
        entry["speedup"] = entry["static"]["seconds"] / entry["refill"]["seconds"]
        # What bounds refill's gain: the rows' own cost (K/V reads, per-row work) is the same
        # whatever the slots; only the per-step term shrinks.
        # (Not positive where step times are noise against a tiny model's rows: no bound.)
        entry["rows_only_s"] = predict_seconds(
            runs["refill"], {k: t.rows_only() for k, t in times["refill"].items()})
        if entry["rows_only_s"] > 0:
            entry["speedup_bound"] = entry["static"]["seconds"] / entry["rows_only_s"]
            print(f"  {mode}: refill/static {entry['speedup']:.2f}x; the rows' own cost "
                  f"{entry['rows_only_s']:.2f} s bounds it at {entry['speedup_bound']:.2f}x",
                  flush=True)
        _save(args, out)
    if set(MODES) <= set(out["modes"]):
        m = out["modes"]
        out["sparse_over_dense"] = {run: m["dense"][run]["seconds"] / m["sparse"][run]["seconds"]
                                    for run in runs}
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
    elif out["phase"] == "refill":
        lines.append(f"{out['rows']} rows capped by the {out['length_mix']} mix (mean "
                     f"{out['caps']['mean']:.0f}, median {out['caps']['median']:.0f}, "
                     f"{100 * out['caps']['at_cap']:.0f}% at {out['max_new']}); static batches "
                     f"of {b}, refill {out['slots']} slots; pool {out['num_pages']} pages")
        lines.append("| mode | static tokens/s | refill tokens/s | refill/static | same lengths |")
        lines.append("| --- | --- | --- | --- | --- |")
        for m, e in out["modes"].items():
            lines.append(f"| {m} | {e['static']['tokens_per_s']:.0f} | "
                         f"{e['refill']['tokens_per_s']:.0f} | {e['speedup']:.2f} | "
                         f"{e['same_lengths']} |")
    elif out["phase"] == "refill-model":
        lines.append(f"{out['rows']} rows capped by the {out['length_mix']} mix at "
                     f"{out['max_new']} ({out['tokens']} tokens); static batches of {b}, "
                     f"refill {out['slots']} slots; chunks {out['chunks']}; predicted from "
                     "fixed-context steps")
        lines.append("| mode | run | slots | predicted s | measured s (error) |")
        lines.append("| --- | --- | --- | --- | --- |")
        for m, e in out["modes"].items():
            for r in ("static", "refill"):
                got = (f"{e[r]['measured_s']:.2f} ({100 * e[r]['error']:+.1f}%)"
                       if "measured_s" in e[r] else "-")
                lines.append(f"| {m} | {r} | {e[r]['slots']} | "
                             f"{e[r]['seconds']:.2f} | {got} |")
            lines.append(f"{m}: refill/static {e['speedup']:.2f}x"
                         + (f" (at most {e['speedup_bound']:.2f}x: the rows' own cost, "
                            f"{e['rows_only_s']:.2f} s, whatever the slots)"
                            if "speedup_bound" in e else ""))
        if "sparse_over_dense" in out:
            lines.append("sparse/dense tokens/s: " + ", ".join(
                f"{k} {v:.2f}x" for k, v in out["sparse_over_dense"].items()))
    else:
        for m, e in out["modes"].items():
            lines.append(f"{m}: generate {out['max_new']} tokens x {b} rows in "
                         f"{e['generate_s']:.2f} s ({e['tokens_per_s']:.0f} tokens/s; compile "
                         f"{e['generate_compile_s']:.1f} s excluded), predicted "
                         f"{e['predicted_s']:.2f} s ({100 * e['error']:+.1f}%)")
    if "emit_breakdown" in out:
        e = out["emit_breakdown"]
        lines.append("LM head + sampling pieces (ms/step, cumulative): " + ", ".join(
            f"{k} {v:.3f}" for k, v in e.items() if k != "groups_match")
            + f"; top-k by group maxima matches lax.top_k: {e['groups_match']}")
    if out.get("peak_bytes"):
        lines.append(f"peak device memory {out['peak_bytes'] / 2**30:.2f} GiB")
    print("\n".join(lines), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", choices=("profile", "check", "refill", "refill-model"),
                    default="profile")
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
    ap.add_argument("--mesh", default=None, metavar="DATA,FSDP,TENSOR",
                    help="profile/check on a (data, fsdp, tensor) mesh of that many devices "
                         "(generate's mesh support; needs --batch, no --split or "
                         "--emit-breakdown)")
    ap.add_argument("--rows", type=int, default=256, help="refill: prompts (one sample each)")
    ap.add_argument("--slots", type=int, default=0, help="refill: decode slots (0: --batch)")
    ap.add_argument("--prefill-rows", type=int, default=0,
                    help="refill: rows per admission call (one compilation; 0: 16 or the slots)")
    ap.add_argument("--tail-slots", type=int, default=0,
                    help="refill: once nothing is queued, run the last rows on fewer slots, "
                         "down to this many (run_refill's tail_slots; 0: never)")
    ap.add_argument("--length-mix", choices=KINDS, default="lognormal",
                    help="refill: the per-prompt caps' mix")
    ap.add_argument("--refill-json", default=None,
                    help="refill-model: a --phase refill run's JSON to check the prediction on")
    ap.add_argument("--scorer", choices=("centroid", "quest"), default="centroid",
                    help="the sparse mode's page scorer")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    mesh = None
    if args.mesh:
        sizes = tuple(int(x) for x in args.mesh.split(","))
        if len(sizes) != 3 or not args.batch:
            raise SystemExit(f"--mesh {args.mesh!r}: give three axis sizes, and a --batch")
        mesh = make_mesh(MeshConfig(data=sizes[0], fsdp=sizes[1], tensor=sizes[2]),
                         jax.devices()[:int(np.prod(sizes))])
        args.split = args.emit_breakdown = False
    if args.max_new is None:
        args.max_new = 32768 if args.phase == "profile" else 8192
    if args.contexts is None:
        args.contexts = (list(PROFILE_CONTEXTS) if args.phase in ("profile", "refill-model")
                         else [128, 2048, 4096, 6144, 8192])

    dev = jax.devices()[0]
    print(f"device {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}",
          flush=True)
    cfg = ModelConfig.preset(args.model)
    small = jax.default_backend() == "cpu"
    DTYPE[0] = jnp.dtype(args.dtype)
    BUCKET[0] = args.table_bucket or None
    STEPS[0] = args.steps
    SCORER[0] = args.scorer
    model = init_model(cfg, dtype=DTYPE[0], param_dtype=DTYPE[0])
    # Timed as a call in a chain, as the steps are (64 a timed call, so a program's own
    # once-a-run cost is ~5 us a step); one reduction timed alone reads 14-19% low.
    ceiling = read_ceiling(small=small, marginal=True)
    wbytes = weight_bytes(model)
    print(f"read ceiling {ceiling:.0f} GB/s; weights {wbytes / 1e9:.2f} GB", flush=True)
    out = dict(phase=args.phase, argv=sys.argv[1:], device=dev.device_kind,
               backend=jax.default_backend(), jax=jax.__version__,
               date=datetime.date.today().isoformat(), model=args.model,
               read_ceiling_gb_s=ceiling, weight_bytes=wbytes, prompt_len=args.prompt_len,
               steps=args.steps, repeats=args.repeats, mesh=args.mesh)
    t0 = time.perf_counter()
    try:
        phase = {"profile": phase_profile, "check": phase_check,
                 "refill": phase_refill, "refill-model": phase_refill_model}[args.phase]
        phase(args, model, cfg, ceiling, wbytes, out, mesh)
    finally:
        out["seconds"] = time.perf_counter() - t0
        out["compile_seconds"] = _compile_seconds[0]
        _save(args, out)
    report(out)


if __name__ == "__main__":
    main()
