"""The ``sparrow`` CLI, in process: generate against a teacher-forced reference, config files,
dispatch of the not-yet-implemented subcommands, and clear errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from conftest import hf_case, tiny_train_config

from sparrow_jax.cli import SUBCOMMANDS, main
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.hf_io import load_qwen3
from sparrow_jax.models.qwen3 import init_model
from sparrow_jax.models.tokenizer import load_tokenizer

CHAT = str(hf_case("chat")["path"])


def _run(capsys, *argv):
    rc = main([*argv, "--no-progress"] if argv[0] == "generate" else list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _ids(out: str) -> list[int]:
    return [int(t) for t in out.strip().split(",")]


_forward = nnx.jit(lambda model, tokens: model(tokens))


def _assert_greedy(model, prompt, generated, eos=()):
    """Teacher-forced check with one unpadded forward of the whole sequence: each generated id
    is the argmax of the logits at the position before it, and only the last may be an EOS."""
    seq = jnp.asarray([list(prompt) + list(generated)], jnp.int32)
    logits = np.asarray(_forward(model, seq))[0]
    n = len(prompt)
    assert [int(np.argmax(logits[n - 1 + i])) for i in range(len(generated))] == list(generated)
    assert not set(generated[:-1]) & set(eos)


def test_generate_preset_greedy(capsys):
    rc, out, err = _run(capsys, "generate", "--preset", "tiny", "--prompt-ids", "5,17,3",
                        "--max-new-tokens", "6", "--ids")
    assert rc == 0 and "tokens/s" in err
    config = ModelConfig.preset("tiny")
    gen = _ids(out)
    assert 1 <= len(gen) <= 6
    _assert_greedy(init_model(config, seed=0), [5, 17, 3], gen, config.eos_token_ids)


def test_generate_chat_prompt_from_model_folder(capsys):
    model, _ = load_qwen3(CHAT)
    tok = load_tokenizer(CHAT)
    rc, out, _ = _run(capsys, "generate", "--model", CHAT, "--prompt", "What is 2+2?", "--chat",
                      "--no-thinking", "--max-new-tokens", "5", "--ids")
    assert rc == 0
    gen = _ids(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                     enable_thinking=False, tokenize=True)
    _assert_greedy(model, prompt, gen, tok.eos_token_ids)
    rc, text, _ = _run(capsys, "generate", "--model", CHAT, "--prompt", "What is 2+2?", "--chat",
                       "--no-thinking", "--max-new-tokens", "5")
    assert text == tok.decode(gen, skip_special_tokens=True) + "\n"


def test_top_k_one_sampling_equals_greedy_and_seed_reproducible(capsys):
    base = ("generate", "--model", CHAT, "--prompt", "Hello world", "--max-new-tokens", "4",
            "--ids")
    greedy = _run(capsys, *base)[1]
    assert _run(capsys, *base, "--temperature", "1.0", "--top-k", "1", "--seed", "9")[1] == greedy
    sampled = [_run(capsys, *base, "--temperature", "1.5", "--seed", "3")[1] for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_stop_sequence_ends_the_response(capsys):
    base = ("generate", "--preset", "tiny", "--prompt-ids", "5,17,3", "--max-new-tokens", "6",
            "--ids")
    free = _ids(_run(capsys, *base)[1])
    if 0 in free[:-1]:  # the preset's EOS would end it first
        free = free[:free.index(0) + 1]
    assert len(free) >= 3
    stop = free[1:3]
    rc, out, _ = _run(capsys, *base, "--stop", ",".join(map(str, stop)))
    assert rc == 0
    first = next(j for j in range(1, len(free)) if free[j - 1:j + 1] == stop)
    assert _ids(out) == free[:first + 1]


def test_sparse_schedule_and_samples(capsys, tmp_path):
    """Greedy samples of one prompt are identical; a budget of 3 pages of 4 over a 40-token
    prompt really runs sparse (and the CLI says so)."""
    from sparrow_jax.schedule import BudgetSchedule

    sched = tmp_path / "sched.yaml"
    sched.write_text(BudgetSchedule.fixed(3, page_size=4).to_yaml())
    prompt = ",".join(str(5 + i % 200) for i in range(40))
    rc, out, err = _run(capsys, "generate", "--preset", "tiny", "--prompt-ids", prompt,
                        "--max-new-tokens", "4", "--ids", "-n", "3", "--schedule", str(sched),
                        "--page-size", "4", "--dense-layers", "0")
    assert rc == 0, err
    rows = out.strip().splitlines()
    assert len(rows) == 3 and len(set(rows)) == 1
    assert "100% of steps sparse" in err or "75% of steps sparse" in err, err
    rc, refill_out, err = _run(capsys, "generate", "--preset", "tiny", "--prompt-ids", prompt,
                               "--max-new-tokens", "4", "--ids", "-n", "3", "--schedule",
                               str(sched), "--page-size", "4", "--dense-layers", "0",
                               "--refill-slots", "2")
    assert rc == 0 and refill_out == out, err                # refill: the same samples
    rc, _, err = _run(capsys, "generate", "--preset", "tiny", "--prompt-ids", prompt,
                      "--schedule", str(sched))
    assert rc == 2 and "pages of 4 tokens" in err


def test_train_then_plot(capsys, tmp_path):
    """``sparrow train`` with the real engine (sparse past layer 0), then ``sparrow plot``."""
    import yaml

    cfg = tiny_train_config(tmp_path / "run",
                            schedule={"kind": "fixed", "pages": 3, "page_size": 4},
                            mismatch={"min_count": 1}, checkpoint_every=2, eval_every=2,
                            eval_samples=1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, out, err = _run(capsys, "train", "--config", str(path))
    assert rc == 0, err
    assert "done: 2 steps" in out
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    rc, out, err = _run(capsys, "plot", str(tmp_path / "run"))
    assert rc == 0, err
    assert any(p.endswith("reward.png") for p in out.split())
    rc, _, err = _run(capsys, "plot", str(tmp_path))
    assert rc == 2 and "no metrics.jsonl" in err


def test_config_file_and_command_line_override(capsys, tmp_path):
    cfg = tmp_path / "gen.yaml"
    cfg.write_text(f"model: {CHAT}\nprompt_ids: '4,5,6'\nmax_new_tokens: 3\nids: true\n")
    rc, out, _ = _run(capsys, "generate", "--config", str(cfg))
    model, config = load_qwen3(CHAT)
    assert rc == 0 and len(_ids(out)) == 3  # this prompt's greedy continuation has no EOS
    _assert_greedy(model, [4, 5, 6], _ids(out))
    rc, out2, _ = _run(capsys, "generate", "--config", str(cfg), "--max-new-tokens", "1")
    assert rc == 0 and _ids(out2) == _ids(out)[:1]
    cfg.write_text("max_new_tokenz: 3\n")
    rc, _, err = _run(capsys, "generate", "--config", str(cfg))
    assert rc == 2 and "unknown key 'max_new_tokenz' (did you mean 'max_new_tokens'?)" in err
    rc, _, err = _run(capsys, "generate", "--config", str(tmp_path / "nope.yaml"))
    assert rc == 2 and "does not exist" in err


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny", "--model", CHAT, "--prompt-ids", "1"], "exactly one of --model"),
    (["--preset", "tiny"], "exactly one of --prompt"),
    (["--preset", "tiny", "--prompt", "hi"], "need a tokenizer"),
    (["--preset", "tiny", "--prompt-ids", "1", "--schedule", "nope"], "neither"),
    (["--preset", "tiny", "--prompt-file", "/no/file"], "does not exist"),
    (["--preset", "tiny", "--prompt-ids", "1,x"], "comma-separated integers"),
    (["--preset", "tiny", "--prompt-ids", "1,256"], "out of range [0, 256)"),
    (["--preset", "nonexistent", "--prompt-ids", "1"], "unknown model preset"),
    (["--model", "/no/such/dir", "--prompt-ids", "1"], "does not exist"),
    (["--model", CHAT, "--prompt-ids", "1", "--top-p", "0"], "top_p must be in (0, 1]"),
])
def test_generate_errors(capsys, argv, message):
    rc, _, err = _run(capsys, "generate", *argv)
    assert rc == 2 and message in err, err


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_every_subcommand_has_help_and_config(capsys, command):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and "--config" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["generate", "--preset", "tiny"],
    ["calibrate", "--config", "/no/such/cal.yaml"],
    ["bench", "--context", "250"],
    ["train", "--config", "/no/such/run.yaml"],
])
def test_device_commands_give_jax_the_memory_unless_told(monkeypatch, capsys, argv):
    """JAX's GPU allocator stops at 75% unless told; each command that runs the model tells it
    95% before any backend starts (here: before its first check of the options fails), and a
    value in the environment stays."""
    import os

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "")    # restored after the test
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert main(argv) == 2
    assert os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") == "0.95"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    assert main(argv) == 2
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.6"
    assert capsys.readouterr().err.count("error:") == 2
