"""Frozen dataclass configs.

Every config validates itself in ``__post_init__`` so that a bad value fails where it is written,
not deep inside a jitted function. YAML files in ``configs/`` map key for key onto these classes
(see :func:`from_dict`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Callable

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
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)!r}")

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
        rope_theta, rope_key = cfg.get("rope_theta"), "rope_theta"
        scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")
        if isinstance(params, dict):
            if "rope_theta" in params:
                rope_theta, rope_key = params["rope_theta"], "rope_parameters.rope_theta"
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

        def get(key, hint, default=None):
            value = cfg.get(key)
            return default if value is None else check_value(hint, value, key)

        heads = get("num_attention_heads", int)
        eos = cfg.get("eos_token_id")
        eos_ids = check_value(tuple[int, ...], eos if isinstance(eos, list) else
                              ([] if eos is None else [eos]), "eos_token_id")
        return cls(
            vocab_size=get("vocab_size", int),
            hidden_size=get("hidden_size", int),
            intermediate_size=get("intermediate_size", int),
            num_hidden_layers=get("num_hidden_layers", int),
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads", int, heads),
            head_dim=get("head_dim", int, None) or get("hidden_size", int) // heads,
            rms_norm_eps=get("rms_norm_eps", float, 1e-6),
            rope_theta=(10_000.0 if rope_theta is None
                        else check_value(float, rope_theta, rope_key)),
            tie_word_embeddings=get("tie_word_embeddings", bool, False),
            attention_bias=get("attention_bias", bool, False),
            max_position_embeddings=get("max_position_embeddings", int, 40_960),
            bos_token_id=get("bos_token_id", int),
            eos_token_ids=eos_ids,
            pad_token_id=get("pad_token_id", int),
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


def unknown_name(what: str, name: Any, known) -> ConfigError:
    """The error for a name missing from a registry: lists the known names and suggests the
    nearest (``unknown reward 'needel' (did you mean 'needle'?); known: [...]``)."""
    import difflib

    known = sorted(known)
    near = difflib.get_close_matches(str(name), known, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ConfigError(f"unknown {what} {name!r}{hint}; known: {known}")


def from_dict(cls: type, data: dict[str, Any] | None, *, where: str = "") -> Any:
    """Builds the (nested) frozen dataclass ``cls`` from a plain dict, as read from YAML.

    Unknown keys are an error (a typo must not be silently ignored; the nearest known key is
    suggested). Every value is checked against its field's type hint, and errors name the key
    path (``optim.learning_rate``, prefixed by ``where``): ints stay ints (no bool, no float),
    numbers where a float is expected may be ints or the strings YAML 1.1 leaves unparsed
    (``1e-4`` is a string to PyYAML), lists become tuples where the field is a tuple, nested
    dataclass fields are built recursively.
    """
    data = dict(data or {})
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    prefix = f"{where}." if where else ""
    for key in sorted(set(data) - set(fields), key=str):
        raise unknown_name(f"key in {where or cls.__name__}:", key, fields)
    hints = typing.get_type_hints(cls)
    kwargs = {name: check_value(hints[name], value, f"{prefix}{name}")
              for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from None


def _kind(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


def check_value(hint: Any, value: Any, where: str) -> Any:
    """``value`` checked against (and, where lossless, converted to) the type ``hint``; a
    :class:`ConfigError` naming ``where`` otherwise. Handles the hints configs use: bool, int,
    float, str, Any, optional and union types, ``tuple[X, ...]``, ``dict[str, X]`` and nested
    dataclasses."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{where}: must be given, got null")
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return check_value(option, value, where)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        names = " or ".join(_kind(o) for o in options)
        raise ConfigError(f"{where}: expected {names}, got {value!r}")
    if dataclasses.is_dataclass(hint):
        if dataclasses.is_dataclass(value) and isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {hint.__name__}'s keys, got "
                              f"{value!r}")
        return from_dict(hint, value, where=where)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(check_value(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{where}: expected a list of {len(args)}, got {value!r}")
        return tuple(check_value(a, v, f"{where}[{i}]") for i, (a, v) in
                     enumerate(zip(args, value)))
    plain = dict if origin is dict else hint
    if plain in _PLAIN:
        accepts, what = _PLAIN[plain]
        if not accepts(value):
            raise ConfigError(f"{where}: expected {what}, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return value
    return value


# Types taken as they are: (accepts, what an error calls it). YAML's booleans are not ints here.
_PLAIN = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    str: (lambda v: isinstance(v, str), "a string"),
    dict: (lambda v: isinstance(v, dict), "a mapping"),
}


def load_yaml_config(path: str | Path, build: Callable[[dict[str, Any]], Any]) -> Any:
    """``build`` of the YAML mapping in ``path``. Every failure (no such file, invalid YAML, not
    a mapping, a bad key or value that ``build`` rejects) is one :class:`ConfigError` naming the
    file."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return build(data)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None


def to_dict(config: Any) -> dict[str, Any]:
    """The inverse of :func:`from_dict`: plain dicts and lists, ready for YAML."""
    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return plain(config)
