"""Per-call costs of the rollout on a 2-GPU mesh (run 4 of BENCHMARKS.md "Two GPUs on one host"):
model_params (cast + replicate; at 1c3ef37 a per-leaf astype and jax.device_put, since then one
jitted program) and generate's parts, 1.7B shape, fp32 masters fsdp-sharded as the trainer
holds them. Run from the repo root: PYTHONPATH=. python3 THIS [max_new] [compute dtype]."""
import sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from sparrow_jax import sharding
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.rollout import engine
from sparrow_jax.rollout.engine import RolloutConfig, generate, model_params
from sparrow_jax.schedule import BudgetSchedule
from jax.sharding import NamedSharding, PartitionSpec

cfg = ModelConfig.preset("qwen3-1.7b")
DT = jnp.dtype(sys.argv[2]) if len(sys.argv) > 2 else jnp.bfloat16
t = time.perf_counter()
model = init_model(cfg, dtype=DT)
mesh = sharding.make_mesh(sharding.MeshConfig(1, 2, 1))
nnx.update(model, jax.tree.map(np.asarray, nnx.state(model)))
sharding.shard_model(model, mesh)
print(f"model on mesh {time.perf_counter()-t:.1f} s", flush=True)

def timed(label, f, n=3):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); out = jax.block_until_ready(f()); ts.append(time.perf_counter() - t)
    print(f"{label}: {[round(x, 3) for x in ts]} s", flush=True)
    return out

timed("model_params(model, mesh) [astype per leaf + device_put replicated]", lambda: model_params(model, mesh)[1])
timed("model_params(model, None) [astype per leaf only]", lambda: model_params(model, None)[1])
g, st = nnx.split(model)
rep = NamedSharding(mesh, PartitionSpec())
cast_rep = jax.jit(lambda s: jax.tree.map(lambda x: x.astype(DT) if jnp.issubdtype(x.dtype, jnp.floating) else x, s), out_shardings=rep)
timed("jit cast + replicate (out_shardings)", lambda: cast_rep(st))

prompts = [list(np.random.default_rng(i).integers(10, min(1000, cfg.vocab_size), 256)) for i in range(2)]
rc = RolloutConfig(n=8, max_new_tokens=int(sys.argv[1]) if len(sys.argv) > 1 else 1024, temperature=1.0, eos_ids=())
sched = BudgetSchedule.paper("qwen3-1.7b")
chunks = []
orig = engine.decode_chunk
def chunk(*a, **k):
    t = time.perf_counter(); out = jax.block_until_ready(orig(*a, **k)); chunks.append(time.perf_counter() - t); return out
engine.decode_chunk = chunk
orig_mp = engine.model_params
mp_t = []
def mp(*a, **k):
    t = time.perf_counter(); out = jax.block_until_ready(orig_mp(*a, **k)); mp_t.append(time.perf_counter() - t); return out
engine.model_params = mp
orig_sb = engine.start_batch
sb_t = []
def sb(*a, **k):
    t = time.perf_counter(); out = jax.block_until_ready(orig_sb(*a, **k)); sb_t.append(time.perf_counter() - t); return out
engine.start_batch = sb
single = None
for label, m in (("mesh 1,2,1", mesh), ("one GPU", None)):
    if m is None:
        single = init_model(cfg, dtype=DT)
    for call in range(2):
        chunks.clear(); mp_t.clear(); sb_t.clear()
        t = time.perf_counter()
        r = jax.block_until_ready(generate(model if m is not None else single, prompts, rc, jax.random.key(call), sched, mesh=m))
        total = time.perf_counter() - t
        print(f"{label} call {call}: total {total:.2f} s; model_params {sum(mp_t):.2f}; start_batch {sum(sb_t):.2f}; "
              f"{len(chunks)} chunks {sum(chunks):.2f} s (median {np.median(chunks)*1e3:.0f} ms, max {max(chunks)*1e3:.0f})", flush=True)
