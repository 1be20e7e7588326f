"""``sparrow bench``: the two speed figures a user checks on a new machine, each against its
baseline measured in the same run.

- ``decode``: one layer's sparse decode step (``sparse_decode``, ``--impl``) against dense paged
  attention (the engine's dense decode), at ``--batches`` rows of ``--context`` tokens with a
  budget of ``--budget-tokens``: time per call, the ratio, the sparse output's error against
  the reference, and each one's share of the read ceiling measured first
  (:mod:`sparrow_jax.decode_bench`).
- ``rollout``: the rollout engine's decode loop, sparse (``--schedule``, default the paper's
  for the preset) against dense, at ``--contexts`` with ``--rows`` rows of a randomly
  initialised ``--preset`` (or the weights of ``--model``): tokens/s and the ratio
  (:func:`sparrow_jax.rollout.profile.sparse_vs_dense`). Its JSON is also a step-time file
  (:mod:`sparrow_jax.step_times`): ``sparrow calibrate``'s ``step_times`` takes it.

Every option is checked before anything is timed.

The developer benchmarks with every variant, breakdown and trace are ``scripts/bench_*.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sparrow_jax.commands import give_jax_the_device_memory

WHAT = ("decode", "rollout")
# The decode measure's peak memory over its largest case's K and V pages: on a CPU the XLA
# paths gather and convert the pages (24 GB resident for 4.3 GB of pages, batch 32 at 32K,
# killed by the OOM killer); an accelerator's kernels read them in place.
PEAK_OVER_PAGES_CPU, PEAK_OVER_PAGES_ACCELERATOR = 6.0, 2.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sparrow_jax.cli import positive_int

    p.add_argument("--what", nargs="+", choices=WHAT, default=list(WHAT),
                   help="which measures (default both)")
    p.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8, 32],
                   help="decode: rows per call")
    p.add_argument("--context", type=positive_int, default=32768,
                   help="decode: tokens in every row's cache (whole pages)")
    p.add_argument("--budget-tokens", type=positive_int, default=2048,
                   help="decode: the sparse step's budget, reserved pages included")
    p.add_argument("--q-heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="decode: the cache's dtype")
    p.add_argument("--impl", default="auto", choices=("auto", "pallas", "reference", "triton"),
                   help="decode: the sparse step's implementation")
    p.add_argument("--chain", type=positive_int, default=20,
                   help="decode: calls in the shorter of the two timed chains (the longer "
                        "has 4x), whose difference gives the time a call")
    p.add_argument("--repeats", type=positive_int, default=9,
                   help="timed runs (decode) or chunks (rollout), the median reported")
    p.add_argument("--preset", default="qwen3-1.7b",
                   help="rollout: randomly initialised model from configs/models")
    p.add_argument("--model", help="rollout: an HF model folder instead of --preset")
    p.add_argument("--schedule",
                   help="rollout: the sparse schedule: a page count, a paper schedule name or "
                        "a schedule YAML file (default: the paper's for --preset)")
    p.add_argument("--contexts", type=positive_int, nargs="+", default=[2048, 8192, 32768],
                   help="rollout: contexts timed")
    p.add_argument("--rows", type=positive_int, default=16, help="rollout: decode rows")
    p.add_argument("--steps-per-call", type=positive_int, default=16,
                   help="rollout: decode steps a timed chunk")
    p.add_argument("--mesh", metavar="DATA,FSDP,TENSOR",
                   help="rollout: decode on a mesh of every device, e.g. 1,1,2 (the weights and "
                        "KV heads split over tensor) or 2,1,1 (rows split); -1 once for the "
                        "rest; default one device")
    p.add_argument("--out", help="JSON file of every figure")


def _mesh(args, model_config):
    from sparrow_jax.rollout.engine import check_mesh
    from sparrow_jax.sharding import MeshConfig, make_mesh

    if args.mesh is None:
        return None
    try:
        sizes = [int(x) for x in args.mesh.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) != 3:
        raise ValueError(f"--mesh {args.mesh!r}: give three axis sizes DATA,FSDP,TENSOR")
    mesh = make_mesh(MeshConfig(*sizes))
    check_mesh(mesh, model_config, caller="--mesh")
    return mesh


def _model_config(args):
    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.hf_io import load_config

    if args.model is None:
        return ModelConfig.preset(args.preset)
    if not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model}: no such folder")
    return load_config(args.model)


def _schedule(args):
    from sparrow_jax.schedule import BudgetSchedule

    if args.schedule is None and args.model is not None:
        raise ValueError("--model needs --schedule (a page count, a paper schedule name or a "
                         "schedule YAML file)")
    return BudgetSchedule.from_spec(args.schedule or args.preset, page_size=args.page_size)


def _shape(args):
    from sparrow_jax.decode_bench import DecodeShape

    shape = DecodeShape(q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                        page_size=args.page_size, dtype=args.dtype)
    shape.check(args.context, args.budget_tokens)
    return shape


def _memory_limit() -> int | None:
    """Bytes free on the first device by its allocator, or where it does not say (CPU) the
    host's available memory (Linux); None where neither is known."""
    from sparrow_jax.benchmarking import free_bytes

    free = free_bytes()
    if free is not None:
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_memory(args, shape) -> None:
    import jax

    pages = shape.dense_bytes(max(args.batches), args.context)
    cpu = jax.default_backend() == "cpu"
    need = pages * (PEAK_OVER_PAGES_CPU if cpu else PEAK_OVER_PAGES_ACCELERATOR)
    limit = _memory_limit()
    if limit is not None and need > limit:
        raise ValueError(f"--batches {max(args.batches)} at --context {args.context}: "
                         f"{pages / 2 ** 30:.1f} GiB of K and V pages, about "
                         f"{need / 2 ** 30:.1f} GiB at peak on {jax.default_backend()}, more "
                         f"than the {limit / 2 ** 30:.1f} GiB this device has; give fewer "
                         "--batches or a shorter --context")


def _check_rollout_memory(args, model_config, mesh) -> None:
    """The first device's share of the rollout (each mode's pool in turn; the model, created
    there in the compute dtype; under a mesh also its share of the decode copy) against what
    that device has free."""
    import jax
    import numpy as np

    from sparrow_jax.memory import param_bytes_per_device
    from sparrow_jax.rollout.engine import page_bytes, pool_size
    from sparrow_jax.rollout.profile import PROMPT_LEN, sparse_vs_dense_config

    tensor = 1 if mesh is None else mesh.shape["tensor"]
    rows = -(-args.rows // (1 if mesh is None else mesh.size // tensor))
    config = sparse_vs_dense_config(args.contexts, steps_per_call=args.steps_per_call,
                                    repeats=args.repeats, page_size=args.page_size)
    itemsize = 4 if jax.default_backend() == "cpu" else 2
    pages = pool_size(config, model_config, np.full(rows, PROMPT_LEN), None)   # a group's pool
    weights = [param_bytes_per_device(model_config, dict(data=1, fsdp=1, tensor=t), itemsize)
               for t in (1, tensor)]
    need = (pages * page_bytes(model_config, args.page_size, f"float{8 * itemsize}",
                               kv_head_shards=tensor)
            + weights[0] + (0 if mesh is None else weights[1]))
    limit = _memory_limit()
    if limit is not None and need > limit:
        raise ValueError(f"--rows {args.rows} at --contexts up to {max(args.contexts)}: about "
                         f"{need / 2 ** 30:.1f} GiB a device (KV pages and weights) on "
                         f"{jax.default_backend()}, more than the {limit / 2 ** 30:.1f} GiB it "
                         f"has free; give fewer --rows, shorter --contexts or a --mesh")


def _decode(args, shape, ceiling: float) -> list[dict]:
    from sparrow_jax.decode_bench import measure

    rows = []
    print(f"decode: context {args.context}, budget {args.budget_tokens} tokens, GQA "
          f"{args.q_heads}/{args.kv_heads}, head_dim {args.head_dim}, page {args.page_size}, "
          f"{args.dtype}, impl {args.impl}")
    print(f"{'batch':>6} {'sparse ms':>10} {'dense ms':>9} {'x dense':>8} {'sparse %':>9} "
          f"{'dense %':>8} {'rel err':>8}")
    for b in args.batches:
        r = measure(shape, b, args.context, args.budget_tokens, impl=args.impl,
                    chain=args.chain, repeats=args.repeats, ceiling_gbs=ceiling)
        print(f"{b:>6} {r['sparse_s'] * 1e3:>10.4f} {r['dense_s'] * 1e3:>9.4f} "
              f"{r['x_dense']:>7.2f}x {r['sparse_of_ceiling']:>8.0%} "
              f"{r['dense_of_ceiling']:>7.0%} {r['rel_err']:>8.1e}", flush=True)
        rows.append(r)
    return rows


def _rollout(args, schedule, mesh) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.hf_io import load_qwen3
    from sparrow_jax.models.qwen3 import init_model
    from sparrow_jax.rollout.profile import sparse_vs_dense

    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    # Parameters in the compute dtype (no float32 masters: nothing here trains), so that on one
    # device the decode copy is the model's own arrays.
    if args.model is not None:
        model, _ = load_qwen3(args.model, dtype=dtype, param_dtype=dtype)
    else:
        model = init_model(ModelConfig.preset(args.preset), dtype=dtype, param_dtype=dtype)
    print(f"rollout: {args.model or args.preset}, {args.rows} rows, schedule "
          f"{args.schedule or args.preset}, contexts {args.contexts}, "
          f"{'one device' if mesh is None else dict(mesh.shape)}")
    print(f"{'context':>8} {'sparse tok/s':>13} {'dense tok/s':>12} {'x dense':>8}")
    rows = sparse_vs_dense(model, schedule, args.contexts, rows=args.rows,
                           repeats=args.repeats, steps_per_call=args.steps_per_call, mesh=mesh)
    for r in rows:
        print(f"{r['context']:>8} {r['sparse_tokens_per_s']:>13.0f} "
              f"{r['dense_tokens_per_s']:>12.0f} {r['x_dense']:>7.2f}x", flush=True)
    return rows


def run(args: argparse.Namespace) -> int:
    give_jax_the_device_memory()
    import jax

    from sparrow_jax.benchmarking import read_ceiling, write_record

    # Every option checked before the first timing.
    shape = _shape(args) if "decode" in args.what else None
    if shape is not None:
        _check_memory(args, shape)
    schedule = mesh = None
    if "rollout" in args.what:
        model_config = _model_config(args)
        schedule, mesh = _schedule(args), _mesh(args, model_config)
        _check_rollout_memory(args, model_config, mesh)
    print(f"backend {jax.default_backend()}, device {jax.devices()[0].device_kind}")
    out = {}
    if shape is not None:
        ceiling = read_ceiling(small=jax.default_backend() == "cpu", marginal=True)
        print(f"read ceiling {ceiling:.0f} GB/s")
        out.update(read_ceiling_gbs=ceiling, decode=_decode(args, shape, ceiling))
    if schedule is not None:
        rows = out["rollout"] = _rollout(args, schedule, mesh)
        # The same figures as a step-time file (sparrow_jax/step_times.py): calibrate's
        # `step_times` reads this JSON for its measured speedup.
        out.update(batch=args.rows,
                   dense=[dict(context=r["mean_context"], step_ms=r["dense_step_s"] * 1e3)
                          for r in rows],
                   sparse=[dict(context=r["mean_context"], budget_pages=r["budget_pages"],
                                step_ms=r["sparse_step_s"] * 1e3) for r in rows])
    write_record(args.out, options={k: str(v) if isinstance(v, Path) else v
                                    for k, v in vars(args).items()}, **out)
    if args.out:
        print(f"wrote {args.out}")
    return 0
