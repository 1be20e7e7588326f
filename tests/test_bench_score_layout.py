"""scripts/bench_score_layout.py's page-major scoring (centroids ``[N, Hkv * D]``) against
float64 NumPy, in Pallas interpret mode: each eligible slot's key decoded back to the dot of its
centroid with the mean of its KV head's queries, INT_MIN elsewhere (rows shorter than the
table included)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_score_layout",
                                              REPO / "scripts/bench_score_layout.py")
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


@pytest.mark.parametrize("chunk", [16, 32])
def test_page_major_keys_match_float64(chunk):
    rng = np.random.default_rng(chunk)
    b, m, hkv, hq, d, p = 2, 64, probe.HKV, probe.HQ, probe.D, probe.P
    q = jnp.asarray(rng.standard_normal((b, hq, d)), jnp.bfloat16)
    cent = jnp.asarray(rng.standard_normal((hkv, b * m, d)), jnp.bfloat16)
    table = rng.permutation(b * m).astype(np.int32).reshape(b, m)
    lengths = np.asarray([m * p, 300], np.int32)          # 64 pages, then 19
    cent_pm = cent.transpose(1, 0, 2).reshape(b * m, hkv * d)
    got = np.asarray(probe.score_page_major(q, cent_pm, jnp.asarray(table),
                                            jnp.asarray(lengths), chunk=chunk, hkv=hkv,
                                            interpret=True))
    q64 = np.asarray(q, np.float64).reshape(b, hkv, hq // hkv, d).mean(axis=2)
    prod = np.asarray(cent, np.float64)[:, table].transpose(1, 0, 2, 3) * q64[:, :, None]
    n = -(-lengths // p)
    slot = np.arange(m)
    eligible = (slot[None] >= 1) & (slot[None] < n[:, None] - 2)
    np.testing.assert_array_equal(got != probe.INT_MIN, np.broadcast_to(eligible[:, None],
                                                                        got.shape))
    ok = got != probe.INT_MIN
    np.testing.assert_allclose(probe.scores_from_keys(got)[ok], prod.sum(-1)[ok], rtol=0,
                               atol=2e-6 * np.abs(prod).sum(-1).max())
