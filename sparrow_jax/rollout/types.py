"""What a rollout hands the trainer."""

from __future__ import annotations

import enum

import jax
from flax import struct


class FinishReason(enum.IntEnum):
    EOS = 0
    STOP_SEQUENCE = 1
    LENGTH = 2


@struct.dataclass
class Rollout:
    """One batch of sampled responses; the n samples of a prompt are adjacent rows.

    Shapes: S sequences, T = prompt + response capacity, R = response capacity, k = top-k kept.
    Response position j of row b sits at ``tokens[b, prompt_lengths[b] + j]``; rows are right
    padded (no left padding: docs/design.md, section 1).
    """

    tokens: jax.Array            # [S, T] int32, prompt then response, right padded
    prompt_lengths: jax.Array    # [S] int32
    response_lengths: jax.Array  # [S] int32 (EOS / stop tokens included)
    logprobs: jax.Array          # [S, R] float32: sparse actor's log-prob of each sampled token
    topk_ids: jax.Array          # [S, R, k] int32: sparse actor's top-k ids at each step
    topk_logprobs: jax.Array     # [S, R, k] float32
    budget_pages: jax.Array      # [S, R] int32: the step's page budget, reserved pages
    # included (0: dense by construction: the prefill token, or no schedule); the step ran sparse
    # where ceil(length / P) > budget
    finish_reason: jax.Array     # [S] int32 (FinishReason)
    prompt_index: jax.Array      # [S] int32: which prompt of the batch each row samples

    @property
    def response_mask(self) -> jax.Array:
        """[S, R] bool: True on real response tokens."""
        r = self.logprobs.shape[1]
        return jax.numpy.arange(r)[None, :] < self.response_lengths[:, None]
