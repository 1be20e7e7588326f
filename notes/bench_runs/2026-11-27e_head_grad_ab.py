"""The LM head's loss gradient (sum of sampled log-probs) through head_outputs, bf16, Qwen3-1.7B
head (V 151936, d 2048), 18432 positions in 18 chunks of 1024, remat: the float32 weight-gradient
sum of 50e340d (this tree) against the bfloat16 sum before it (rebuilt here from the same
pieces). Alternating, median of many."""
import json, statistics, time, sys
import jax, jax.numpy as jnp
from sparrow_jax.models import lm_head as L

V, D, N, C = 151936, 2048, 18432, 1024


def old_lp(h, w, ids):
    def body(w, h, ids):
        return L._chunk_stats(h, w, ids, None, 1.0, 0, False)[0]
    return L.map_positions(body, (h, ids), w, chunk_size=C, remat=True)


def new_lp(h, w, ids):
    return L.head_outputs(h[None], w, ids[None], chunk_size=C, remat=True).logprobs[0]


def make(fn):
    @jax.jit
    def g(h, w, ids):
        return jax.grad(lambda h, w: fn(h, w, ids).astype(jnp.float32).sum(), (0, 1))(h, w)
    return g


k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
h = (jax.random.normal(k1, (N, D)) * 0.5).astype(jnp.bfloat16)
w = (jax.random.normal(k2, (V, D)) * 0.02).astype(jnp.bfloat16)
ids = jax.random.randint(k3, (N,), 0, V)
fns = {"bf16 sum (before 50e340d)": make(old_lp), "f32 sum (50e340d)": make(new_lp)}
ref = None
for name, f in fns.items():
    out = jax.block_until_ready(f(h, w, ids))
    gw = out[1].astype(jnp.float32)
    ref = gw if ref is None else ref
    print(name, "dW max |x - first|", float(jnp.abs(gw - ref).max()), "max|dW|", float(jnp.abs(gw).max()))
times = {k: [] for k in fns}
for _ in range(15):
    for name, f in fns.items():
        t = time.perf_counter(); jax.block_until_ready(f(h, w, ids)); times[name].append(time.perf_counter() - t)
res = {k: statistics.median(v) * 1e3 for k, v in times.items()}
print(json.dumps({"device": str(jax.devices()[0].device_kind), "median_ms": res,
                  "ratio_new_over_old": res["f32 sum (50e340d)"] / res["bf16 sum (before 50e340d)"]}))
