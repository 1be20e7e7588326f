"""Probe (session 51): which phase of a GRPO step on an FSDP mesh holds the step's peak device
memory. Multi-GPU run 10 measured Qwen3-14B on fsdp=4 at 96.4 GiB a GPU where the dry run
(`sparrow train --dry-run`) counts 69.1; the excess is about one whole float32 copy of the
weights. A thread samples device 0's bytes in use every 2 ms while the trainer runs two steps;
the rollout (and within it the decode copy's cast and gather), the recompute and the update are
each wrapped to record when they start and end,
and the probe prints each phase's largest sample (XLA allocates a program's temporaries when it
starts, so a phase's peak shows while its programs run).

    NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 \
        notes/bench_runs/2026-11-29l_phase_memory_probe.py --model qwen3-14b --out $OUT/m.json
    JAX_PLATFORMS=cpu python3 notes/bench_runs/2026-11-29l_phase_memory_probe.py --model tiny \
        --dtype float32 --mesh 1,1,1 --max-new 16          # a check of the probe itself
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time

import jax

import sparrow_jax.rl.trainer as trainer_mod
import sparrow_jax.rollout.engine as engine
from sparrow_jax.data import DataConfig, NeedleConfig
from sparrow_jax.rl.config import ModelSpec, RolloutSettings, TrainConfig, UpdateConfig
from sparrow_jax.sharding import MeshConfig

GIB = 2 ** 30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-14b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--mesh", default="1,-1,1")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    d, f, t = (int(x) for x in args.mesh.split(","))
    config = TrainConfig(
        run_dir=tempfile.mkdtemp(prefix="phase_memory_"), steps=2,
        mesh=MeshConfig(d, f, t), model=ModelSpec(preset=args.model, dtype=args.dtype),
        data=DataConfig(task="needle", prompts_per_step=2, needle=NeedleConfig(
            min_prompt_len=256, max_prompt_len=256)),
        rollout=RolloutSettings(samples_per_prompt=4, max_new_tokens=args.max_new,
                                temperature=1.0, eos_ids=()),
        schedule={"paper": "qwen3-14b"}, update=UpdateConfig(micro_batch_size=8),
        checkpoint_every=10 ** 6, tensorboard=False, progress=False)
    device = jax.local_devices()[0]
    samples, marks, stop = [], [], threading.Event()

    def in_use():
        stats = device.memory_stats() or {}
        return stats.get("bytes_in_use", 0)

    def sample():
        while not stop.is_set():
            samples.append((time.perf_counter(), in_use()))
            time.sleep(0.002)

    def marked(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return jax.block_until_ready(fn(*a, **k))
            finally:
                marks.append((name, t0, time.perf_counter()))
        return wrapper

    t0 = time.perf_counter()
    trainer = trainer_mod.Trainer(config)
    print(f"set up in {time.perf_counter() - t0:.1f} s, in use {in_use() / GIB:.2f} GiB",
          flush=True)
    trainer.rollout_fn = marked("rollout", trainer.rollout_fn)
    trainer_mod.recompute = marked("recompute", trainer_mod.recompute)
    engine.model_params = marked("decode copy", engine.model_params)   # inside the rollout
    trainer.updater.update = marked("update", trainer.updater.update)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    steps = []
    for step in range(2):
        begin = time.perf_counter()
        trainer.train_step()
        steps.append((begin, time.perf_counter()))
    stop.set()
    thread.join()
    rows = []
    for name, a, b in marks:
        inside = [m for s, m in samples if a <= s <= b]
        rows.append(dict(phase=name, step=next(i for i, (x, y) in enumerate(steps) if x <= a <= y),
                         seconds=b - a, samples=len(inside),
                         max_gib=max(inside, default=0) / GIB))
        print(json.dumps(rows[-1]), flush=True)
    stats = device.memory_stats() or {}
    record = dict(model=args.model, mesh=args.mesh, device=device.device_kind,
                  peak_gib=stats.get("peak_bytes_in_use", 0) / GIB,
                  max_sampled_gib=max((m for _, m in samples), default=0) / GIB, phases=rows)
    print(json.dumps({k: v for k, v in record.items() if k != "phases"}), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)


if __name__ == "__main__":
    main()
