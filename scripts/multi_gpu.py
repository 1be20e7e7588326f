"""Scale-out on one host with several GPUs (issue 21, first run on two): the mesh equality tests
on the real devices, rollout decode throughput with every GPU on ``data`` and every GPU on
``tensor`` against one GPU, a GRPO step of the Qwen3-1.7B shape with every GPU on ``fsdp``
against one GPU, one of the Qwen3-8B shape (float32 weights, gradients and AdamW state: ~128
GB, more than one H200 holds) likewise, and a few steps of a real ``sparrow train`` run of the
demo config on a mesh over all the GPUs. Meshes are ``d,f,t`` with -1 for "all the GPUs left"
(``--rollout-meshes one 2,1,1`` names a fixed one).

    bash scripts/multi_gpu.sh --commit <sha>   # a multi-GPU machine (.whl carried); JSON to $OUT
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        .venv/bin/python scripts/multi_gpu.py --tiny  # CPU dry run: every shape shrunk

The driver (this script without ``--item``) never imports JAX: each item runs in its own
subprocess (this script with ``--item NAME``, or pytest, or the ``sparrow`` CLI), so one failure,
hang or out-of-memory is recorded and the rest still run, every item's peak memory is its own,
and a budget can be enforced by killing the item. Stages run one after the other; the items of a
stage together (the tests and the demo run, which time nothing that matters and share the GPUs
with memory allocated on demand). Stage i must end by ``start + budget * (weights of stages
0..i) / (all weights)``: time an early stage leaves unused goes to the later ones. An item
writes its figures as it goes, so a killed item keeps what it measured.

NVLink multicast must stay off on the GPU machine: ``NCCL_NVLS_ENABLE=0`` is set when absent
(before any JAX import, here and in every item) and any other value is refused.

Every figure printed also goes into the JSON report, ``$OUT`` (else ``notes/bench_runs/``)
``/<date>_multi_gpu[_tiny].json``; each item's full output goes to ``multi_gpu_logs/`` beside it.

Rollout throughput (item ``rollout``): the engine's fixed-context profiling
(:mod:`sparrow_jax.rollout.profile`, as ``scripts/bench_rollout.py --mesh``): ``generate``'s
own layout, pool and loop state for the mesh (short prompts, every row's pages for the longest
context allocated up front), the pool filled with random values, then chunks of the engine's
decode loop (``steps_per_call`` chained steps) timed with every row at each context, after an
untimed chunk that compiles the context's page-table width. Decode tokens/s = rows / median
seconds a step. Not the difference of two ``generate`` calls on prompts of 8-32K tokens: their
prefill (an unrolled forward per prefill chunk, compiled per prompt length and mesh) would cost
more compilation than the 9 minutes allow.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
T0 = float(os.environ.get("MULTI_GPU_T0", time.time()))   # the driver's start, for progress lines

# The tests of issue 21 (the mesh equality tests, each comparing meshes with one device; the
# trainer's and DistillSparse's include tensor = 2), and the rollout's per-call set-up on a mesh.
TEST_FILES = ("tests/test_sharding.py", "tests/test_trainer_mesh.py", "tests/test_engine_mesh.py",
              "tests/test_rollout_weights_mesh.py", "tests/test_distill_mesh.py")
# Environment variables worth recording: NCCL's and XLA's settings, the device selection.
ENV_PREFIXES = ("NCCL_", "XLA_", "JAX_", "CUDA_", "TF_CPP_", "NVIDIA_", "SPARROW_")


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f} s] {msg}", flush=True)


def nvls_off() -> str:
    """NCCL_NVLS_ENABLE=0 (NVLink multicast off; the GPU machine requires it): set when absent,
    refused when set otherwise."""
    value = os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if value != "0":
        raise SystemExit(f"NCCL_NVLS_ENABLE={value!r}: this machine needs NVLink multicast off "
                         f"(NCCL_NVLS_ENABLE=0)")
    return value


class Part:
    """An item's figures, rewritten to its JSON file at every update (a killed item keeps what
    it wrote)."""

    def __init__(self, path: str | None):
        self.path = path
        self.data: dict = {}

    def update(self, **kw) -> None:
        self.data.update(kw)
        if self.path:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1, default=str)
            os.replace(tmp, self.path)


# ============================================================================== shapes
@dataclasses.dataclass
class Shapes:
    """Every item's shapes; ``--tiny`` shrinks them for a CPU dry run. Each is a flag."""

    rollout_model: str = "qwen3-1.7b"
    rollout_dtype: str = "bfloat16"
    rollout_schedule: str = "qwen3-1.7b"          # BudgetSchedule.from_spec: paper name, pages
    rollout_contexts: tuple[int, ...] = (8192, 16384, 32768)
    rollout_rows_per_gpu: int = 24                # 24 rows at 32K: 94 GB of pages a GPU
    #                                             16 on GPUs under 120 GiB unless given
    rollout_steps: int = 64                       # decode steps per chunk (the engine's default)
    rollout_repeats: int = 3                      # timed chunks per context (median)
    rollout_meshes: tuple[str, ...] = ("one", "-1,1,1", "1,1,-1")
    grpo_model: str = "qwen3-1.7b"
    grpo_dtype: str = "bfloat16"                  # compute dtype; weights and AdamW float32
    grpo_prompts: int = 2
    grpo_prompt_len: int = 256                    # needle prompts of one length: one compile
    grpo_samples: int = 8
    grpo_max_new: int = 2048
    grpo_micro_batch: int = 8
    grpo_steps: int = 2                           # step 0 compiles; step 1 is the timed one
    grpo_schedule: str = "paper:qwen3-1.7b"
    grpo_meshes: tuple[str, ...] = ("one", "1,-1,1")
    big_model: str = "qwen3-8b"
    big_dtype: str = "bfloat16"
    big_prompts: int = 2
    big_prompt_len: int = 256
    big_samples: int = 4
    big_max_new: int = 256
    big_micro_batch: int = 8
    big_steps: int = 2
    big_schedule: str = "paper:qwen3-8b"
    big_mesh: str = "1,-1,1"
    train_config: str = "configs/demo.yaml"
    train_steps: int = 5
    train_mesh: str = "1,-1,1"
    allreduce_mib: int = 256


TINY = dict(
    rollout_model="tiny", rollout_dtype="float32", rollout_schedule="4",
    rollout_contexts=(96, 160), rollout_rows_per_gpu=4, rollout_steps=8, rollout_repeats=2,
    grpo_model="tiny", grpo_dtype="float32", grpo_prompts=2, grpo_samples=4, grpo_max_new=32,
    grpo_micro_batch=8, grpo_schedule="fixed:4",
    big_model="tiny", big_dtype="float32", big_max_new=16, big_schedule="fixed:4",
    train_steps=3, allreduce_mib=1)


def add_shape_flags(ap: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(Shapes):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, tuple):
            kind = int if f.default and isinstance(f.default[0], int) else str
            ap.add_argument(flag, nargs="+", type=kind, default=None)
        else:
            ap.add_argument(flag, type=type(f.default), default=None)


# 24 rows a GPU at 32K ran out of memory on 80 GB H100s, on one GPU too (2026-11-27, run 7);
# 16 rows held 61 GiB of the one GPU there.
ROLLOUT_ROWS_SMALL_GIB, SMALL_ROWS = 120, 16


def shapes_of(args) -> Shapes:
    s = Shapes(**(TINY if args.tiny else {}))
    for f in dataclasses.fields(Shapes):
        value = getattr(args, f.name)
        if value is not None:
            setattr(s, f.name, tuple(value) if isinstance(f.default, tuple) else value)
    if not args.tiny and args.rollout_rows_per_gpu is None:
        memory = gpu_memory_gib()
        if memory is not None and memory < ROLLOUT_ROWS_SMALL_GIB:
            s.rollout_rows_per_gpu = SMALL_ROWS
    return s


def parse_mesh(text: str):
    """``one`` -> None (one device, no mesh); ``d,f,t`` -> MeshConfig(d, f, t)."""
    if text == "one":
        return None
    from sparrow_jax.sharding import MeshConfig

    return MeshConfig(*(int(x) for x in text.split(",")))


def mesh_name(text: str, devices: int | None = None) -> str:
    """``one GPU``, or the mesh's axes above 1 (-1 resolved on ``devices``, else "all")."""
    if text == "one":
        return "one GPU"
    d, f, t = (int(x) for x in text.split(","))
    if devices is not None:
        d, f, t = parse_mesh(text).axis_sizes(devices)
    parts = [f"{n}={'all' if v == -1 else v}" for n, v in (("data", d), ("fsdp", f),
                                                           ("tensor", t)) if v != 1]
    return " ".join(parts) or "mesh 1,1,1"


# ============================================================================== worker items
def device_info() -> dict:
    import jax

    out = dict(backend=jax.default_backend(), jax=jax.__version__,
               device_count=jax.device_count(), devices=[])
    for d in jax.devices():
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        out["devices"].append(dict(id=d.id, kind=d.device_kind, platform=d.platform,
                                   bytes_limit=(stats or {}).get("bytes_limit")))
    return out


def device_memory() -> list[dict]:
    """Every local device's peak and current bytes in use (None where not reported)."""
    import jax

    out = []
    for d in jax.local_devices():
        stats = (d.memory_stats() if hasattr(d, "memory_stats") else None) or {}
        out.append(dict(id=d.id, peak_bytes=stats.get("peak_bytes_in_use"),
                        bytes_in_use=stats.get("bytes_in_use"),
                        bytes_limit=stats.get("bytes_limit")))
    return out


def gib(x) -> str:
    return "n/a" if x is None else f"{x / 2 ** 30:.1f} GiB"


_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_seconds = [0.0]


def count_compile_time() -> None:
    import jax

    def on_event(event, duration, **_):
        if event in _COMPILE_EVENTS:
            _compile_seconds[0] += duration

    jax.monitoring.register_event_duration_secs_listener(on_event)


def item_devices(s: Shapes, part: Part) -> None:
    """The devices, and one NCCL all-reduce over all of them (NVLink multicast off): the
    collectives work, and their bandwidth."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    info = device_info()
    part.update(**info)
    log(f"devices: {info['device_count']} x {info['devices'][0]['kind']} "
        f"({info['backend']}, jax {info['jax']})")
    n = jax.device_count()
    if n < 2:
        part.update(allreduce=None)
        return
    mesh = jax.make_mesh((n,), ("x",))
    per_device = s.allreduce_mib * 2 ** 20 // 2          # bfloat16 elements a device
    x = jax.device_put(jnp.ones((n * per_device,), jnp.bfloat16),
                       NamedSharding(mesh, PartitionSpec("x")))
    f = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh,
                              in_specs=PartitionSpec("x"), out_specs=PartitionSpec("x")))
    y = jax.block_until_ready(f(x))
    ok = all(bool(np.all(np.asarray(shard.data[:8]) == n)) for shard in y.addressable_shards)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    nbytes = per_device * 2
    # NCCL's convention: algorithm bandwidth = bytes / time; bus bandwidth = that * 2(n-1)/n.
    result = dict(bytes_per_device=nbytes, seconds=t, seconds_all=times, correct=ok,
                  algbw_gb_s=nbytes / t / 1e9, busbw_gb_s=nbytes / t / 1e9 * 2 * (n - 1) / n)
    part.update(allreduce=result)
    log(f"all-reduce of {nbytes / 2 ** 20:.0f} MiB a device over {n} devices: {1e3 * t:.2f} ms, "
        f"bus bandwidth {result['busbw_gb_s']:.1f} GB/s, correct {ok}")


def item_rollout(s: Shapes, part: Part) -> None:
    """Decode tokens/s of the engine at fixed contexts (:mod:`sparrow_jax.rollout.profile`:
    ``generate``'s own layout, pool and loop state, on the mesh too, the pool filled with random
    values; chunks of the engine's decode loop timed at each context) on one GPU and on each
    mesh of ``rollout_meshes``; the paper's schedule, random weights, no EOS."""
    import gc

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparrow_jax import sharding
    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.qwen3 import init_model
    from sparrow_jax.rollout.engine import RolloutConfig
    from sparrow_jax.rollout.profile import fixed_context_batch, time_context
    from sparrow_jax.schedule import BudgetSchedule

    count_compile_time()
    cfg = ModelConfig.preset(s.rollout_model)
    schedule = BudgetSchedule.from_spec(s.rollout_schedule)
    model = init_model(cfg, seed=0, dtype=jnp.dtype(s.rollout_dtype),
                       param_dtype=jnp.dtype(s.rollout_dtype))
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    steps, repeats, prompt_len = s.rollout_steps, s.rollout_repeats, 32
    contexts = sorted(s.rollout_contexts)
    # One batch a mesh serves every context: rows as long as the longest (every page allocated
    # up front, as generate does), short prompts (the prefill is not what is timed).
    rc = RolloutConfig(n=1, max_new_tokens=contexts[-1], temperature=1.0, eos_ids=(),
                       steps_per_call=steps,
                       dense_layers=(0, 1) if cfg.num_hidden_layers > 2 else (0,))
    part.update(model=s.rollout_model, dtype=s.rollout_dtype, schedule=s.rollout_schedule,
                weight_bytes=weights, steps_per_chunk=steps, repeats=repeats,
                prompt_len=prompt_len, max_new_tokens=rc.max_new_tokens,
                rows_per_gpu=s.rollout_rows_per_gpu, runs={}, **device_info())
    log(f"rollout: {s.rollout_model} ({weights / 2 ** 30:.2f} GiB), schedule "
        f"{s.rollout_schedule}, contexts {contexts}, {s.rollout_rows_per_gpu} rows a GPU, "
        f"{repeats} chunks of {steps} steps a context")
    runs = {}
    for spec in s.rollout_meshes:
        mesh_cfg = parse_mesh(spec)
        mesh = None if mesh_cfg is None else sharding.make_mesh(mesh_cfg)
        groups = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
        gpus = 1 if mesh is None else mesh.size
        rows = s.rollout_rows_per_gpu * groups
        name = mesh_name(spec, jax.device_count())
        entry = dict(mesh=spec, name=name, gpus=gpus, rows=rows, rows_per_gpu=rows // groups,
                     contexts=[])
        runs[spec] = entry
        t0 = time.perf_counter()
        c0 = _compile_seconds[0]
        try:
            batch, graphdef, params, state = fixed_context_batch(
                model, rc, rows=rows, prompt_len=prompt_len, key=jax.random.key(1),
                schedule=schedule, mesh=mesh)
            entry.update(setup_s=time.perf_counter() - t0,
                         setup_compile_s=_compile_seconds[0] - c0,
                         memory_after_setup=device_memory())
            log(f"rollout {name}: {rows} rows set up in {entry['setup_s']:.1f} s; memory "
                + ", ".join(f"GPU{m['id']} {gib(m['bytes_in_use'])}"
                            for m in entry["memory_after_setup"]))
            for ctx in contexts:
                c1 = _compile_seconds[0]
                state, timing = time_context(batch, graphdef, params, state, ctx,
                                             repeats=repeats)
                t = statistics.median(timing.step_seconds)
                total = rows / t
                entry["contexts"].append(dict(
                    context=ctx, mean_context=timing.mean_context,
                    table_width=timing.table_width, gather_width=timing.gather_width,
                    budget_pages=int(schedule.budget_pages(int(timing.mean_context))),
                    step_ms=1e3 * t, step_ms_all=[1e3 * x for x in timing.step_seconds],
                    first_chunk_s=timing.first_chunk_seconds,
                    compile_s=_compile_seconds[0] - c1,
                    tokens_per_s=total, tokens_per_s_per_gpu=total / gpus))
                part.update(runs=runs)
                log(f"rollout {name} ctx {ctx}: {1e3 * t:.2f} ms/step at {rows} rows, "
                    f"{total:.0f} tokens/s ({total / gpus:.0f} a GPU); table width "
                    f"{timing.table_width}, first chunk {timing.first_chunk_seconds:.1f} s")
        except Exception as e:   # record, go on with the next mesh
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            log(f"rollout {name}: FAILED {entry['error'][:300]}")
        entry.update(wall_s=time.perf_counter() - t0, compile_s=_compile_seconds[0] - c0,
                     memory=device_memory())
        part.update(runs=runs)
        batch = graphdef = params = state = None   # free this mesh's pool first
        gc.collect()
    part.update(speedups=rollout_speedups(runs))


def rollout_speedups(runs: dict) -> list[dict]:
    """Per context: each mesh's total decode tokens/s over one GPU's."""
    one = {c["context"]: c for c in runs.get("one", {}).get("contexts", [])}
    out = []
    for spec, entry in runs.items():
        if spec == "one":
            continue
        for c in entry.get("contexts", []):
            if c["context"] in one:
                out.append(dict(mesh=spec, name=entry["name"], context=c["context"],
                                speedup=c["tokens_per_s"] / one[c["context"]]["tokens_per_s"]))
    return out


def item_grpo(s: Shapes, part: Part, *, big: bool, mesh_spec: str, key: str) -> None:
    """GRPO steps through ``Trainer.train_step`` (as scripts/bench_grpo.py) on one GPU or a
    mesh: step time, its split, and every GPU's peak memory."""
    import jax

    from sparrow_jax.data import DataConfig, NeedleConfig
    from sparrow_jax.rl.config import ModelSpec, RolloutSettings, TrainConfig, UpdateConfig
    from sparrow_jax.rl.trainer import Trainer

    count_compile_time()
    p = "big_" if big else "grpo_"
    get = lambda name: getattr(s, p + name)   # noqa: E731
    sched = get("schedule")
    kind, _, value = sched.partition(":")
    schedule = (None if sched == "dense" else {"paper": value} if kind == "paper"
                else {"kind": "fixed", "pages": int(value)})
    mesh = parse_mesh(mesh_spec)
    run_dir = tempfile.mkdtemp(prefix="multi_gpu_grpo_")
    config = TrainConfig(
        run_dir=run_dir, steps=get("steps"), mesh=mesh,
        model=ModelSpec(preset=get("model"), dtype=get("dtype")),
        # Prompts of one length (the needle task draws 192-256 tokens by default): step 1 then
        # has step 0's shapes (the rollout's padded prompt, the update's length buckets) and
        # compiles nothing, so it is the step's own time.
        data=DataConfig(task="needle", prompts_per_step=get("prompts"), needle=NeedleConfig(
            min_prompt_len=get("prompt_len"), max_prompt_len=get("prompt_len"))),
        rollout=RolloutSettings(samples_per_prompt=get("samples"),
                                max_new_tokens=get("max_new"), temperature=1.0, eos_ids=()),
        schedule=schedule, update=UpdateConfig(micro_batch_size=get("micro_batch")),
        checkpoint_every=10 ** 6, tensorboard=False, progress=False)
    name = f"{get('model')} {mesh_name(mesh_spec, jax.device_count())}"
    rows = get("prompts") * get("samples")
    part.update(model=get("model"), dtype=get("dtype"), mesh=mesh_spec, name=name,
                prompts=get("prompts"), prompt_len=get("prompt_len"), samples=get("samples"),
                rows=rows, max_new=get("max_new"), micro_batch=get("micro_batch"),
                schedule=sched, steps=[], **device_info())
    log(f"grpo {name}: {get('prompts')} x {get('samples')} rows, {get('max_new')} new tokens, "
        f"schedule {sched}: building the trainer")
    t0 = time.perf_counter()
    c0 = _compile_seconds[0]
    trainer = Trainer(config)
    state_bytes = [sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
                   for tree in (trainer.opt_state,)]
    part.update(setup_s=time.perf_counter() - t0, setup_compile_s=_compile_seconds[0] - c0,
                opt_state_bytes_device0=state_bytes[0], memory_after_setup=device_memory())
    log(f"grpo {name}: set up in {time.perf_counter() - t0:.1f} s; memory "
        + ", ".join(f"GPU{m['id']} {gib(m['bytes_in_use'])}" for m in device_memory()))
    steps = []
    barrier = Barrier.from_env()
    with contextlib.ExitStack() as stack:
        for step in range(get("steps")):
            if step == 1:
                # Step 0 (compilation) may overlap the stage's other items; the timed steps
                # run once they are done, one timed item at a time.
                barrier.ready(key)
                if barrier.folder:
                    waited = barrier.wait()
                    part.update(waited_s=waited)
                    log(f"grpo {name}: waited {waited:.1f} s for the stage's other items")
                stack.enter_context(barrier.lock())
            c0 = _compile_seconds[0]
            t0 = time.perf_counter()
            metrics = trainer.train_step()
            wall = time.perf_counter() - t0
            row = {k: metrics.get(k) for k in ("time_rollout", "time_recompute", "time_update",
                                               "tokens_per_s", "response_length_mean",
                                               "sparse_step_fraction", "loss")}
            row.update(step=step, wall_s=wall, compile_s=_compile_seconds[0] - c0,
                       response_tokens=metrics["response_length_mean"] * rows,
                       memory=device_memory())
            steps.append(row)
            part.update(steps=steps)
            if step == 0:   # kept should a later step not finish: step 0 less its compilation
                part.update(step0_less_compile_s=wall - row["compile_s"],
                            peak_bytes=[m["peak_bytes"] for m in row["memory"]])
            peaks = ", ".join(f"GPU{m['id']} {gib(m['peak_bytes'])}" for m in row["memory"])
            log(f"grpo {name} step {step}: {wall:.2f} s (compile {row['compile_s']:.1f} s; "
                f"rollout {row['time_rollout']:.2f}, recompute {row['time_recompute']:.2f}, "
                f"update {row['time_update']:.2f}); peak {peaks}")
    timed = [r for r in steps if r["step"] > 0]
    if timed:
        last = timed[-1]
        part.update(step_s=last["wall_s"], step_tokens_per_s=last["response_tokens"]
                    / last["wall_s"], peak_bytes=[m["peak_bytes"] for m in last["memory"]])


def run_item(args) -> None:
    s = shapes_of(args)
    part = Part(args.part)
    part.update(item=args.item, started=time.time() - T0)
    name = args.item
    if name == "devices":
        item_devices(s, part)
    elif name == "rollout":
        item_rollout(s, part)
    elif name.startswith(("grpo:", "big:")):
        try:
            item_grpo(s, part, big=name.startswith("big:"), mesh_spec=name.split(":", 1)[1],
                      key=name)
        finally:
            Barrier.from_env().ready(name)   # a failed item keeps no one waiting
    else:
        raise SystemExit(f"unknown item {name!r}")
    part.update(finished=time.time() - T0)


# ============================================================================== the driver
@dataclasses.dataclass
class Item:
    key: str                  # the report's key
    cmd: list[str]
    env: dict
    echo: bool = True         # print the item's lines (pytest and the CLI: a summary line only)
    kind: str = "worker"      # worker | pytest | train
    timed: bool = False       # times its steps alone once the stage's others are done (Barrier)


def host_info() -> dict:
    """nvidia-smi's view of the GPUs and their links (absent on the CPU machine)."""
    out = {"cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    if shutil.which("nvidia-smi"):
        for key, cmd in (("gpus", ["nvidia-smi", "--query-gpu=index,name,memory.total,"
                                   "driver_version,pcie.link.gen.current", "--format=csv"]),
                         ("topology", ["nvidia-smi", "topo", "-m"]),
                         ("nvlink", ["nvidia-smi", "nvlink", "--status"])):
            try:
                out[key] = subprocess.run(cmd, capture_output=True, text=True,
                                          timeout=20).stdout[-4000:]
            except (OSError, subprocess.SubprocessError) as e:
                out[key] = f"failed: {e}"
    return out


def commit_of(args) -> str:
    if args.commit:
        return args.commit
    if os.environ.get("SPARROW_COMMIT"):
        return os.environ["SPARROW_COMMIT"]
    if (REPO / "COMMIT").is_file():
        return (REPO / "COMMIT").read_text().strip()
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, timeout=10).stdout
        return sha + ("+dirty" if dirty.strip() else "") if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def train_yaml(s: Shapes, path: Path, run_dir: Path) -> dict:
    """The demo config with a mesh over the GPUs and a fresh run folder."""
    import yaml

    config = yaml.safe_load((REPO / s.train_config).read_text())
    config["mesh"] = dict(zip(("data", "fsdp", "tensor"),
                              (int(x) for x in s.train_mesh.split(","))))
    config["run_dir"] = str(run_dir)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return config


# GPU memory (GiB, the smallest GPU's) from which the two 1.7B GRPO runs fit side by side: the
# one-GPU run peaks at 45 GiB on GPU 0 and the fsdp=2 run at ~23 GiB a GPU plus what its first
# step's compilation and autotuning take; on two 80 GB H100s the fsdp=2 run ran out of memory
# on GPU 0 beside the other (2026-11-27), on 143 GB H200s they fit.
GRPO_SIDE_BY_SIDE_GIB = 120


def gpu_memory_gib() -> float | None:
    """The smallest visible GPU's memory in GiB by nvidia-smi (None without it: the CPU run)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout.split()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        mib = [float(x) for x in out]
        if visible:
            mib = [mib[int(i)] for i in visible.split(",") if i.strip().isdigit()
                   and int(i) < len(mib)] or mib
        return min(mib) / 1024 if mib else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def build_stages(args, s: Shapes, out_dir: Path, work: Path) -> list[tuple[float, list[Item]]]:
    """(weight, items) per stage; a weight is the stage's share of the budget (GPU seconds
    estimated: compilation dominates). The tests, the demo run and both 1.7B GRPO runs share
    stage 1: the GRPO runs compile and run their first step beside the tests, then time their
    second step alone (:class:`Barrier`). On GPUs of less than
    :data:`GRPO_SIDE_BY_SIDE_GIB` each GRPO run has a stage of its own after the tests."""
    me = [sys.executable, str(Path(__file__).resolve())]
    passed = [a for a in sys.argv[1:] if a != "--item"]
    bench = {"XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get(
        "XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")}
    shared = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}   # several processes on the GPUs
    first_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]

    def worker(item, env, timed=False):
        part = work / f"{item.replace(':', '_').replace(',', '')}.json"
        return Item(item, me + passed + ["--item", item, "--part", str(part)], env,
                    timed=timed)

    def pytest(path):
        key = "test:" + Path(path).stem
        xml = work / f"{Path(path).stem}.xml"
        return Item(key, [sys.executable, "-m", "pytest", "-q", "-m", "slow or not slow",
                          "-p", "no:cacheprovider", f"--junitxml={xml}", path],
                    dict(shared), echo=False, kind="pytest")

    yaml_path = out_dir / "multi_gpu_train.yaml"
    train = Item("train", [sys.executable, "-m", "sparrow_jax.cli", "train", "--config",
                           str(yaml_path), "--steps", str(s.train_steps), "--no-progress"],
                 dict(shared), echo=False, kind="train")
    grpo = [worker(f"grpo:{spec}", dict(shared, **({"CUDA_VISIBLE_DEVICES": first_gpu}
                                                   if spec == "one" else {})), timed=True)
            for spec in s.grpo_meshes]
    memory = gpu_memory_gib()
    if memory is None or memory >= GRPO_SIDE_BY_SIDE_GIB:
        shared_stages = [(190, [pytest(f) for f in TEST_FILES] + [train] + grpo)]
    else:
        log(f"GPUs of {memory:.0f} GiB: each GRPO run in a stage of its own")
        shared_stages = ([(100, [pytest(f) for f in TEST_FILES] + [train])]
                         + [(60, [item]) for item in grpo])
    stages = [
        (10, [worker("devices", bench)]),
        *shared_stages,
        (160, [worker("rollout", bench)]),
        (140, [worker(f"big:{s.big_mesh}", bench)]),
    ]
    only = set(args.only or [])
    if only:
        stages = [(w, [i for i in items if i.key.split(":")[0] in only or i.key in only])
                  for w, items in stages]
        stages = [(w, items) for w, items in stages if items]
    return stages


class Barrier:
    """Files in a stage's folder that let its timed items (``Item.timed``) time alone: each
    writes ``ready_<key>`` once its untimed part is done, then waits until every timed item is
    ready and ``background_done`` exists (the driver writes it when the stage's other items
    have ended), then times under an exclusive lock (one timed item at a time). The driver marks
    an item that ended as ready; waiting gives up after ``max_wait`` seconds (then recorded)."""

    def __init__(self, folder: str | None, count: int = 0, max_wait: float = 300.0):
        self.folder = Path(folder) if folder else None
        self.count, self.max_wait = count, max_wait

    @classmethod
    def from_env(cls) -> "Barrier":
        return cls(os.environ.get("MULTI_GPU_SYNC"), int(os.environ.get("MULTI_GPU_SYNC_N", 0)))

    def ready(self, key: str) -> None:
        if self.folder:
            (self.folder / f"ready_{key.replace(':', '_').replace(',', '')}").touch()

    def wait(self) -> float:
        """Seconds waited for the others (0 without a barrier)."""
        if not self.folder:
            return 0.0
        t0 = time.time()
        while time.time() - t0 < self.max_wait:
            if (len(list(self.folder.glob("ready_*"))) >= self.count
                    and (self.folder / "background_done").exists()):
                break
            time.sleep(0.5)
        return time.time() - t0

    def lock(self):
        import fcntl

        if not self.folder:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def held():
            with open(self.folder / "lock", "w") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)

        return held()


def run_stage(items: list[Item], deadline: float, logs: Path, folder: Path) -> dict:
    """Runs ``items`` together, each killed (its process group) at ``deadline``; the timed ones
    synchronised through a :class:`Barrier` in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    timed = [i for i in items if i.timed]
    barrier = Barrier(str(folder), len(timed))
    procs = {}
    for item in items:
        env = dict(os.environ, **item.env, MULTI_GPU_T0=str(T0), PYTHONUNBUFFERED="1")
        if item.timed:   # the others never wait
            env.update(MULTI_GPU_SYNC=str(folder), MULTI_GPU_SYNC_N=str(len(timed)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                          os.environ.get("PYTHONPATH")]))
        logfile = open(logs / f"{item.key.replace(':', '_').replace(',', '')}.log", "w")
        proc = subprocess.Popen(item.cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        tail: list[str] = []

        def pump(proc=proc, logfile=logfile, tail=tail, item=item):
            for line in proc.stdout:
                logfile.write(line)
                tail.append(line)
                del tail[:-60]
                if item.echo:
                    print(line, end="", flush=True)
            logfile.close()

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        procs[item.key] = (item, proc, thread, tail, time.time())
        log(f"started {item.key} (until {deadline - T0:.0f} s)")
    results = {}
    background = {i.key for i in items if not i.timed}
    if not background:
        (folder / "background_done").touch()
    while len(results) < len(procs):
        for key, (item, proc, thread, tail, started) in procs.items():
            if key in results:
                continue
            status = None
            if proc.poll() is not None:
                status = "ok" if proc.returncode == 0 else "failed"
            elif time.time() > deadline:
                status = "timeout"
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(timeout=15)
                        break
                    except subprocess.TimeoutExpired:
                        continue
            if status is None:
                continue
            thread.join(timeout=10)
            results[key] = dict(status=status, rc=proc.returncode, wall_s=time.time() - started,
                                output_tail="".join(tail)[-3000:])
            log(f"{key}: {status} (exit {proc.returncode}) after {time.time() - started:.1f} s")
            if item.timed:
                barrier.ready(key)   # an item that ended keeps no one waiting
            elif background <= set(results) and timed:
                (folder / "background_done").touch()
                log("the stage's other items are done: the timed items may time now")
        time.sleep(0.5)
    return results


def parse_junit(path: Path) -> dict:
    if not path.is_file():
        return {"junit": "missing"}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["time_s"] = sum(float(s.get("time", 0)) for s in suites)
    counts["failed_tests"] = []
    for case in root.iter("testcase"):
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            counts["failed_tests"].append(dict(
                name=f"{case.get('classname')}::{case.get('name')}",
                message=(bad.get("message") or "")[:600]))
    return counts


def parse_train(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {"metrics": "missing"}
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    keep = ("step", "reward_mean", "loss", "time_rollout", "time_recompute", "time_update",
            "sparse_step_fraction")
    return {"steps_written": len(lines),
            "metrics": [{k: r.get(k) for k in keep if k in r} for r in lines],
            "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").glob("*"))
            if (run_dir / "checkpoints").is_dir() else []}


def summary_lines(report: dict) -> list[str]:
    """The report's figures as table rows (also in the JSON)."""
    items = report["items"]
    out = []
    dev = items.get("devices", {})
    if dev.get("allreduce"):
        a = dev["allreduce"]
        out.append(f"all-reduce {a['bytes_per_device'] / 2 ** 20:.0f} MiB/device: "
                   f"{1e3 * a['seconds']:.2f} ms, busbw {a['busbw_gb_s']:.1f} GB/s")
    for key, r in items.items():
        if key.startswith("test:"):
            out.append(f"{key}: {r.get('passed')} passed, {r.get('failures')} failed, "
                       f"{r.get('errors')} errors, {r.get('skipped')} skipped ({r['status']}, "
                       f"{r['wall_s']:.0f} s)")
    ro = items.get("rollout", {})
    one = {c["context"]: c for c in ro.get("runs", {}).get("one", {}).get("contexts", [])}
    for spec, entry in ro.get("runs", {}).items():
        for c in entry.get("contexts", []):
            base = one.get(c["context"])
            x = "" if base is None or spec == "one" else \
                f", {c['tokens_per_s'] / base['tokens_per_s']:.2f}x one GPU"
            out.append(f"rollout {entry['name']} ctx {c['context']}: {entry['rows']} rows, "
                       f"{c['step_ms']:.2f} ms/step, {c['tokens_per_s']:.0f} tokens/s "
                       f"({c['tokens_per_s_per_gpu']:.0f} a GPU){x}")
    for key, r in items.items():
        if key.startswith(("grpo:", "big:")):
            peaks = ", ".join(gib(p) for p in r.get("peak_bytes") or [])
            t = r.get("step_s")
            t = f"{t:.2f} s" if t is not None else (
                f"~{r['step0_less_compile_s']:.2f} s (step 0 less compile)"
                if r.get("step0_less_compile_s") is not None else "n/a")
            out.append(f"{key} ({r.get('name')}): step {t}, peak per GPU [{peaks}] "
                       f"({r['status']})")
    if "train" in items:
        r = items["train"]
        out.append(f"train: exit {r['rc']}, {r['wall_s']:.0f} s, "
                   f"{r.get('steps_written')} steps written ({r['status']})")
    return out


def drive(args) -> int:
    nvls = nvls_off()
    s = shapes_of(args)
    out_dir = Path(args.out or os.environ.get("OUT") or REPO / "notes" / "bench_runs")
    out_dir.mkdir(parents=True, exist_ok=True)
    logs = out_dir / "multi_gpu_logs"
    logs.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="multi_gpu_"))
    date = datetime.date.today().isoformat()
    path = out_dir / f"{date}_multi_gpu{'_tiny' if args.tiny else ''}.json"
    budget = args.budget or (1800.0 if args.tiny else 480.0)
    report = dict(date=date, started=datetime.datetime.now().isoformat(timespec="seconds"),
                  commit=commit_of(args), argv=sys.argv[1:], tiny=args.tiny, budget_s=budget,
                  nccl_nvls_enable=nvls, shapes=dataclasses.asdict(s),
                  env={k: v for k, v in sorted(os.environ.items())
                       if k.startswith(ENV_PREFIXES)},
                  host=host_info(), items={})

    def save():
        report["elapsed_s"] = time.time() - T0
        report["summary"] = summary_lines(report)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str))
        os.replace(tmp, path)

    try:
        report["train_config"] = train_yaml(s, out_dir / "multi_gpu_train.yaml",
                                            work / "train_run")
    except Exception as e:   # the train item then fails on its own
        report["train_config"] = f"failed: {e}"
    stages = build_stages(args, s, out_dir, work)
    total = sum(w for w, _ in stages)
    log(f"multi_gpu: {len(stages)} stages, budget {budget:.0f} s, commit {report['commit']}, "
        f"NCCL_NVLS_ENABLE={nvls}; report {path}")
    save()
    done_weight = 0.0
    for index, (weight, items) in enumerate(stages):
        done_weight += weight
        deadline = T0 + budget * done_weight / total
        if deadline - time.time() < 5:
            for item in items:
                report["items"][item.key] = dict(status="skipped: no time left")
            log("skipped (no time left): " + ", ".join(i.key for i in items))
            continue
        results = run_stage(items, deadline, logs, work / f"stage{index}")
        for item in items:
            r = results[item.key]
            if item.kind == "worker":
                part = Path(item.cmd[item.cmd.index("--part") + 1])
                if part.is_file():
                    r.update(json.loads(part.read_text()))
            elif item.kind == "pytest":
                r.update(parse_junit(work / f"{item.key.split(':', 1)[1]}.xml"))
                log(f"{item.key}: {r.get('passed')} passed, {r.get('failures')} failed, "
                    f"{r.get('errors')} errors, {r.get('skipped')} skipped")
            elif item.kind == "train":
                r.update(parse_train(work / "train_run"))
                r["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
                log(f"train: exit {r['rc']}, {r['wall_s']:.1f} s, {r.get('steps_written')} "
                    f"steps written")
            report["items"][item.key] = r
        save()
    if "rollout" in report["items"]:
        report["items"]["rollout"]["speedups"] = rollout_speedups(
            report["items"]["rollout"].get("runs", {}))
    save()
    print("\nsummary:")
    for line in report["summary"]:
        print("  " + line)
    log(f"done; report {path}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="every shape shrunk (CPU dry run)")
    ap.add_argument("--commit", help="the code's commit (git may be absent on the GPU machine)")
    ap.add_argument("--out", help="output folder (default $OUT, else notes/bench_runs)")
    ap.add_argument("--budget", type=float,
                    help="seconds for all items (default 480: with the set-up, under 9 "
                         "minutes; tiny 1800)")
    ap.add_argument("--only", nargs="+", help="items: devices test train rollout grpo big "
                                              "(or a full key such as test:test_sharding)")
    ap.add_argument("--item", help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    add_shape_flags(ap)
    args = ap.parse_args(argv)
    nvls_off()   # before any JAX import, in the driver and in every item
    if args.item:
        run_item(args)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
