"""Builds the HF-parity fixtures under tests/fixtures/hf/ with transformers itself.

Run in the reference venv (Python 3.11, CPU torch, transformers; see scripts/make_hf_venv.sh):

    .venv-hf/bin/python scripts/make_hf_fixtures.py [--out tests/fixtures/hf]

For every case it writes a tiny random ``Qwen3ForCausalLM`` with ``save_pretrained`` (config.json,
safetensors, generation_config.json), the inputs (``input_ids.npy``, ``position_ids.npy``) and
transformers' logits for them (``logits.npy``, float32). Norm weights are drawn at random so that a
loader that dropped them (leaving ones) fails. The ``chat`` case also carries a tiny byte-level BPE
tokenizer with the Qwen3 chat template, and ``chat_cases.json`` holds transformers' renderings of
that template (text and ids) and its encode/decode of a few strings.

This script needs no part of sparrow_jax: the references stay independent of the code under test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

# The chat template shipped in Qwen3's tokenizer_config.json (Qwen/Qwen3-8B and siblings).
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3 keeps these as added but non-special tokens (kept in decoded text).
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the sum of 12 and 30? The answer is 42.",
    "Let me think step by step about the question before answering.",
    "user assistant system tool call response weather Paris today",
    "Sparse attention keeps the pages with the largest scores.",
    "Hello! How can I help you today? I am a helpful assistant.",
] * 4

# name -> (config overrides, dtype, position offsets per batch row, save kwargs)
BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            rms_norm_eps=1e-6, initializer_range=0.1, max_position_embeddings=40960)
CASES = {
    "tied_gqa1": (dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                       tie_word_embeddings=True, rope_theta=1_000_000.0), "float32", (0, 0), {}),
    "untied_gqa2_hd16": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              tie_word_embeddings=False, rope_theta=10_000.0), "float32", (0, 0), {}),
    # Many shards, read through model.safetensors.index.json.
    "gqa4_theta_sharded": (dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                tie_word_embeddings=False, rope_theta=543_210.0), "float32", (0, 0),
                           dict(max_shard_size="20KB")),
    "attn_bias": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       attention_bias=True, tie_word_embeddings=False, rope_theta=1_000_000.0),
                  "float32", (0, 0), {}),
    "pos32k": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    tie_word_embeddings=True, rope_theta=1_000_000.0), "float32", (32_740, 31_000), {}),
    "bf16": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=False, rope_theta=1_000_000.0), "bfloat16", (0, 0), {}),
}
SEQ_LEN = 11


def build_tokenizer() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Random (non-ones) norm weights and small random biases: a loader that drops them fails."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def make_model_case(out: Path, name: str, overrides: dict, dtype: str, offsets, save_kwargs,
                    seed: int, extra: dict | None = None) -> None:
    torch.manual_seed(seed)
    cfg = Qwen3Config(**{**BASE, **overrides, **(extra or {})})
    model = Qwen3ForCausalLM(cfg).eval()  # eager/sdpa: both are exact softmax attention
    randomize(model, seed)
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, size=(len(offsets), SEQ_LEN)).astype(np.int64)
    pos = (np.asarray(offsets)[:, None] + np.arange(SEQ_LEN)[None]).astype(np.int64)

    def logits_of(m):
        with torch.no_grad():
            return m(input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(pos)).logits

    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
        # The same bf16-rounded weights run in float32: the exact answer both bf16 runs approximate.
        exact = logits_of(_as_float32(model))
        np.save(folder / "logits_fp32.npy", exact.float().numpy())
    model.save_pretrained(folder, **save_kwargs)
    np.save(folder / "input_ids.npy", ids.astype(np.int32))
    np.save(folder / "position_ids.npy", pos.astype(np.int32))
    np.save(folder / "logits.npy", logits_of(model).float().numpy())


def _as_float32(model: torch.nn.Module) -> torch.nn.Module:
    clone = Qwen3ForCausalLM(model.config).eval()
    clone.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return clone.to(torch.float32)


def make_chat_case(out: Path, seed: int) -> None:
    tok = build_tokenizer()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>", unk_token=None,
                                     model_max_length=40960)
    hf_tok.chat_template = QWEN3_CHAT_TEMPLATE
    vocab = 320  # >= len(tokenizer), like Qwen3's padded embedding
    assert len(hf_tok) <= vocab, len(hf_tok)
    end_of_text, im_end = (tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>"))
    make_model_case(out, "chat", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=True, rope_theta=1_000_000.0),
                    "float32", (0, 0), {}, seed,
                    extra=dict(vocab_size=vocab, bos_token_id=end_of_text, eos_token_id=im_end))
    folder = out / "chat"
    hf_tok.save_pretrained(folder)
    # As Qwen3: generation stops at <|im_end|> or <|endoftext|>.
    GenerationConfig(bos_token_id=end_of_text, eos_token_id=[im_end, end_of_text],
                     pad_token_id=end_of_text, do_sample=True, temperature=0.6, top_p=0.95,
                     top_k=20).save_pretrained(folder)

    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    conversations = chat_conversations()
    cases = []
    for conv in conversations:
        for agp in (True, False):
            for thinking in (None, True, False):
                kwargs = {} if thinking is None else {"enable_thinking": thinking}
                text = hf_tok.apply_chat_template(conv["messages"], tools=conv.get("tools"),
                                                  add_generation_prompt=agp, tokenize=False,
                                                  **kwargs)
                ids = hf_tok.apply_chat_template(conv["messages"], tools=conv.get("tools"),
                                                 add_generation_prompt=agp, tokenize=True,
                                                 return_dict=False, **kwargs)
                cases.append(dict(name=conv["name"], messages=conv["messages"],
                                  tools=conv.get("tools"), add_generation_prompt=agp,
                                  enable_thinking=thinking, text=text, ids=list(map(int, ids))))
    strings = ["Hello world!", "<|im_start|>user\nHi<|im_end|>\n", "naïve café 42 <think>x</think>",
               "  leading and trailing spaces  ", ""]
    encodings = [dict(text=s, ids=hf_tok.encode(s, add_special_tokens=False)) for s in strings]
    decodings = []
    for e in encodings:
        for skip in (False, True):
            decodings.append(dict(ids=e["ids"], skip_special_tokens=skip,
                                  text=hf_tok.decode(e["ids"], skip_special_tokens=skip)))
    (out / "chat_cases.json").write_text(json.dumps(
        dict(templates=cases, encode=encodings, decode=decodings), indent=1, ensure_ascii=False))


def chat_conversations() -> list[dict]:
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city, in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    return [
        dict(name="single_user", messages=[{"role": "user", "content": "What is 2+2?"}]),
        dict(name="system_multi_turn", messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
            {"role": "user", "content": "Add 3 and 4."},
        ]),
        dict(name="reasoning_field_last_assistant", messages=[
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7", "reasoning_content": "Small primes: 2, 3, 5, 7."},
        ]),
        dict(name="tools", tools=[weather], messages=[
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Zürich"}}}]},
            {"role": "tool", "content": "{\"temp\": 21}"},
            {"role": "tool", "content": "{\"wind\": 3}"},
            {"role": "assistant", "content": "It is 21 °C."},
        ]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    for i, (name, (overrides, dtype, offsets, save_kwargs)) in enumerate(CASES.items()):
        make_model_case(args.out, name, overrides, dtype, offsets, save_kwargs, seed=100 + i)
    make_chat_case(args.out, seed=200)
    (args.out / "manifest.json").write_text(json.dumps(dict(
        cases=sorted([*CASES, "chat"]), torch=torch.__version__,
        transformers=transformers.__version__, tokenizers=tokenizers.__version__,
        command="python scripts/make_hf_fixtures.py"), indent=1) + "\n")


if __name__ == "__main__":
    main()
