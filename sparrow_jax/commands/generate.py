"""``sparrow generate``: greedy or sampled text through a simple full-recompute loop.

Every step runs the whole sequence, right-padded to one fixed length (prompt + max new tokens,
rounded up to a multiple of 64) so that the step compiles once, through the dense forward, and
samples from the logits at the last real position (causal attention: the padding after it has
no effect). There is no KV cache; the real engine (paged cache, sparse decode) is
:mod:`sparrow_jax.rollout`.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

PAD_MULTIPLE = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="HF model folder (config.json, safetensors, "
                                              "optionally tokenizer.json)")
    p.add_argument("--preset", help="randomly initialised model from configs/models "
                                    "(tiny, qwen3-0.6b, ...), instead of --model")
    p.add_argument("--prompt", help="prompt text (needs the folder's tokenizer)")
    p.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true",
                   help="wrap --prompt as one user message in the chat template")
    p.add_argument("--no-thinking", action="store_true",
                   help="with --chat: render with enable_thinking=false")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 means no top-k truncation")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and preset init seed)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute dtype; auto: bfloat16 on an accelerator, float32 on CPU")
    p.add_argument("--ids", action="store_true", help="print generated token ids, not text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass(frozen=True)
class Generation:
    ids: list[int]              # generated ids, the stopping EOS included
    first_token_s: float        # wall time of the first step (includes compilation)
    rest_s: float               # wall time of the other steps

    @property
    def tokens_per_s(self) -> float:
        """Steady-state rate: the steps after the first (the first pays for compilation)."""
        if len(self.ids) > 1:
            return (len(self.ids) - 1) / max(self.rest_s, 1e-9)
        return len(self.ids) / max(self.first_token_s, 1e-9)


@functools.cache  # one jitted function, so repeated calls reuse its compilation
def _next_token_fn():
    import jax
    from flax import nnx

    from sparrow_jax.models.qwen3 import logits_from_hidden
    from sparrow_jax.rollout.sampling import sample

    # Plain jax.jit over the split model: nnx.jit would walk the module graph on every call.
    @functools.partial(jax.jit, static_argnames=("graphdef", "sampling"))
    def next_token(graphdef, state, tokens, index, key, sampling):
        """tokens ``[1, L]`` (right-padded), index: last real position -> next id ``[]``."""
        model = nnx.merge(graphdef, state)
        hidden, _ = model.forward(tokens)
        h = jax.lax.dynamic_index_in_dim(hidden, index, axis=1, keepdims=False)
        token, _ = sample(key, logits_from_hidden(h, model.head_weight()), sampling)
        return token[0]

    return next_token


def generate_ids(model, prompt_ids: Sequence[int], *, max_new_tokens: int, sampling,
                 eos_ids: Sequence[int] = (), seed: int = 0, progress: bool = False
                 ) -> Generation:
    """Generates up to ``max_new_tokens`` ids after ``prompt_ids``, stopping after an EOS."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from tqdm import tqdm

    n = len(prompt_ids)
    if n == 0:
        raise ValueError("the prompt is empty: generation needs at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    # Padded up to a multiple of PAD_MULTIPLE: nearby lengths share one compilation.
    length = -(-(n + max_new_tokens) // PAD_MULTIPLE) * PAD_MULTIPLE
    buf = np.zeros((1, length), np.int32)
    buf[0, :n] = prompt_ids
    key = jax.random.key(seed)
    next_token = _next_token_fn()
    graphdef, state = nnx.split(model)
    eos = set(int(e) for e in eos_ids)
    out: list[int] = []
    first = rest = 0.0
    for step in tqdm(range(max_new_tokens), disable=not progress, file=sys.stderr,
                     desc="generate", unit="tok"):
        t0 = time.perf_counter()
        tok = int(next_token(graphdef, state, jnp.asarray(buf), n + step - 1,
                             jax.random.fold_in(key, step), sampling))
        dt = time.perf_counter() - t0
        first, rest = (dt, rest) if step == 0 else (first, rest + dt)
        out.append(tok)
        if tok in eos:
            break
        buf[0, n + step] = tok
    return Generation(out, first, rest)


def run(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from sparrow_jax.cli import CliError
    from sparrow_jax.config import ModelConfig
    from sparrow_jax.models.hf_io import load_qwen3
    from sparrow_jax.models.qwen3 import check_tokens, init_model
    from sparrow_jax.models.tokenizer import load_tokenizer
    from sparrow_jax.rollout.sampling import SamplingParams

    if (args.model is None) == (args.preset is None):
        raise CliError("give exactly one of --model PATH or --preset NAME")
    if (args.prompt is None) == (args.prompt_ids is None):
        raise CliError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if args.dtype == "auto":
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    else:
        dtype = jnp.dtype(args.dtype)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)

    tokenizer = None
    if args.model is not None:
        model, config = load_qwen3(args.model, dtype=dtype)
        if (Path(args.model) / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(args.model)
    else:
        config = ModelConfig.preset(args.preset)
        model = init_model(config, seed=args.seed, dtype=dtype)

    if args.prompt is not None:
        if tokenizer is None:
            raise CliError("--prompt needs a tokenizer (a --model folder with tokenizer.json); "
                           "give --prompt-ids instead")
        if args.chat:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                enable_thinking=not args.no_thinking, tokenize=True)
        else:
            prompt = tokenizer.encode(args.prompt)
    else:
        if args.chat:
            raise CliError("--chat renders a text --prompt; it does not apply to --prompt-ids")
        try:
            prompt = [int(t) for t in str(args.prompt_ids).split(",") if t.strip()]
        except ValueError:
            raise CliError(f"--prompt-ids must be comma-separated integers, got "
                           f"{args.prompt_ids!r}") from None
    check_tokens(prompt, config.vocab_size)
    if len(prompt) + args.max_new_tokens > config.max_position_embeddings:
        raise CliError(f"prompt ({len(prompt)}) + max_new_tokens ({args.max_new_tokens}) exceeds "
                       f"the model's max_position_embeddings ({config.max_position_embeddings})")

    eos = [*config.eos_token_ids, *(tokenizer.eos_token_ids if tokenizer else ())]
    gen = generate_ids(model, prompt, max_new_tokens=args.max_new_tokens, sampling=sampling,
                       eos_ids=eos, seed=args.seed, progress=not args.no_progress)
    if args.ids or tokenizer is None:
        print(",".join(map(str, gen.ids)))
    else:
        print(tokenizer.decode(gen.ids, skip_special_tokens=True))
    print(f"{len(gen.ids)} tokens, {gen.tokens_per_s:.1f} tokens/s after a first step of "
          f"{gen.first_token_s:.2f} s (compilation included); prompt {len(prompt)} tokens",
          file=sys.stderr)
    return 0
