"""``sparrow generate``: sample from an HF model folder or a randomly initialised preset through
the rollout engine (paged cache, dense prefill, sparse decode under a budget schedule).

Prompts come from ``--prompt`` (text, optionally in the chat template), ``--prompt-ids`` or a
``--prompt-file`` (one text prompt per line). ``--schedule`` takes a paper schedule name
(``qwen3-1.7b``), a schedule YAML file, or ``dense`` (the default).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sparrow_jax.commands import give_jax_the_device_memory


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sparrow_jax.cli import non_negative_float, positive_int

    p.add_argument("--model", type=Path, help="HF model folder (config.json, safetensors, "
                                              "optionally tokenizer.json)")
    p.add_argument("--preset", help="randomly initialised model from configs/models "
                                    "(tiny, qwen3-0.6b, ...), instead of --model")
    p.add_argument("--prompt", help="prompt text (needs the folder's tokenizer)")
    p.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--prompt-file", type=Path, help="text prompts, one per line")
    p.add_argument("--chat", action="store_true",
                   help="wrap each text prompt as one user message in the chat template")
    p.add_argument("--no-thinking", action="store_true",
                   help="with --chat: render with enable_thinking=false")
    p.add_argument("-n", "--num-samples", type=positive_int, default=1,
                   help="samples per prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 means no top-k truncation")
    p.add_argument("--stop", action="append", default=[],
                   help="stop text (tokenized) or, with --ids, comma-separated ids; repeatable")
    p.add_argument("--schedule", default="dense",
                   help="'dense', a paper schedule name (qwen3-1.7b, ...) or a schedule YAML file")
    p.add_argument("--dense-layers", default="0,1",
                   help="comma-separated layers that always attend densely")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and preset init seed)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute dtype; auto: bfloat16 on an accelerator, float32 on CPU")
    p.add_argument("--refill-slots", type=positive_int, default=None,
                   help="continuous refill with this many decode slots (same samples; pages "
                   "allocated as rows grow); default: one static batch")
    p.add_argument("--ids", action="store_true", help="print generated token ids, not text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _int_list(text: str, what: str) -> list[int]:
    from sparrow_jax.cli import CliError

    try:
        return [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise CliError(f"{what} must be comma-separated integers, got {text!r}") from None


def load_schedule(spec: str, page_size: int):
    """``dense`` -> None; else :meth:`BudgetSchedule.from_spec` (a page count, a paper schedule
    name or a schedule YAML file)."""
    from sparrow_jax.cli import CliError
    from sparrow_jax.schedule import BudgetSchedule

    if spec == "dense":
        return None
    try:
        return BudgetSchedule.from_spec(spec, page_size)
    except ValueError as e:
        raise CliError(f"--schedule: {e}") from None


def run(args: argparse.Namespace) -> int:
    give_jax_the_device_memory()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sparrow_jax.cli import CliError
    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.hf_io import load_qwen3
    from sparrow_jax.models.qwen3 import init_model
    from sparrow_jax.models.tokenizer import load_tokenizer
    from sparrow_jax.rollout.engine import RolloutConfig, generate

    if (args.model is None) == (args.preset is None):
        raise CliError("give exactly one of --model PATH or --preset NAME")
    sources = [x for x in (args.prompt, args.prompt_ids, args.prompt_file) if x is not None]
    if len(sources) != 1:
        raise CliError("give exactly one of --prompt TEXT, --prompt-ids 1,2,3 or --prompt-file")
    if args.dtype == "auto":
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    else:
        dtype = jnp.dtype(args.dtype)

    tokenizer = None
    if args.model is not None:
        model, config = load_qwen3(args.model, dtype=dtype)
        if (Path(args.model) / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(args.model)
    else:
        config = ModelConfig.preset(args.preset)
        model = init_model(config, seed=args.seed, dtype=dtype)

    def encode(text: str) -> list[int]:
        if tokenizer is None:
            raise CliError("text prompts and stops need a tokenizer (a --model folder with "
                           "tokenizer.json); give --prompt-ids instead")
        if args.chat:
            return tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True,
                enable_thinking=not args.no_thinking, tokenize=True)
        return tokenizer.encode(text)

    if args.prompt_ids is not None:
        if args.chat:
            raise CliError("--chat renders text prompts; it does not apply to --prompt-ids")
        prompts = [_int_list(args.prompt_ids, "--prompt-ids")]
    elif args.prompt_file is not None:
        if not args.prompt_file.is_file():
            raise CliError(f"prompt file {args.prompt_file} does not exist")
        prompts = [encode(line) for line in args.prompt_file.read_text().splitlines()
                   if line.strip()]
        if not prompts:
            raise CliError(f"prompt file {args.prompt_file} holds no prompt")
    else:
        prompts = [encode(args.prompt)]
    stops = [_int_list(s, "--stop") if args.ids or tokenizer is None else tokenizer.encode(s)
             for s in args.stop]
    longest = max(map(len, prompts))
    if longest + args.max_new_tokens > config.max_position_embeddings:
        raise CliError(f"prompt ({longest}) + max_new_tokens ({args.max_new_tokens}) exceeds "
                       f"the model's max_position_embeddings ({config.max_position_embeddings})")

    eos = tuple(dict.fromkeys([*config.eos_token_ids,
                               *(tokenizer.eos_token_ids if tokenizer else ())]))
    rollout_config = RolloutConfig(
        n=args.num_samples, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, eos_ids=eos, stop_sequences=tuple(map(tuple, stops)),
        page_size=args.page_size, dense_layers=tuple(_int_list(args.dense_layers,
                                                               "--dense-layers")),
        progress=not args.no_progress)
    schedule = load_schedule(args.schedule, args.page_size)
    t0 = time.perf_counter()
    key = jax.random.key(args.seed)
    if args.refill_slots is None:
        rollout = generate(model, prompts, rollout_config, key, schedule=schedule)
    else:
        from sparrow_jax.rollout.refill import generate_refill

        rollout = generate_refill(model, prompts, rollout_config, key, schedule,
                                  slots=args.refill_slots)
    rollout = jax.block_until_ready(rollout)
    seconds = time.perf_counter() - t0

    tokens, pl, rl = (np.asarray(x) for x in (rollout.tokens, rollout.prompt_lengths,
                                              rollout.response_lengths))
    for row in range(len(pl)):
        ids = tokens[row, pl[row]:pl[row] + rl[row]].tolist()
        if args.ids or tokenizer is None:
            print(",".join(map(str, ids)))
        else:
            print(tokenizer.decode(ids, skip_special_tokens=True))
    budgets = np.asarray(rollout.budget_pages)[np.asarray(rollout.response_mask)]
    pages = -(-(np.repeat(pl, rl) + np.concatenate([np.arange(r) for r in rl])) // args.page_size)
    sparse = float(np.mean((budgets > 0) & (pages > budgets))) if budgets.size else 0.0
    print(f"{int(rl.sum())} tokens in {len(pl)} sequences, {rl.sum() / seconds:.1f} tokens/s "
          f"(compilation included), {100 * sparse:.0f}% of steps sparse; schedule "
          f"{args.schedule}", file=sys.stderr)
    return 0
