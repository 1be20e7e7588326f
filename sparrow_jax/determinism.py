"""Bit-exact training steps on a GPU: the gradient programs' scatter-adds in a fixed order.

The embedding's gradient is a scatter-add of the tokens' rows. On a GPU, XLA emits it with
atomic adds unless told otherwise, so the rows of a repeated token sum in whatever order the
threads reach them: a rerun, or a resumed run, then differs from the first in the last bits of
a few weights (H100, float32: 26 of 3072 embedding entries 1-2 units in the last place apart,
and the next step's metrics with them). XLA's scatter determinism expander rewrites such
scatters into a sorted, deterministic form. It is asked for per compiled program, on the jits
that take gradients, so a notebook gets it without setting ``XLA_FLAGS`` before JAX starts,
and the rollouts, whose scatters write distinct places, keep XLA's defaults (H100, 8K: the
flag set for the whole process cost the update 5-7% and the rollout up to 1 s a step of 19).
Other backends ignore the option.

The expander returns wrong sums for a scatter that the partitioner split over devices along the
scattered axis (two H100s, jax 0.11.2: the log-prob gathers' gradient over a vocabulary split
over ``tensor`` off by 0.02-7), so gradients over a split axis are built without scatters
(:func:`sparrow_jax.models.lm_head.take_vocab`); the embedding's, over rows of the split
vocabulary, measured right.
"""

from __future__ import annotations

DETERMINISTIC_SCATTER = {"xla_gpu_enable_scatter_determinism_expander": True}
"""``compiler_options`` of the jits that compute gradients (``jax.jit(...,
compiler_options=DETERMINISTIC_SCATTER)``)."""

__all__ = ["DETERMINISTIC_SCATTER"]
