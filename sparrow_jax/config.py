"""Frozen dataclass configs.

Every config validates itself in ``__post_init__`` so that a bad value fails where it is written,
not deep inside a jitted function. YAML files in ``configs/`` map key for key onto these classes
(see :func:`from_dict`).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


class ConfigError(ValueError):
    """A configuration value is missing, malformed or unsupported."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen3 decoder (the fields of HF's ``Qwen3Config`` that matter)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 40_960
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (the GQA ratio r)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def kv_elements_per_token(self) -> int:
        """D of the cost model: key elements per token over all layers and KV heads."""
        return self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    def num_params(self) -> int:
        d, h, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        attn = d * (h + 2 * hd) * self.head_dim + h * self.head_dim * d + 2 * self.head_dim
        mlp = 3 * d * self.intermediate_size
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_hidden_layers * per_layer + d + head

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Reads an HF ``config.json`` dict (transformers 4.x top-level ``rope_theta`` or 5.x
        ``rope_parameters``). Rejects what this implementation would silently get wrong."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if model_type not in (None, "qwen3") or any(a != "Qwen3ForCausalLM" for a in archs):
            raise ConfigError(
                f"unsupported architecture: model_type={model_type!r}, architectures={archs!r}; "
                "sparrow-jax implements Qwen3ForCausalLM (model_type 'qwen3')")
        rope_theta = cfg.get("rope_theta")
        scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                scaling = params
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in (None, "default"):
                raise ConfigError(
                    f"unsupported rope scaling {kind!r} (rope_scaling={scaling}); only the default "
                    "rotary embedding is implemented")
        if cfg.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported (Qwen3 dense models use "
                              "full attention)")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in cfg]
        if missing:
            raise ConfigError(f"config.json lacks required keys {missing}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10_000.0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 40_960)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        eos = list(self.eos_token_ids)
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A named architecture from ``configs/models/<name>.json`` (HF config.json format)."""
        path = CONFIG_DIR / "models" / f"{name}.json"
        if not path.exists():
            known = sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.json"))
            raise ConfigError(f"unknown model preset {name!r}; known presets: {known}")
        return cls.from_hf_dict(json.loads(path.read_text()))


def from_dict(cls: type, data: dict[str, Any] | None) -> Any:
    """Builds the (nested) frozen dataclass ``cls`` from a plain dict, as read from YAML.

    Unknown keys are an error (a typo must not be silently ignored); nested dataclass fields are
    built recursively; lists become tuples where the field is a tuple.
    """
    data = dict(data or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{cls.__name__}: unknown keys {unknown}; known keys: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{cls.__name__}: {e}") from None


def _coerce(hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return from_dict(hint, value)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg) and isinstance(value, dict):
                return from_dict(arg, value)
        if isinstance(value, list) and any(typing.get_origin(a) is tuple
                                           for a in typing.get_args(hint)):
            return tuple(value)
        return value
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    return value


def to_dict(config: Any) -> dict[str, Any]:
    """The inverse of :func:`from_dict`: plain dicts and lists, ready for YAML."""
    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return plain(config)
