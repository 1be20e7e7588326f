"""HF model folders <-> :class:`~sparrow_jax.models.qwen3.Qwen3`.

A folder holds ``config.json``, the weights (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) and optionally ``generation_config.json`` and the tokenizer
files. Weights are read with safetensors' NumPy backend (no torch). HF linear weights are
``[out, in]`` and ours ``[in, out]``; embeddings and the LM head are ``[vocab, hidden]`` in both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparrow_jax.config import ConfigError, ModelConfig
from sparrow_jax.models.qwen3 import Qwen3

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# generation_config.json is not among them: save_qwen3 writes it from the config's EOS ids.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
# Buffers some exporters write that carry no learned state (recomputed from the config).
_IGNORABLE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A model folder is missing files or holds tensors that do not fit the config."""


@dataclasses.dataclass(frozen=True)
class _Tensor:
    hf_name: str
    path: tuple          # our nnx state path
    shape: tuple         # HF layout
    transpose: bool      # HF [out, in] <-> our [in, out]


def _tensor_map(cfg: ModelConfig) -> list[_Tensor]:
    """Every tensor a checkpoint of ``cfg`` must hold, in HF names and layouts."""
    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out = [_Tensor("model.embed_tokens.weight", ("embed_tokens",), (cfg.vocab_size, d), False)]
    for i in range(cfg.num_hidden_layers):
        pre, path = f"model.layers.{i}.", ("layers", i)
        linears = [("self_attn", "q_proj", q_out, d), ("self_attn", "k_proj", kv_out, d),
                   ("self_attn", "v_proj", kv_out, d), ("self_attn", "o_proj", d, q_out),
                   ("mlp", "gate_proj", inter, d), ("mlp", "up_proj", inter, d),
                   ("mlp", "down_proj", d, inter)]
        for sub, name, n_out, n_in in linears:
            out.append(_Tensor(f"{pre}{sub}.{name}.weight", (*path, sub, name, "kernel"),
                               (n_out, n_in), True))
            if cfg.attention_bias and sub == "self_attn":
                out.append(_Tensor(f"{pre}{sub}.{name}.bias", (*path, sub, name, "bias"),
                                   (n_out,), False))
        for norm, dim in (("input_layernorm", d), ("post_attention_layernorm", d),
                          ("self_attn.q_norm", hd), ("self_attn.k_norm", hd)):
            out.append(_Tensor(f"{pre}{norm}.weight", (*path, *norm.split("."), "weight"),
                               (dim,), False))
    out.append(_Tensor("model.norm.weight", ("norm", "weight"), (d,), False))
    if not cfg.tie_word_embeddings:
        out.append(_Tensor("lm_head.weight", ("lm_head",), (cfg.vocab_size, d), False))
    return out


# -- reading -------------------------------------------------------------------------------------
def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what} {path} is not valid JSON: {e}") from None


def load_config(path: str | Path) -> ModelConfig:
    """``config.json`` of an HF folder, with generation_config.json's EOS ids merged in."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model folder {path} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"no config.json in model folder {path}")
    try:
        config = ModelConfig.from_hf_dict(_read_json(cfg_file, "config"))
    except ConfigError as e:
        raise ConfigError(f"{cfg_file}: {e}") from None
    gen_eos = load_generation_config(path).get("eos_token_ids", ())
    eos = tuple(dict.fromkeys([*config.eos_token_ids, *gen_eos]))
    return dataclasses.replace(config, eos_token_ids=eos)


def load_generation_config(path: str | Path) -> dict[str, Any]:
    """``generation_config.json`` as a dict ({} when absent), with ``eos_token_ids`` always a
    tuple (HF writes one id or a list; Qwen3 lists two)."""
    gen_file = Path(path) / "generation_config.json"
    if not gen_file.is_file():
        return {}
    gen = _read_json(gen_file, "generation config")
    eos = gen.get("eos_token_id")
    gen["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (
        () if eos is None else (eos,))
    return gen


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, "weight index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard files missing from {path}: {missing}")
        return files
    single = path / WEIGHTS_FILE
    if single.is_file():
        return [single]
    raise CheckpointError(f"no weights in {path}: expected {WEIGHTS_FILE} or {INDEX_FILE} "
                          "(only safetensors checkpoints are supported)")


def _open_tensors(files: list[Path], stack: contextlib.ExitStack) -> dict[str, Any]:
    """Tensor name -> its safetensors slice (shape and dtype known, nothing read yet)."""
    from safetensors import SafetensorError, safe_open

    out = {}
    for f in files:
        # safetensors' own error names no file.
        try:
            sf = stack.enter_context(safe_open(str(f), framework="numpy"))
            for name in sf.keys():
                out[name] = sf.get_slice(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
    return out


def _place(spec: _Tensor, tensor, param_dtype, mesh) -> Any:
    """One checkpoint tensor in our layout and ``param_dtype``: whole on the default device, or,
    with ``mesh``, laid out by the partition rules with each device's block read alone from
    the file (no full copy on any host or device)."""
    if mesh is None:
        arr = tensor[...]
        return jnp.asarray(arr.T if spec.transpose else arr, dtype=param_dtype)
    import jax

    from sparrow_jax import sharding

    shape = spec.shape[::-1] if spec.transpose else spec.shape
    target = sharding.state_shardings({"/".join(map(str, spec.path)): jax.ShapeDtypeStruct(
        shape, param_dtype)}, mesh)
    target = next(iter(target.values()))

    def block(index):
        # index: our layout's slices; the file holds the transpose for linear kernels
        arr = tensor[index[::-1]].T if spec.transpose else tensor[index]
        return np.asarray(arr, dtype=param_dtype)

    return jax.make_array_from_callback(shape, target, block)


def load_qwen3(path: str | Path, dtype=jnp.float32, param_dtype=None, *,
               remat: bool = False, mesh=None) -> tuple[Qwen3, ModelConfig]:
    """Loads a Qwen3ForCausalLM HF folder -> ``(model, config)``.

    ``dtype`` is the compute dtype; parameters are stored in ``param_dtype`` (default float32
    masters, whatever the checkpoint's dtype; bfloat16 halves the memory of inference-only use).
    ``remat``: rematerialise each layer in the backward pass (training).
    ``mesh``: a ``jax.sharding.Mesh`` (see :func:`sparrow_jax.sharding.make_mesh`); every
    parameter is then created in its sharded layout (:data:`sparrow_jax.sharding.PARAM_RULES`),
    each device's block read straight from the files, as :func:`sparrow_jax.sharding.shard_model`
    would leave it.
    Every tensor the config implies must be present with its exact shape; tensors it does not
    imply are an error (a config that disagrees with its weights must not load quietly), except
    rotary ``inv_freq`` buffers and a tied ``lm_head.weight`` equal to the embedding.
    """
    path = Path(path)
    config = load_config(path)
    files = _weight_files(path)
    param_dtype = jnp.float32 if param_dtype is None else param_dtype
    expected = {t.hf_name: t for t in _tensor_map(config)}
    arrays: dict[tuple, Any] = {}
    with contextlib.ExitStack() as stack:
        tensors = _open_tensors(files, stack)
        extra = [name for name in tensors if name not in expected and not _IGNORABLE.search(name)
                 and not (name == "lm_head.weight" and config.tie_word_embeddings)]
        for name, tensor in tensors.items():
            spec = expected.get(name)
            if spec is not None and tuple(tensor.get_shape()) != spec.shape:
                raise CheckpointError(f"tensor {name} has shape {tuple(tensor.get_shape())}, "
                                      f"expected {spec.shape} from config.json")
        if extra:
            raise CheckpointError(f"checkpoint has tensors a Qwen3 model of this config does not "
                                  f"use: {sorted(extra)[:8]}{' ...' if len(extra) > 8 else ''}")
        missing = [name for name in expected if name not in tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"checkpoint lacks tensor {missing[0]}{more}")
        if (config.tie_word_embeddings and "lm_head.weight" in tensors
                and not np.array_equal(np.asarray(tensors["lm_head.weight"][...], np.float32),
                                       np.asarray(tensors["model.embed_tokens.weight"][...],
                                                  np.float32))):
            raise CheckpointError("tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight")
        for name, spec in expected.items():
            arrays[spec.path] = _place(spec, tensors[name], param_dtype, mesh)

    abstract = nnx.eval_shape(lambda: Qwen3(config, dtype=dtype, param_dtype=param_dtype,
                                            rngs=nnx.Rngs(0), remat=remat))
    graphdef, state = nnx.split(abstract)
    flat = [(p, v.replace(arrays[p]) if p in arrays else v)
            for p, v in nnx.to_flat_state(state)]
    unset = [p for p, v in flat if p not in arrays and isinstance(v, nnx.Param)]
    if unset:  # a model parameter the tensor map does not cover: a bug here, not in the file
        raise AssertionError(f"parameters not filled from the checkpoint: {unset}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), config


# -- writing -------------------------------------------------------------------------------------
def save_qwen3(model: Qwen3, path: str | Path, config: ModelConfig | None = None,
               tokenizer_dir: str | Path | None = None) -> None:
    """Writes ``model`` as an HF folder (config.json, model.safetensors in HF names and layouts,
    generation_config.json when the config has EOS ids) that :func:`load_qwen3` reads back
    exactly and transformers' ``Qwen3ForCausalLM.from_pretrained`` loads.

    Tensors keep the model's parameter dtype. LoRA adapters are not written (HF Qwen3 has none).
    ``tokenizer_dir``: a folder whose tokenizer files are copied alongside.
    """
    from safetensors.numpy import save_file

    config = model.config if config is None else config
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors = {}
    for spec in _tensor_map(config):
        if spec.path not in params:
            raise CheckpointError(f"model has no parameter {'/'.join(map(str, spec.path))} "
                                  f"for {spec.hf_name}: does config match the model?")
        arr = np.asarray(params[spec.path].get_value())
        arr = arr.T if spec.transpose else arr
        if arr.shape != spec.shape:
            raise CheckpointError(f"parameter for {spec.hf_name} has shape {arr.shape}, config "
                                  f"implies {spec.shape}")
        tensors[spec.hf_name] = np.ascontiguousarray(arr)
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    hf = config.to_hf_dict()
    hf["torch_dtype"] = str(next(iter(tensors.values())).dtype)
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if tokenizer_dir is not None:
        src = Path(tokenizer_dir)
        for name in TOKENIZER_FILES:
            if (src / name).is_file() and src.resolve() != path.resolve():
                shutil.copyfile(src / name, path / name)
    if config.eos_token_ids:
        gen = {"eos_token_id": list(config.eos_token_ids)}
        if config.bos_token_id is not None:
            gen["bos_token_id"] = config.bos_token_id
        (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
