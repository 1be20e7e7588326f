"""Tokenizer of an HF model folder: ``tokenizer.json`` through the ``tokenizers`` library, plus
``tokenizer_config.json`` (special tokens) and the chat template, rendered with jinja2 the way
transformers' ``apply_chat_template`` renders it.

The jinja environment copies the features transformers gives chat templates (a sandbox with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII characters and takes ``indent``), so a model's
own template renders to the same string here as there.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any, Sequence

# Names of the special tokens transformers hands every chat template (its special_tokens_map).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")
# Older names for a message's reasoning; transformers copies them to ``reasoning_content``.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(ValueError):
    """A tokenizer folder is missing files, or a chat template cannot be rendered."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores a special token as a string or as a serialised AddedToken.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(source)


def _prepare_messages(messages: Sequence[dict]) -> list[dict]:
    """As transformers: keys whose value is None are dropped (templates handle a missing key but
    may print "None"), and reasoning under an older name is also offered as ``reasoning_content``
    and ``thinking``."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise TokenizerError(
                f"chat messages must be dicts with 'role' and 'content', got {m!r}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class Tokenizer:
    """A fast tokenizer with its special tokens, EOS ids and chat template.

    ``eos_token_ids`` holds the tokenizer's EOS id first, then any extra stop ids handed in (from
    generation_config.json: Qwen3 stops at both ``<|im_end|>`` and ``<|endoftext|>``).
    """

    def __init__(self, backend, special_tokens: dict[str, str] | None = None,
                 chat_template: str | None = None, extra_eos_ids: Sequence[int] = ()):
        self.backend = backend
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self._compiled = None
        for name, text in self.special_tokens.items():
            if backend.token_to_id(text) is None:
                raise TokenizerError(f"{name} {text!r} is not in the tokenizer's vocabulary")
        eos = [] if self.eos_token is None else [self.token_to_id(self.eos_token)]
        self.eos_token_ids = tuple(dict.fromkeys([*eos, *map(int, extra_eos_ids)]))

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_ids: Sequence[int] = ()) -> "Tokenizer":
        """Reads ``tokenizer.json``, ``tokenizer_config.json`` and the chat template (from
        ``chat_template.jinja`` as transformers 5 saves it, else the config's ``chat_template``)."""
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(
                f"no tokenizer.json in {path} (only fast tokenizers are supported)")
        backend = Backend.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        special = {name: _token_text(cfg.get(name)) for name in _SPECIAL_TOKEN_NAMES}
        special = {k: v for k, v in special.items() if v is not None}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(backend, special, template, extra_eos_ids)

    # -- special tokens ----------------------------------------------------------------------
    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int:
        tid = self.backend.token_to_id(token)
        if tid is None:
            raise TokenizerError(f"token {token!r} is not in the vocabulary")
        return tid

    # -- text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``; special tokens written in the text become their ids, as in HF."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- chat ----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool | None = True, tokenize: bool = False,
                            tools: Sequence[dict] | None = None, **template_kwargs
                            ) -> str | list[int]:
        """Renders ``messages`` (dicts with ``role`` and ``content``) with the chat template.

        ``enable_thinking=None`` leaves the variable undefined in the template (what
        transformers does when the argument is not passed); Qwen3's template treats undefined
        like True. With ``tokenize=True`` returns ids (no BOS/EOS added, as transformers).
        """
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template (no chat_template.jinja "
                                 "and no chat_template in tokenizer_config.json)")
        if not messages:
            raise TokenizerError("cannot apply a chat template to an empty conversation")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        kwargs = {**self.special_tokens, **template_kwargs}
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        text = self._compiled.render(messages=_prepare_messages(messages),
                                     tools=None if tools is None else list(tools),
                                     documents=None, add_generation_prompt=add_generation_prompt,
                                     **kwargs)
        return self.encode(text) if tokenize else text


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of an HF model folder, with generation_config.json's EOS ids merged in."""
    from sparrow_jax.models.hf_io import load_generation_config

    gen = load_generation_config(path)
    return Tokenizer.from_dir(path, extra_eos_ids=gen.get("eos_token_ids", ()))
