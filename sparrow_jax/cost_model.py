"""Rollout cost model (docs/design.md, section 6): the paper's closed forms, and a per-step form.

Costs are in FLOP-equivalents: FLOPs plus ``I`` times the elements moved, where ``I = peak FLOP/s
x bytes per element / memory bandwidth``. Symbols as in the paper: P parameters, N samples, L_in
prompt and L_out response tokens, D KV elements per token for K (layers x KV heads x head_dim), r
the GQA ratio, B the KV budget in tokens, ps the page size. The paper counts ``2 r D`` FLOPs per
context token per step for attention and ``2 P`` per token for the weights; the per-step form keeps
those conventions so that the two agree where they model the same thing.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def rollout_cost_dense(P, N, L_in, L_out, D, r, I):
    """The paper's dense rollout cost, as written:
    ``C_comp + I C_mem`` with ``C_comp = 2 P N L_out + r (2 L_in + L_out) L_out N D`` and
    ``C_mem = 2 L_in L_out D + N L_out^2 D`` (the prompt's KV read once per step for all N)."""
    c_comp = 2 * P * N * L_out + r * (2 * L_in + L_out) * L_out * N * D
    c_mem = 2 * L_in * L_out * D + N * L_out ** 2 * D
    return c_comp + I * c_mem


def rollout_cost_sparse(P, N, L_in, L_out, D, r, I, B, page_size=16):
    """The paper's sparse rollout cost, as written: ``C_no_score + C_scoring`` with
    ``C_no_score = 2 N P L_out + 2 r N D B L_out + 2 I N D B L_out`` and
    ``C_scoring = 2 N L_in D L_out + r N D L_out^2 / (2 ps) + 2 I L_in D L_out
    + I N D L_out^2 / (2 ps)``."""
    ps = page_size
    no_score = 2 * N * P * L_out + 2 * r * N * D * B * L_out + 2 * I * N * D * B * L_out
    scoring = (2 * N * L_in * D * L_out + r * N * D * L_out ** 2 / (2 * ps)
               + 2 * I * L_in * D * L_out + I * N * D * L_out ** 2 / (2 * ps))
    return no_score + scoring


@dataclasses.dataclass(frozen=True)
class DecodeCost:
    """Cost of decode steps, counting what the closed forms omit: weight reads and dense layers.

    Per step of a batch: weights ``2 P`` FLOPs per sequence and ``P`` elements read once (when
    ``count_weights``). Per sequence of ``c`` tokens (current one included) and layer with
    ``d = kv_heads x head_dim``: a dense layer ``2 r d c`` FLOPs and ``2 d c`` elements (K and V);
    a sparse layer with ``n = ceil(c / ps)`` pages over its budget of ``b`` pages attends to
    ``min(b ps, c)`` tokens (same terms) and scores its ``n - 3`` candidate pages, ``r d`` FLOPs and
    ``summary_vectors x d`` elements each (1 for centroids, 2 for Quest's min/max); at or under
    budget it is a dense layer. Each sequence reads its own pages (no prompt sharing).
    """

    params: float
    num_layers: int
    kv_elements_per_layer: int
    gqa_ratio: int
    intensity: float
    num_dense_layers: int = 2
    page_size: int = 16
    summary_vectors: int = 1
    count_weights: bool = True

    def __post_init__(self):
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError(f"num_dense_layers must be in [0, num_layers={self.num_layers}], "
                             f"got {self.num_dense_layers}")
        for name in ("num_layers", "kv_elements_per_layer", "gqa_ratio", "page_size",
                     "summary_vectors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_model_config(cls, config, intensity: float, *, dense_layers=(0, 1), **kwargs):
        """From a :class:`~sparrow_jax.config.ModelConfig` (its parameter count and KV shape)."""
        return cls(params=config.num_params(), num_layers=config.num_hidden_layers,
                   kv_elements_per_layer=config.num_key_value_heads * config.head_dim,
                   gqa_ratio=config.group_size, intensity=intensity,
                   num_dense_layers=len(set(dense_layers)), **kwargs)

    def attention_cost(self, lengths, budget_pages=None) -> np.ndarray:
        """Attention cost of one step per sequence: lengths ``[...]``, budget_pages ``[...]``
        (None: dense) -> ``[...]`` float64."""
        c = np.asarray(lengths, np.float64)
        d, r, ps, i = self.kv_elements_per_layer, self.gqa_ratio, self.page_size, self.intensity
        dense = (2 * r * d + i * 2 * d) * c
        if budget_pages is None:
            return self.num_layers * dense
        n = np.ceil(c / ps)
        b = np.asarray(budget_pages, np.float64)
        tokens = np.minimum(b * ps, c)
        candidates = np.maximum(n - 3, 0)
        sparse = ((2 * r * d + i * 2 * d) * tokens
                  + (r * d + i * self.summary_vectors * d) * candidates)
        sparse = np.where(n <= b, dense, sparse)
        return self.num_dense_layers * dense + (self.num_layers - self.num_dense_layers) * sparse

    def weight_cost(self, batch: int) -> float:
        """Weight FLOPs of one step for ``batch`` sequences, plus one read of the weights."""
        return 2 * self.params * batch + (self.intensity * self.params if self.count_weights
                                          else 0.0)

    def step_cost(self, lengths, budget_pages=None) -> float:
        """One decode step of a batch: lengths ``[N]``, budget_pages ``[N]`` or None."""
        lengths = np.atleast_1d(lengths)
        return float(self.weight_cost(lengths.size)
                     + np.sum(self.attention_cost(lengths, budget_pages)))

    def rollout_cost(self, prompt_len: int, gen_len: int, num_seqs: int = 1,
                     schedule=None) -> float:
        """Sum over the ``gen_len`` decode steps (lengths ``prompt_len + 1 .. prompt_len +
        gen_len``) of ``num_seqs`` sequences in lockstep, at the budgets of ``schedule`` (any
        object with ``budget_pages(lengths)``, e.g. a BudgetSchedule; None: dense)."""
        lengths = np.arange(prompt_len + 1, prompt_len + gen_len + 1)
        budgets = None if schedule is None else np.asarray(schedule.budget_pages(lengths))
        per_seq = np.sum(self.attention_cost(lengths, budgets))
        return float(gen_len * self.weight_cost(num_seqs) + num_seqs * per_seq)
