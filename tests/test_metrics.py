"""Metrics: JSONL/TensorBoard writer with resume truncation, plots, and the trainer's mismatch
metrics against a float64 NumPy reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.metrics import MetricsWriter, read_metrics
from sparrow_jax.plot import plot_run
from sparrow_jax.rl.recompute import DenseStats
from sparrow_jax.rollout.types import Rollout


def test_jsonl_resume_truncates_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboardX")
    w = MetricsWriter(tmp_path, tensorboard=True)
    for step in range(5):
        w.write(step, {"reward_mean": step / 10, "alpha_paper_p5_bin00": float("nan")})
    w.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4]
    assert read_metrics(tmp_path)[2] == {"step": 2, "reward_mean": 0.2,
                                         "alpha_paper_p5_bin00": None}
    # resume at step 3: the interrupted run's lines for steps 3, 4 go
    w = MetricsWriter(tmp_path, tensorboard=True, resume_from=3)
    w.write(3, {"reward_mean": 0.9})
    w.close()
    assert [(r["step"], r["reward_mean"]) for r in read_metrics(tmp_path)] == [
        (0, 0.0), (1, 0.1), (2, 0.2), (3, 0.9)]
    assert any((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_plot_run_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    w = MetricsWriter(tmp_path, tensorboard=False)
    for step in range(4):
        w.write(step, {"reward_mean": step, "grad_norm": 1.0, "time_rollout": 2.0,
                       "time_update": 1.0})
    w.close()
    paths = plot_run(tmp_path)
    assert sorted(p.name for p in paths) == ["grad_norm.png", "reward.png", "time.png"]
    # a run with the KL term on also gets its curve
    w = MetricsWriter(tmp_path / "kl", tensorboard=False)
    for step in range(4):
        w.write(step, {"reward_mean": step, "kl": step / 100})
    w.close()
    assert sorted(p.name for p in plot_run(tmp_path / "kl")) == ["kl.png", "reward.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _np_logsoftmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_mismatch_metrics_match_numpy():
    pytest.importorskip("sparrow_jax.mismatch")
    from sparrow_jax.rl.step_metrics import mismatch_metrics

    rng = np.random.default_rng(0)
    s, r, v, k = 4, 6, 12, 5
    lp_p = _np_logsoftmax(rng.normal(0, 2, (s, r, v)))
    lp_q = _np_logsoftmax(np.log(np.exp(lp_p) + 0.3 * rng.uniform(0, 1, (s, r, v))))
    q_ids = np.argsort(-lp_q, -1)[..., :k]
    p_ids = np.argsort(-lp_p, -1)[..., :k]
    take = np.take_along_axis
    prompt = np.array([3, 5, 2, 7])
    resp = np.array([6, 2, 4, 1])
    mask = np.arange(r)[None] < resp[:, None]
    budget = np.array([[0, 2, 2, 1, 1, 1]] * s)
    rollout = Rollout(tokens=jnp.zeros((s, 16), jnp.int32), prompt_lengths=jnp.asarray(prompt),
                      response_lengths=jnp.asarray(resp), logprobs=jnp.zeros((s, r)),
                      topk_ids=jnp.asarray(q_ids), topk_logprobs=jnp.asarray(take(lp_q, q_ids, -1),
                                                                             jnp.float32),
                      budget_pages=jnp.asarray(budget), finish_reason=jnp.zeros(s, jnp.int32),
                      prompt_index=jnp.arange(s))
    dense = DenseStats(jnp.zeros((s, r)), jnp.asarray(take(lp_p, q_ids, -1), jnp.float32),
                       jnp.asarray(p_ids), jnp.asarray(take(lp_p, p_ids, -1), jnp.float32),
                       jnp.zeros((s, r)))
    out = mismatch_metrics(rollout, dense, bin_tokens=4, num_bins=3, min_count=3, page_size=2)

    p, q = np.exp(lp_p), np.exp(lp_q)
    topk = np.zeros((s, r))
    paper = np.zeros((s, r))
    for b in range(s):
        for j in range(r):
            topk[b, j] = sum(min(p[b, j, x], q[b, j, x]) for x in q_ids[b, j])
            shared = set(q_ids[b, j]) & set(p_ids[b, j])
            paper[b, j] = sum(min(p[b, j, x], q[b, j, x]) for x in shared)
    lengths = prompt[:, None] + np.arange(r)[None]
    for name, a in (("topk_bound", topk), ("paper", paper)):
        np.testing.assert_allclose(out[f"alpha_{name}_mean"], a[mask].mean(), rtol=1e-5)
        np.testing.assert_allclose(out[f"alpha_{name}_p5"], np.percentile(a[mask], 5), rtol=1e-5)
        bins = np.minimum(lengths // 4, 2)
        for i in range(3):
            sel = a[mask & (bins == i)]
            key = f"alpha_{name}_p5_bin{i:02d}"
            if sel.size >= 3:
                np.testing.assert_allclose(out[key], np.percentile(sel, 5), rtol=1e-5)
            else:
                assert key not in out
    # sparse where budget > 0 and ceil(lengths / 2) pages exceed it
    sparse = (budget > 0) & (-(-lengths // 2) > budget)
    assert out["sparse_step_fraction"] == pytest.approx(sparse[mask].mean())
    assert 0 < out["sparse_step_fraction"] < 1
