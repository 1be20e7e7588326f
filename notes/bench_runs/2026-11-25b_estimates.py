"""Two CPU estimates behind session 10's GPU changes (not measurements):

1. Rounds of the GPU/TPU selection's threshold search with the early stop (5beebe6, babdf98):
   it stops at the highest bit where the k-th and (k+1)-th largest keys differ. Keys as
   bench_decode.py makes them (page "topics"), 2048 pages, budget 128 pages (k = 125), 200 draws.
2. The batch-19 rollout's sparse/dense tokens/s (0-32K integral, the 2026-11-23 profile at
   010f869) if every step of both modes were `delta` ms shorter (the recorded top-k's saving).

    JAX_PLATFORMS=cpu PYTHONPATH=. python notes/bench_runs/2026-11-25b_estimates.py
"""
import json
import os

import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention.selection import order_key

HERE = os.path.dirname(os.path.abspath(__file__))
rng = np.random.default_rng(0)
n, d, k = 2048, 128, 128 - 3
rounds = []
for _ in range(200):
    cent = (rng.standard_normal((n, 16, d)) + 2 * rng.standard_normal((n, 1, d))).mean(1)
    scores = cent.astype(np.float32) @ rng.standard_normal(d).astype(np.float32)
    keys = np.sort(np.asarray(order_key(jnp.asarray(scores[1:n - 2]))).astype(np.int64))[::-1]
    a, b = keys[k - 1] + 2 ** 31, keys[k] + 2 ** 31
    rounds.append(32 if a == b else 32 - int(a ^ b).bit_length() + 1)
print(f"threshold rounds with the early stop: mean {np.mean(rounds):.1f} of 32, 5/50/95th "
      f"percentiles {np.percentile(rounds, [5, 50, 95]).tolist()}")

with open(os.path.join(HERE, "2026-11-23_ab14_profile_new_1.json")) as f:
    modes = json.load(f)["modes"]


def integral(rows, delta):
    xs = np.array([r["mean_context"] for r in rows])
    ys = np.array([r["step_ms"] for r in rows]) - delta
    return np.interp(np.arange(1, 32769), xs, ys).sum()


for delta in (0.0, 0.15, 0.25):
    ratio = integral(modes["dense"]["rows"], delta) / integral(modes["sparse"]["rows"], delta)
    print(f"rollout 0-32K, batch 19, both steps {delta} ms shorter: sparse/dense {ratio:.2f}x")
