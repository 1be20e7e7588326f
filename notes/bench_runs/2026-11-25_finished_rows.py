"""Diagnosis: do finished rows cost more than live short rows in a wide table? (sparse, 8K)"""
import sys, time, statistics
sys.path.insert(0, "scripts")   # run from the repo root: python3 notes/bench_runs/<this file>
import jax, jax.numpy as jnp, numpy as np
import bench_rollout as br
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rollout.engine import decode_chunk
from sparrow_jax.rollout.profile import fixed_context_batch, at_context

cfg = ModelConfig.preset("qwen3-1.7b" if jax.default_backend() == "gpu" else "tiny")
gpu = jax.default_backend() == "gpu"
dt = jnp.bfloat16 if gpu else jnp.float32
br.DTYPE[0] = dt
model = init_model(cfg, dtype=dt, param_dtype=dt)
max_new = 8192 if gpu else 128
rc = br.rollout_config(max_new)
for mode in ("sparse", "dense"):
    batch, g, p, state = fixed_context_batch(model, rc, rows=32, prompt_len=32, key=jax.random.key(1),
                                             schedule=br.schedule_for(mode))
    W = batch.width
    for ctx in ((96, max_new - 200) if gpu else (40, 100)):
        for live in (32, 1):
            def put(st):
                st = at_context(st, ctx)
                fin = np.full(32, -1, np.int32); fin[live:] = 2
                return st._replace(finish=jax.device_put(fin, st.finish.sharding))
            reach = W * rc.page_size
            state = jax.block_until_ready(decode_chunk(batch, g, p, put(state), reach=reach)[0])
            ts = []
            for _ in range(5):
                s0 = put(state)
                t0 = time.perf_counter()
                state = jax.block_until_ready(decode_chunk(batch, g, p, s0, reach=reach)[0])
                ts.append((time.perf_counter() - t0) / rc.steps_per_call * 1e3)
            print(f"{mode} width {W} ctx {ctx} live {live}/32: {statistics.median(ts):.3f} ms/step "
                  f"{[round(t, 2) for t in ts]}", flush=True)
    batch = state = None
