import sys, os
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from jax.sharding import NamedSharding, PartitionSpec as P
from sparrow_jax.models.lm_head import head_outputs
from sparrow_jax.rl.recompute import response_rows
opt = {"xla_gpu_enable_scatter_determinism_expander": True}
mesh = jax.make_mesh((2,), ("t",), axis_types=(jax.sharding.AxisType.Auto,))
rng = np.random.default_rng(0)
B, T, d, V = 8, 12, 32, 64
h = jnp.asarray(rng.normal(size=(B, T, d)), jnp.float32)
W = jnp.asarray(rng.normal(size=(V, d)) * 0.3, jnp.float32)
ids = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
gid = jnp.asarray(rng.integers(0, V, (B, T, 4)), jnp.int32)
wl = jnp.asarray(rng.normal(size=(B, T)), jnp.float32); wg = jnp.asarray(rng.normal(size=(B, T, 4)), jnp.float32)
def lp_only(h, W):
    o = head_outputs(h, W, ids, temperature=0.8, chunk_size=16)
    return (o.logprobs * wl).sum()
def with_gather(h, W):
    o = head_outputs(h, W, ids, temperature=0.8, gather_ids=gid, top_k=3, entropy=True, chunk_size=16)
    return (o.logprobs * wl).sum() + (o.gathered_logprobs * wg).sum() + o.entropy.sum()
hid = jnp.asarray(rng.normal(size=(B, 20, d)), jnp.float32)
pl = jnp.asarray(rng.integers(1, 15, (B,)), jnp.int32)
wr = jnp.asarray(rng.normal(size=(B, 10, d)), jnp.float32)
def rows(hid, W):
    return (response_rows(hid, pl, 10) * wr).sum() + 0 * W.sum()
for name, f, args in (("lp", lp_only, (h, W)), ("gather", with_gather, (h, W)), ("rows", rows, (hid, W))):
    g = jax.grad(f, argnums=(0, 1))
    ref = [np.asarray(x, np.float64) for x in jax.jit(g)(*args)]
    for sh in ("one", "W on t", "W on t, h on d"):
        a = list(args)
        if sh != "one":
            a[1] = jax.device_put(a[1], NamedSharding(mesh, P("t", None)))
        if sh == "W on t, h on d":
            a[0] = jax.device_put(a[0], NamedSharding(mesh, P(None, None, "t")))
        for on, o in (("default", {}), ("expander", opt)):
            out = [np.asarray(x, np.float64) for x in jax.jit(g, compiler_options=o)(*a)]
            print(name, sh, on, "dh", float(np.abs(out[0] - ref[0]).max()), "dW", float(np.abs(out[1] - ref[1]).max()), flush=True)
