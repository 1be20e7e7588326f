"""Qwen3 decoder in Flax NNX.

One forward serves every use: the attention itself is a function handed in by the caller
(:data:`AttendFn`), so the dense training forward, prefill into a paged cache, the sparse decode
step and teacher-forced sparse attention all run the same projections, norms and RoPE.

Precision (docs/design.md, section 1): parameters live in ``param_dtype`` (float32 masters),
matmuls run in the compute ``dtype`` (bfloat16 on accelerators), norms, softmax and log-softmax
in float32.

Under a device mesh (``jax.set_mesh``) the residual stream, the heads and the MLP width are
pinned to :data:`sparrow_jax.sharding.ACTIVATION_RULES`; without one those pins do nothing.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from sparrow_jax.attention.dense import causal_attend
from sparrow_jax.attention.selection import SAVED_NAME
from sparrow_jax.config import ModelConfig
from sparrow_jax.models.decode_kernels import (gate_up_silu, kernels_apply, project_add_norm,
                                               qkv_partials)
from sparrow_jax.models.lora import Linear
from sparrow_jax.models.qk_prep import QKPrep, rms_norm
from sparrow_jax.models.rope import rope_angles
from sparrow_jax.sharding import constrain

# Remat keeps only the page selections attention functions mark (none in dense runs).
REMAT_POLICY = jax.checkpoint_policies.save_only_these_names(SAVED_NAME)

# attend(layer, q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D], state) -> (out [B,T,Hq,D], state).
# q and k arrive after q/k-norm and RoPE; ``state`` is whatever the caller threads through the
# layers (a paged cache, selection statistics), or None. Under ``forward(..., decode_kernels=...)``
# they arrive as projected, and attend takes a keyword ``prep``: the QKPrep to apply to them.
AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        d, hd = cfg.hidden_size, cfg.head_dim
        lin = dict(use_bias=cfg.attention_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = Linear(d, cfg.num_attention_heads * hd, **lin)
        self.k_proj = Linear(d, cfg.num_key_value_heads * hd, **lin)
        self.v_proj = Linear(d, cfg.num_key_value_heads * hd, **lin)
        self.o_proj = Linear(cfg.num_attention_heads * hd, d, **lin)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.head_dim = hd

    def heads(self, x, cos, sin, layer: int, attend: AttendFn, state, lora: bool,
              decode_kernels: str | None = None):
        """x ``[B, T, hidden]`` (normed) -> (the heads' attention ``[B, T, Hq * D]`` in x's
        dtype, before the O projection; state)."""
        b, t, _ = x.shape
        parts = None if decode_kernels is None else qkv_partials(
            x.reshape(b * t, -1), (self.q_proj, self.k_proj, self.v_proj), lora=lora,
            impl=decode_kernels)
        if parts is None:
            q, k, v = (self.q_proj(x, lora=lora), self.k_proj(x, lora=lora),
                       self.v_proj(x, lora=lora))
        else:       # the sums XLA computes only for an attend that reads them
            nq, nk = self.q_proj.kernel.shape[1], self.k_proj.kernel.shape[1]
            q, k, v = jnp.split(jnp.sum(parts[:, :b * t], axis=0).astype(self.q_proj.dtype),
                                [nq, nq + nk], axis=-1)
        # -1 heads: under a tensor split (forward's ``tensor_axis``) this shard's heads.
        q = constrain(q.reshape(b, t, -1, self.head_dim), "BTHK")
        k = constrain(k.reshape(b, t, -1, self.head_dim), "BTHK")
        v = constrain(v.reshape(b, t, -1, self.head_dim), "BTHK")
        prep = QKPrep(self.q_norm.weight[...], self.k_norm.weight[...], cos, sin,
                      eps=self.q_norm.eps, partials=parts)
        if decode_kernels is not None:
            out, state = attend(layer, q, k, v, state, prep=prep)
        else:
            out, state = attend(layer, *prep(q, k), v, state)
        return out.astype(x.dtype).reshape(b, t, -1), state

    def __call__(self, x, cos, sin, layer: int, attend: AttendFn, state, lora: bool,
                 decode_kernels: str | None = None, tensor_axis: str | None = None):
        out, state = self.heads(x, cos, sin, layer, attend, state, lora, decode_kernels)
        return self.o_proj(out, lora=lora, sum_over=tensor_axis), state


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        lin = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, **lin)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, **lin)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, **lin)

    def activation(self, x, lora: bool, decode_kernels: str) -> jax.Array:
        """The decode form's ``silu(gate(x)) * up(x)`` for x ``[M, hidden]``: ``[R >= M, F]``
        (the gate-up kernel pads rows; the caller drops them after the down projection)."""
        g, u = self.gate_proj, self.up_proj
        act = gate_up_silu(x, g, u, lora=lora, impl=decode_kernels)
        if act is not None:
            return act
        return jax.nn.silu(g(x, lora=lora)) * u(x, lora=lora)

    def __call__(self, x, lora: bool, tensor_axis: str | None = None):
        gate = jax.nn.silu(self.gate_proj(x, lora=lora))
        return self.down_proj(constrain(gate * self.up_proj(x, lora=lora), "BTF"), lora=lora,
                              sum_over=tensor_axis)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                param_dtype=param_dtype)
        self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, cos, sin, layer, attend, state, lora, decode_kernels=None,
                 tensor_axis=None):
        h, state = self.self_attn(self.input_layernorm(x), cos, sin, layer, attend, state, lora,
                                  decode_kernels, tensor_axis)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x), lora, tensor_axis)
        return x, state

    def decode(self, x, normed, cos, sin, layer, attend, state, lora, decode_kernels,
               next_norm: RMSNorm, tensor_axis: str | None = None):
        """The decode form: x ``[M, hidden]`` (the residual stream, M = B * T) and ``normed``
        (this block's input norm of it, which the block before computed) -> (x after the
        block, ``next_norm`` of it, state). Each projection into the residual stream ends in
        the add and the norm that follows it: two kernels where
        :func:`~sparrow_jax.models.decode_kernels.project_add_norm` takes them."""
        b, t = cos.shape[:2]
        h, state = self.self_attn.heads(normed.reshape(b, t, -1), cos, sin, layer, attend,
                                        state, lora, decode_kernels)
        post = self.post_attention_layernorm
        x, normed = project_add_norm(self.self_attn.o_proj, h.reshape(b * t, -1), x,
                                     post.weight[...], post.eps, lora=lora, impl=decode_kernels,
                                     sum_over=tensor_axis)
        act = self.mlp.activation(normed, lora, decode_kernels)
        x, normed = project_add_norm(self.mlp.down_proj, act, x, next_norm.weight[...],
                                     next_norm.eps, lora=lora, impl=decode_kernels,
                                     sum_over=tensor_axis)
        return x, normed, state


class Qwen3(nnx.Module):
    """Qwen3ForCausalLM. ``model(tokens) -> logits [B, T, V]`` (dense, causal, float32).

    For long sequences use :meth:`forward` for hidden states and :mod:`sparrow_jax.models.lm_head`
    for chunked log-probs / top-k: full logits cost ``B*T*V*4`` bytes.
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs, remat: bool = False):
        self.config = config
        self.dtype = dtype
        self.remat = remat
        init = jax.nn.initializers.normal(stddev=0.02)
        self.embed_tokens = nnx.Param(
            init(rngs.params(), (config.vocab_size, config.hidden_size), param_dtype))
        self.layers = nnx.List([Block(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = None if config.tie_word_embeddings else nnx.Param(
            init(rngs.params(), (config.vocab_size, config.hidden_size), param_dtype))

    def head_weight(self) -> jax.Array:
        """The LM head as ``[vocab, hidden]`` (the embedding when tied), in the compute dtype."""
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        return w[...].astype(self.dtype)

    def embed(self, tokens: jax.Array, tensor_axis: str | None = None) -> jax.Array:
        """tokens ``[...]`` -> embeddings ``[..., hidden]`` in the compute dtype. Under a
        ``tensor_axis`` whose shards hold contiguous blocks of the vocabulary's rows, each shard
        looks up the tokens in its block and the shards' results are summed (one is nonzero)."""
        table = self.embed_tokens[...]
        rows = table.shape[0]
        if tensor_axis is None or rows == self.config.vocab_size:
            return jnp.take(table, tokens, axis=0).astype(self.dtype)
        local = tokens - jax.lax.axis_index(tensor_axis) * rows
        mine = (local >= 0) & (local < rows)
        x = jnp.take(table, jnp.where(mine, local, 0), axis=0).astype(self.dtype)
        return jax.lax.psum(jnp.where(mine[..., None], x, 0), tensor_axis)

    def logits(self, hidden: jax.Array, tensor_axis: str | None = None) -> jax.Array:
        """hidden ``[..., hidden]`` -> float32 logits ``[..., vocab]``; under a ``tensor_axis``
        that splits the head's vocabulary rows, each shard's block gathered in order."""
        head = self.head_weight()
        out = logits_from_hidden(hidden, head)
        if tensor_axis is None or head.shape[0] == self.config.vocab_size:
            return out
        return jax.lax.all_gather(out, tensor_axis, axis=out.ndim - 1, tiled=True)

    def forward(self, tokens: jax.Array, positions: jax.Array | None = None, *,
                attend: AttendFn = causal_attend, state: Any = None, lora: bool = False,
                embeddings: jax.Array | None = None, decode_kernels: str | None = None,
                tensor_axis: str | None = None) -> tuple[jax.Array, Any]:
        """tokens ``[B, T]`` int, positions ``[B, T]`` (default ``arange(T)``) ->
        (final-normed hidden ``[B, T, hidden]`` in the compute dtype, attention state).

        ``decode_kernels``: the decode step's form ("auto", "pallas" or "xla"; None: the
        general one): ``attend`` applies q/k-norm and RoPE itself (see :data:`AttendFn`), and
        where :func:`sparrow_jax.models.decode_kernels.kernels_apply` says kernels may run,
        the layers run as :meth:`Block.decode` (no remat: the decode form is for inference).

        ``tensor_axis``: inside ``shard_map``, the mesh axis the weights are split over in the
        rollout's layout (:func:`sparrow_jax.sharding.rollout_specs`): each shard holds its
        block of the heads, of the MLP width and of the vocabulary, computes its heads (the
        attend receives those) and its part of the MLP, and the row-parallel O and down
        projections sum over the axis; the residual stream is whole on every shard."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                         tokens.shape)
        x = constrain(self.embed(tokens, tensor_axis) if embeddings is None else embeddings,
                      "BTD")
        cos, sin = rope_angles(positions, self.config.head_dim, self.config.rope_theta)
        if decode_kernels is not None and kernels_apply(decode_kernels):
            return self._decode_layers(x, cos, sin, attend, state, lora, decode_kernels,
                                       tensor_axis)
        for i, block in enumerate(self.layers):
            if self.remat:
                x, state = nnx.remat(Block.__call__, static_argnums=(4, 5, 7, 8, 9),
                                     policy=REMAT_POLICY)(
                    block, x, cos, sin, i, attend, state, lora, decode_kernels, tensor_axis)
            else:
                x, state = block(x, cos, sin, i, attend, state, lora, decode_kernels, tensor_axis)
            x = constrain(x, "BTD")
        return self.norm(x), state

    def _decode_layers(self, x, cos, sin, attend, state, lora, decode_kernels, tensor_axis):
        """The layers in their decode form: each block hands the next one its input norm (the
        last one the final norm)."""
        b, t, d = x.shape
        x = x.reshape(b * t, d)
        normed = self.layers[0].input_layernorm(x)
        norms = [block.input_layernorm for block in self.layers[1:]] + [self.norm]
        for i, (block, next_norm) in enumerate(zip(self.layers, norms)):
            x, normed, state = block.decode(x, normed, cos, sin, i, attend, state, lora,
                                            decode_kernels, next_norm, tensor_axis)
        return normed.reshape(b, t, d), state

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *,
                 lora: bool = False) -> jax.Array:
        hidden, _ = self.forward(tokens, positions, lora=lora)
        return logits_from_hidden(hidden, self.head_weight())


def logits_from_hidden(hidden: jax.Array, head_weight: jax.Array) -> jax.Array:
    """``[..., hidden] x [vocab, hidden] -> [..., vocab]`` in float32."""
    return jnp.einsum("...d,vd->...v", hidden.astype(head_weight.dtype), head_weight,
                      preferred_element_type=jnp.float32)


def check_tokens(tokens, vocab_size: int) -> None:
    """Host-side check, for inputs that come from users: out-of-range ids would be silently
    clamped by the embedding gather."""
    import numpy as np

    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = arr[(arr < 0) | (arr >= vocab_size)]
        raise ValueError(f"token ids out of range [0, {vocab_size}): e.g. {bad[:5].tolist()}")


def init_model(config: ModelConfig, *, seed: int = 0, dtype=jnp.float32,
               param_dtype=jnp.float32, remat: bool = False) -> Qwen3:
    """A randomly initialised model (tests, benchmarks, the tiny demo preset)."""
    return Qwen3(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(seed), remat=remat)
