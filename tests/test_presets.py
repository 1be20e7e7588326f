"""The presets of configs/presets and ``sparrow train --dry-run``: every preset validates and fits
its chip without weights, two presets' memory per device against hand-worked figures, and a
config that cannot fit fails with one line naming its largest part."""

import shutil
from pathlib import Path

import pytest
import yaml

from sparrow_jax.cli import main
from sparrow_jax.config import CONFIG_DIR, ConfigError
from sparrow_jax.dry_run import GIB, dry_run, format_report, load_run_file, run_file_from_dict

PRESETS = sorted((CONFIG_DIR / "presets").glob("*.yaml"))


def test_every_preset_fits_its_chip_without_weights():
    assert len(PRESETS) == 16
    for path in PRESETS:
        run = load_run_file(path)
        r = dry_run(run)
        assert "not found: architecture from configs/models/" in r.model_source, path
        assert r.devices == run.target.devices and r.mesh[0] * r.mesh[1] * r.mesh[2] == r.devices
        assert r.peak <= r.limit == int(0.9 * r.chip.memory), (path.name, r.peak / GIB)
        assert run.config.budget_schedule is not None     # the paper's table
        r.check_fits()


def test_qwen3_8b_on_8_h100_by_hand():
    r = dry_run(load_run_file(CONFIG_DIR / "presets" / "qwen3-8b-h100x8.yaml"))
    assert r.mesh == (1, 4, 2)
    # per layer: q, o 4096^2, k, v 4096*1024, MLP 3*4096*12288, each split fsdp 4 x tensor 2,
    # norms 2*4096 + 2*128 whole; embedding and LM head 151936*4096 / 8 each; final norm 4096
    per_layer = (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288) // 8 + 8448
    elements = 36 * per_layer + 2 * 151936 * 4096 // 8 + 4096
    assert r.memory.weights == r.memory.grads == 4 * elements == 4_096_446_464
    assert r.memory.optimizer == 8 * elements
    # the rollout's decode copy in bfloat16: kernels, embedding and head split over tensor 2,
    # whole over fsdp; norms whole
    assert r.rollout_weights == 2 * (36 * (192_937_984 // 2 + 8448) + 151936 * 4096 + 4096)
    # one shard: 1 prompt of 2048 tokens (128 shared pages) x 8 samples of 30720 new tokens
    # (2048 - 128 own pages each), the null page, rounded up to 64 pages
    assert r.pool_pages == 15552 >= 128 + 8 * 1920 + 1
    # pages x 16 tokens x (K, V) x 36 layers x 4 KV heads (8 over tensor 2) x 128 x bf16
    assert r.memory.kv_pages == 15552 * 16 * 2 * 36 * 4 * 128 * 2
    # b = 4 rows / (fsdp 4) = 1, T = 32768, cuDNN flash attention (softmax statistics only):
    # 36 kept layer inputs, one layer's internals (q 2048, k, v 512, MLP 6144 wide per device),
    # 16 heads' float32 statistics, then the head: 30720 hidden states, 3 [1024, 75968] blocks,
    # and the head weight's tensor shard [75968, 4096] gathered over fsdp (bfloat16) and its
    # float32 gradient
    layer = 32768 * (4096 + 2 * 2048 + 2 * 512 + 4 * 6144) * 2 + 16 * 32768 * 4
    head = 30720 * 4096 * 2 + 3 * 1024 * 75968 * 4 + 75968 * 4096 * (2 + 4)
    assert r.memory.activations == 36 * 32768 * 4096 * 2 + layer + head
    # the rollout phase (masters and moments, decode copy, pool) is the peak: 36.2 GiB of the
    # H100's 72 GiB (80 less 10%)
    assert r.peak == r.rollout_peak == 12 * elements + r.rollout_weights + r.memory.kv_pages
    assert round(r.peak / GIB, 2) == 36.16


def test_qwen3_14b_on_v5e_needs_the_split_decode_copy():
    """A whole decode copy of Qwen3-14B (29.5 GB in bfloat16) fits no v5e chip: the preset on
    64 v5e splits it over tensor = 4 (one host's chips); the copy alone, unsplit, is over the
    chip's limit."""
    path = CONFIG_DIR / "presets" / "qwen3-14b-v5litepod-64.yaml"
    r = dry_run(load_run_file(path))
    assert r.mesh == (1, 16, 4) and r.chip.name == "TPU v5e"
    # per layer: q, o 5120^2, k, v 5120*1024, MLP 3*5120*17408, split 4 ways; norms
    # 2*5120 + 2*128 whole; embedding and LM head 151936*5120 each split 4 ways; final norm
    per_layer = (2 * 5120 * 5120 + 2 * 5120 * 1024 + 3 * 5120 * 17408) // 4 + 10496
    assert r.rollout_weights == 2 * (40 * per_layer + 2 * 151936 * 5120 // 4 + 5120)
    assert round(r.rollout_weights / GIB, 2) == 6.88
    r.check_fits()
    data = yaml.safe_load(path.read_text())
    data["mesh"] = {"data": 1, "fsdp": 64, "tensor": 1}
    whole = dry_run(run_file_from_dict(data))
    assert whole.rollout_weights == 2 * 14_768_307_200 > whole.limit    # the copy alone
    assert whole.rollout_peak > whole.limit


def test_qwen3_1_7b_on_v5p_8_by_hand():
    r = dry_run(load_run_file(CONFIG_DIR / "presets" / "qwen3-1.7b-v5p-8.yaml"))
    assert r.mesh == (1, 1, 4) and r.chip.platform == "tpu"
    # tensor 4 alone: every kernel and the tied embedding split 4 ways, norms whole
    per_layer = (2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 6144) // 4 + 4352
    elements = 28 * per_layer + 151936 * 2048 // 4 + 2048
    assert r.memory.weights == 4 * elements == 4 * 430_236_672
    # b = 1, T = 32768, XLA attention: the [4 heads, T, T] float32 matrix four times
    layer = 32768 * (2048 + 2 * 512 + 2 * 256 + 4 * 1536) * 2 + 4 * 4 * 32768 ** 2 * 4
    head = 30720 * 2048 * 2 + 3 * 1024 * 37984 * 4
    assert r.memory.activations == 28 * 32768 * 2048 * 2 + layer + head
    # 8 prompts: 8 x (128 + 8 x 1920) + 1 = 123905 pages, rounded up to 64; 2 KV heads per device
    assert r.pool_pages == 123968
    assert r.memory.kv_pages == 123968 * 16 * 2 * 28 * 2 * 128 * 2
    # the update phase is the peak
    assert r.peak == r.update_peak == 16 * elements + r.memory.activations
    assert r.peak <= r.limit == int(0.9 * 95 * GIB)


def test_the_kl_reference_is_counted_in_both_phases():
    """``update.loss.kl_coef`` keeps the initial weights in the compute dtype, in the weights'
    layout, for the whole run: 2 bytes a parameter of one device's share on top of each phase."""
    path = CONFIG_DIR / "presets" / "qwen3-8b-h100x8.yaml"
    data = yaml.safe_load(path.read_text())
    plain = dry_run(run_file_from_dict(data))
    data["update"] = {**data.get("update", {}), "loss": {"kl_coef": 0.04}}
    r = dry_run(run_file_from_dict(data))
    assert plain.reference_weights == 0 and "reference_weights" not in plain.components()
    assert r.reference_weights == r.memory.weights // 2 == 2 * 1_024_111_616
    assert r.update_peak == plain.update_peak + r.reference_weights
    assert r.rollout_peak == plain.rollout_peak + r.reference_weights
    table = format_report(r)
    assert "KL reference (compute dtype, sharded)" in table
    assert "update: weights, moments, reference, grads, acts" in table


@pytest.mark.parametrize("preset, chip, part", [
    ("qwen3-14b-h200x8.yaml", "h100", "kv_pages 38.0 GiB"),   # 8 rows of 32K, KV heads whole
    ("qwen3-1.7b-v5p-8.yaml", "v5e", "activations 68.6 GiB"),        # the T x T scores
])
def test_a_config_that_does_not_fit_fails_with_one_line(preset, chip, part, capsys):
    status = main(["train", "--config", str(CONFIG_DIR / "presets" / preset), "--dry-run",
                   "--chip", chip])
    out, err = capsys.readouterr()
    assert status == 2 and "DOES NOT FIT" in out
    assert err.count("\n") == 1 and err.startswith("sparrow train: error: does not fit: ")
    assert f"largest part: {part}" in err


def test_dry_run_prints_the_table_and_passes(capsys):
    path = CONFIG_DIR / "presets" / "qwen3-8b-h100x8.yaml"
    assert main(["train", "--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "mesh on 8 devices: data=1, fsdp=4, tensor=2" in out
    assert "/path/to/Qwen3-8B not found: architecture from configs/models/qwen3-8b.json" in out
    assert out.rstrip().endswith("fits")


def test_mesh_and_devices_must_agree(capsys):
    path = CONFIG_DIR / "presets" / "qwen3-1.7b-v5litepod-16.yaml"
    assert main(["train", "--config", str(path), "--dry-run", "--devices", "8"]) == 2
    assert capsys.readouterr().err == ("sparrow train: error: mesh data=1, fsdp=8, tensor=2 "
                                       "needs 16 devices, found 8\n")


def test_model_folder_config_is_read_and_unknown_folders_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(CONFIG_DIR / "models" / "qwen3-0.6b.json", folder / "config.json")
    base = {"model": {"path": str(folder)}, "data": {"prompts_per_step": 2},
            "rollout": {"samples_per_prompt": 2, "max_new_tokens": 64},
            "update": {"micro_batch_size": 2}, "mesh": {"data": 1, "fsdp": 2, "tensor": 1},
            "target": {"chip": "h100"}}
    r = dry_run(run_file_from_dict(base))
    assert r.model_source.endswith("config.json (weights not read)") and r.devices == 2
    assert r.model.hidden_size == 1024
    base["model"] = {"path": str(Path(tmp_path) / "Llama-7B")}
    with pytest.raises(ConfigError, match=r"^model.path: .*Llama-7B has no config.json and "
                                          r"'llama-7b' is no preset of configs/models"):
        dry_run(run_file_from_dict(base))


@pytest.mark.parametrize("name", ["qwen3-1.7b-polaris.yaml", "qwen3-4b-polaris.yaml"])
def test_math_recipe_configs_pass_the_dry_run(name, capsys):
    """The paper's math runs (README, "Math RL recipe"): its hyper-parameters, and they fit."""
    from sparrow_jax.rl.rewards import math_options

    assert main(["train", "--config", str(CONFIG_DIR / name), "--dry-run"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("fits")
    c = load_run_file(CONFIG_DIR / name).config
    loss = c.update.loss
    assert (c.data.recipe, c.reward, c.rollout.samples_per_prompt, c.rollout.max_new_tokens,
            c.eval_samples) == ("polaris", "math", 8, 32768, 16)
    assert (c.optim.learning_rate, c.optim.weight_decay, loss.correction, loss.tis_cap,
            loss.clip_low, loss.clip_high, loss.dual_clip) == (1e-6, 0.01, "tis", 3, 0.2, 0.28, 3)
    assert c.schedule == {"paper": name.removesuffix("-polaris.yaml")}
    assert set(c.data.eval_sets) == {"aime24", "aime25", "aime26", "amc", "math500", "gsm8k"}
    assert math_options(c.reward_options).after_think is False


# The start of a run (dry_run.check_device_memory): the run's count against the allocator's
# limit, before weights load. Reference: Qwen3-14B's GRPO step on two H200s, measured with the
# allocator at 85% of the memory (119.3 GiB): 111.9 GiB in the rollout, 118.5 in the update
# (BENCHMARKS.md, "Several GPUs on one host", run 12).
PROBE_14B = {"mesh": {"data": 1, "fsdp": -1, "tensor": 1},
             "model": {"preset": "qwen3-14b", "dtype": "bfloat16"},
             "data": {"task": "needle", "prompts_per_step": 2,
                      "needle": {"min_prompt_len": 256, "max_prompt_len": 256}},
             "rollout": {"samples_per_prompt": 4, "max_new_tokens": 256, "temperature": 1.0,
                         "eos_ids": []},
             "schedule": {"paper": "qwen3-14b"}, "update": {"micro_batch_size": 8}}


def h200(limit_gib: float):
    from types import SimpleNamespace

    return SimpleNamespace(platform="gpu", device_kind="NVIDIA H200",
                           memory_stats=lambda: {"bytes_limit": int(limit_gib * GIB)})


def test_a_run_too_big_for_the_allocator_is_refused_before_weights_load(monkeypatch):
    from sparrow_jax.dry_run import check_device_memory

    config = run_file_from_dict(dict(PROBE_14B, run_dir="/tmp/unused")).config
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    # JAX's default 75% of an H200 (105.3 GiB): below the rollout's 111.9 measured; refused.
    with pytest.raises(ConfigError) as e:
        check_device_memory(config, [h200(105.3)] * 2, 2)
    assert str(e.value).count("\n") == 0
    assert str(e.value).startswith("memory: the run holds at least 110.3 GiB a device")
    assert ("NVIDIA H200's allocator gives 105.3 GiB (XLA_PYTHON_CLIENT_MEM_FRACTION unset: "
            "JAX's default, 75% on GPUs)") in str(e.value)
    # 85% (119.3 GiB), where the run was measured: passes, and the count (117.2) fits too.
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_device_memory(config, [h200(119.3)] * 2, 2)
    # Between the floor and the whole count: it runs, with a warning.
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")
    with pytest.warns(UserWarning, match=r"^memory: the dry run counts 117\.2 GiB a device .*"
                                         r"\(XLA_PYTHON_CLIENT_MEM_FRACTION=0\.8\)"):
        check_device_memory(config, [h200(112.0)] * 2, 2)
    # Four devices split the weights and moments: the same 105.3 GiB holds it.
    check_device_memory(config, [h200(105.3)] * 4, 4)
    # A device that reports no limit (CPU) is not checked.
    import jax
    check_device_memory(config, jax.devices("cpu"), 2)


def test_the_floor_leaves_out_what_the_engine_does_not_hold():
    """Without the engine (a rollout function of the caller's) the floor is the update's
    weights, moments and gradients; with refill, whose pool is its own, no KV pages."""
    from sparrow_jax.dry_run import check_device_memory

    config = run_file_from_dict(dict(PROBE_14B, run_dir="/tmp/unused")).config
    r = dry_run(run_file_from_dict(dict(PROBE_14B, run_dir="/tmp/unused")), devices=2)
    m = r.memory
    update_floor = (m.weights + m.optimizer + m.grads) / GIB
    with_pages = (m.weights + m.optimizer + r.rollout_weights + m.kv_pages) / GIB
    assert with_pages > update_floor        # the rollout's floor is the larger here
    just_under = h200(update_floor - 0.01)
    with pytest.raises(ConfigError):
        check_device_memory(config, [just_under] * 2, 2, engine=False)
    with pytest.warns(UserWarning):
        check_device_memory(config, [h200(update_floor + 0.01)] * 2, 2, engine=False)
        with pytest.raises(ConfigError):     # the engine's decode copy and pages on top
            check_device_memory(config, [h200(update_floor + 0.01)] * 2, 2)
    refill = dict(PROBE_14B, run_dir="/tmp/unused",
                  rollout=dict(PROBE_14B["rollout"], refill_slots=8))
    no_pages = (m.weights + m.optimizer + r.rollout_weights) / GIB
    with pytest.warns(UserWarning):
        check_device_memory(run_file_from_dict(refill).config,
                            [h200(max(no_pages, update_floor) + 0.01)] * 2, 2)


def test_the_trainer_checks_memory_before_loading_weights(monkeypatch, tmp_path):
    import jax

    import sparrow_jax.rl.trainer as trainer_mod

    config = run_file_from_dict(dict(PROBE_14B, run_dir=str(tmp_path / "run"))).config
    monkeypatch.setattr(jax, "local_devices", lambda: [h200(100.0)] * 2)
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    monkeypatch.setattr(trainer_mod, "_mesh", lambda config, processes: None)
    monkeypatch.setattr(trainer_mod, "load_policy", lambda *a: pytest.fail("weights loaded"))
    with pytest.raises(ConfigError, match="^memory: the run holds at least 110.3 GiB"):
        trainer_mod.Trainer(config)


def test_sparrow_train_gives_jax_the_memory_unless_told(monkeypatch, tmp_path):
    import os
    from types import SimpleNamespace

    import sparrow_jax.rl.trainer as trainer_mod

    seen = []
    monkeypatch.setattr(trainer_mod, "train", lambda config, **kw: seen.append(
        os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")) or SimpleNamespace(history=[]))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(dict(PROBE_14B, run_dir=str(tmp_path / "run"))))
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "")    # restored after the test
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert main(["train", "--config", str(path)]) == 0
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    assert main(["train", "--config", str(path)]) == 0
    assert seen == ["0.95", "0.6"]
