"""``sparrow bench`` (sparrow_jax/commands/bench.py, sparrow_jax/decode_bench.py) at tiny shapes on
the CPU: the figures it writes agree with each other and with the bytes worked out by hand, the
sparse step it times matches the reference, and bad options fail in one line before anything is
timed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from sparrow_jax.cli import main

REPO = Path(__file__).resolve().parents[1]

TINY_DECODE = ["--what", "decode", "--batches", "1", "2", "--context", "256", "--budget-tokens",
               "64", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16", "--chain", "2",
               "--repeats", "1", "--dtype", "float32"]


def test_decode_figures_and_bytes_by_hand(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert main(["bench", *TINY_DECODE, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    ceiling = record["read_ceiling_gbs"]
    assert ceiling > 0 and f"read ceiling {ceiling:.0f} GB/s" in printed
    rows = record["decode"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        b = r["batch"]
        # 16 pages of 16 tokens, a budget of 4: centroids of the 13 scored pages and 4 pages'
        # K and V, 16 float32 each, per (row, KV head)
        assert r["sparse_bytes"] == b * 2 * (13 * 16 + 4 * 16 * 16 * 2) * 4
        assert r["dense_bytes"] == 2 * b * 256 * 2 * 16 * 4
        assert r["x_dense"] == pytest.approx(r["dense_s"] / r["sparse_s"])
        assert r["sparse_of_ceiling"] == pytest.approx(
            r["sparse_bytes"] / r["sparse_s"] / 1e9 / ceiling)
        assert r["rel_err"] < 2e-5          # the kernels' tolerance on a GPU; 0 on CPU
    assert record["options"]["budget_tokens"] == 64


def test_the_pallas_step_it_times_matches_the_reference():
    from sparrow_jax.decode_bench import DecodeShape, measure

    shape = DecodeShape(q_heads=4, kv_heads=2, head_dim=16, dtype="float32")
    # Three runs a chain: the GPU lane's eight test processes share one GPU.
    row = measure(shape, 2, 256, 64, impl="pallas", chain=1, repeats=3)
    assert row["rel_err"] < 2e-5 and row["sparse_s"] > 0


def test_rollout_figures_are_a_step_time_file(tmp_path):
    from sparrow_jax.step_times import load_step_times

    out = tmp_path / "rollout.json"
    assert main(["bench", "--what", "rollout", "--preset", "tiny", "--schedule", "4",
                 "--contexts", "128", "64", "96", "--rows", "2", "--steps-per-call", "4",
                 "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rollout"]
    assert [r["context"] for r in rows] == [64, 96, 128]
    for r in rows:
        assert r["sparse_tokens_per_s"] == pytest.approx(2 / r["sparse_step_s"])
        assert r["x_dense"] == pytest.approx(r["dense_step_s"] / r["sparse_step_s"])
        assert np.isfinite(r["dense_tokens_per_s"])
        assert r["budget_pages"] == 4                        # a fixed schedule of 4 pages
        assert abs(r["mean_context"] - r["context"]) <= 4    # one chunk of 4 steps each side
    # calibrate's measured speedup (`step_times`) reads the same JSON
    times = load_step_times(out)
    assert times.batch == 2 and times.sparse_budget_pages.tolist() == [4, 4, 4]
    np.testing.assert_allclose(times.dense_ms, [r["dense_step_s"] * 1e3 for r in rows])
    np.testing.assert_allclose(times.sparse_context, [r["mean_context"] for r in rows])


def test_rollout_pages_of_the_schedules_size(tmp_path):
    """The rollout's cache takes --page-size, the schedule's: no page-size mismatch midway."""
    out = tmp_path / "p32.json"
    assert main(["bench", "--what", "rollout", "--preset", "tiny", "--schedule", "3",
                 "--page-size", "32", "--contexts", "128", "--rows", "2", "--steps-per-call",
                 "4", "--repeats", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rollout"][0]["budget_pages"] == 3


def test_rollout_memory_by_hand(monkeypatch):
    """The rollout's start check on one device: the pool and the weights of the tiny preset
    (float32 on a CPU, bfloat16 on an accelerator), worked by hand; a byte less free
    refuses."""
    from types import SimpleNamespace

    from sparrow_jax.commands import bench
    from sparrow_jax.config import ModelConfig

    # tiny: 4 layers, hidden 128, 4 query and 2 KV heads of 32, MLP 384, vocab 256, tied
    layer = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 2 * 32 + 2 * 128 + 3 * 128 * 384
    size = 4 if jax.default_backend() == "cpu" else 2
    weights = (4 * layer + 256 * 128 + 128) * size
    tokens = 128 + 4 * (1 + 1) + 1     # the longest context, warm-up and 1 chunk of 4, a write
    pages = 2 * -(-tokens // 16) + 1   # 2 rows and the null page: 19
    pages = -(-pages // 64) * 64       # the engine rounds its pool up to 64 pages
    page = 4 * 2 * 32 * (2 * 16 + 1) * size  # layers x KV heads x head_dim x (K, V, centroid)
    args = SimpleNamespace(rows=2, contexts=[64, 128], steps_per_call=4, repeats=1,
                           page_size=16)
    cfg = ModelConfig.preset("tiny")
    monkeypatch.setattr(bench, "_memory_limit", lambda: pages * page + weights)
    bench._check_rollout_memory(args, cfg, None)
    monkeypatch.setattr(bench, "_memory_limit", lambda: pages * page + weights - 1)
    with pytest.raises(ValueError, match="--rows 2 at --contexts up to 128"):
        bench._check_rollout_memory(args, cfg, None)


def test_rollout_on_a_tensor_mesh(tmp_path):
    """The same measure on two simulated CPU devices with the weights split over tensor."""
    out = tmp_path / "mesh.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run(
        [sys.executable, "-m", "sparrow_jax.cli", "bench", "--what", "rollout", "--preset",
         "tiny", "--schedule", "4", "--contexts", "64", "--rows", "2", "--steps-per-call", "4",
         "--repeats", "1", "--mesh", "1,1,2", "--out", str(out)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "{'data': 1, 'fsdp': 1, 'tensor': 2}" in proc.stdout
    assert json.loads(out.read_text())["rollout"][0]["x_dense"] > 0


def test_options_from_a_config_file(tmp_path, capsys):
    config = tmp_path / "bench.yaml"
    config.write_text("what: [decode]\nbatches: [2]\ncontext: 256\nbudget_tokens: 48\n"
                      "q_heads: 4\nkv_heads: 2\nhead_dim: 16\nchain: 1\nrepeats: 1\n")
    assert main(["bench", "--config", str(config), "--budget-tokens", "64"]) == 0
    assert "budget 64 tokens" in capsys.readouterr().out      # the command line wins


@pytest.mark.parametrize("args, message", [
    (["--budget-tokens", "40"], "budget_tokens=40 must be a multiple of the page size 16"),
    (["--budget-tokens", "256"], "at least 3 pages and below context=256"),
    (["--context", "250"], "context=250 must be a positive multiple of the page size 16"),
    (["--q-heads", "3"], "q_heads=3 must be a multiple of kv_heads=2"),
    (["--what", "rollout", "--preset", "nope"], "unknown model preset 'nope'"),
    (["--what", "rollout", "--model", str(REPO / "checkpoints" / "demo")],
     "--model needs --schedule"),
    (["--what", "rollout", "--preset", "tiny", "--schedule", "x.yaml"],
     "schedule 'x.yaml' is neither a page count"),
    (["--batches", "4096", "--context", "65536", "--budget-tokens", "2048", "--q-heads", "32",
      "--kv-heads", "8", "--head-dim", "128"], "GiB of K and V pages"),    # 2 TiB: no machine
    (["--what", "decode", "rollout", "--preset", "qwen3-14b", "--rows", "4096"],
     "GiB a device (KV pages and weights)"),                             # 23 TiB: no machine
    (["--what", "rollout", "--preset", "tiny", "--schedule", "4", "--mesh", "1,2"],
     "--mesh '1,2': give three axis sizes"),
    (["--what", "rollout", "--preset", "tiny", "--schedule", "4", "--mesh", "1,1,2"],
     "mesh data=1, fsdp=1, tensor=2 needs 2 devices, found 1"),
])
def test_bad_options_fail_in_one_line_before_timing(args, message, capsys):
    assert main(["bench", *TINY_DECODE, *args]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("sparrow bench: error: ") and message in err
    assert "read ceiling" not in out


def test_free_memory_as_devices_report_it():
    """``free_bytes``: the allocator's limit less what is in use; None on the CPU, which reports
    neither, where the engine's memory-sized pool refuses in one line."""
    from types import SimpleNamespace

    from sparrow_jax.benchmarking import free_bytes
    from sparrow_jax.config import ModelConfig
    from sparrow_jax.rollout.engine import pages_in_free_memory

    cfg = ModelConfig.preset("tiny")
    cpu = jax.devices("cpu")[0]
    assert free_bytes(cpu) is None
    with pytest.raises(ValueError, match="cpu does not report its free memory"):
        pages_in_free_memory(cfg, 16, "float32", device=cpu)
    if jax.default_backend() == "gpu":   # the real allocator: something free, within its limit
        stats = jax.devices()[0].memory_stats()
        assert 0 < free_bytes() <= stats["bytes_limit"]
    gpu = SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 10 ** 9,
                                                                "bytes_in_use": 10 ** 8})
    assert free_bytes(gpu) == 9 * 10 ** 8
    # a page: K and V (2 x 16 vectors) and a centroid, per layer and KV head, float32
    per_page = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 33 * 4
    assert pages_in_free_memory(cfg, 16, "float32", device=gpu) == int(
        9 * 10 ** 8 * 0.8 // per_page)
