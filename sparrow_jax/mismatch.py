"""Mismatch between the dense policy p and the sparse actor q (docs/design.md, section 5).

The per-token acceptance rate ``alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q)``, three ways:

- ``exact``: both full distributions (:func:`acceptance_rate`).
- ``topk_bound``: over q's top-k ids, with p's full-vocabulary probabilities there
  (:func:`acceptance_rate_topk_bound`); a lower bound of ``exact``.
- ``paper``: over the intersection of p's and q's top-k sets (:func:`acceptance_rate_paper`), as
  the reference code computes it; a lower bound of ``topk_bound`` for the same k.

The stability statistic is the 5th percentile of alpha per length bin (:func:`tail_statistic`);
:func:`fit_scaled_beta` smooths a bin's tail when it holds few tokens.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

ESTIMATORS = ("exact", "topk_bound", "paper")


def acceptance_rate(logits_p: jax.Array, logits_q: jax.Array,
                    temperature: float = 1.0) -> jax.Array:
    """logits_p, logits_q ``[..., V]`` -> alpha ``[...]`` float32 (the ``exact`` estimator).

    Both distributions are ``softmax(logits / temperature)`` over the full vocabulary,
    untruncated, normalised in float32 through log-softmax.
    """
    if logits_p.shape != logits_q.shape:
        raise ValueError(f"logits_p {logits_p.shape} and logits_q {logits_q.shape} differ")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    lp = jax.nn.log_softmax(logits_p.astype(jnp.float32) / temperature, axis=-1)
    lq = jax.nn.log_softmax(logits_q.astype(jnp.float32) / temperature, axis=-1)
    return jnp.sum(jnp.exp(jnp.minimum(lp, lq)), axis=-1)


def acceptance_rate_topk_bound(p_logprobs_at_q_topk: jax.Array,
                               q_topk_logprobs: jax.Array) -> jax.Array:
    """The ``topk_bound`` estimator: ``sum over q's top-k x of min(p(x), q(x))``.

    p_logprobs_at_q_topk ``[..., k]``: the dense policy's full-vocabulary log-probs at the ids
    of q's top-k; q_topk_logprobs ``[..., k]``: q's log-probs there -> ``[...]`` float32.
    """
    if p_logprobs_at_q_topk.shape != q_topk_logprobs.shape:
        raise ValueError(f"shapes differ: {p_logprobs_at_q_topk.shape} vs "
                         f"{q_topk_logprobs.shape}")
    low = jnp.minimum(p_logprobs_at_q_topk.astype(jnp.float32),
                      q_topk_logprobs.astype(jnp.float32))
    return jnp.sum(jnp.exp(low), axis=-1)


def acceptance_rate_paper(p_top_ids: jax.Array, p_top_logprobs: jax.Array,
                          q_top_ids: jax.Array, q_top_logprobs: jax.Array) -> jax.Array:
    """The ``paper`` estimator: ``sum over x in topk(p) & topk(q) of min(p(x), q(x))``.

    ids ``[..., k]`` int (distinct within a row), log-probs ``[..., k]`` (full-vocabulary
    normalised); p and q may store different k -> ``[...]`` float32.
    """
    if p_top_ids.shape != p_top_logprobs.shape or q_top_ids.shape != q_top_logprobs.shape:
        raise ValueError("each top-k id array must match its log-prob array: "
                         f"{p_top_ids.shape}/{p_top_logprobs.shape}, "
                         f"{q_top_ids.shape}/{q_top_logprobs.shape}")
    match = q_top_ids[..., :, None] == p_top_ids[..., None, :]          # [..., kq, kp]
    p_at_q = jnp.sum(jnp.where(match, jnp.exp(p_top_logprobs.astype(jnp.float32))[..., None, :],
                               0.0), axis=-1)
    shared = jnp.any(match, axis=-1)
    q = jnp.exp(q_top_logprobs.astype(jnp.float32))
    return jnp.sum(jnp.where(shared, jnp.minimum(p_at_q, q), 0.0), axis=-1)


def tail_statistic(alpha: jax.Array, positions: jax.Array, bin_tokens: int = 2000,
                   quantile: float = 0.05, mask: jax.Array | None = None, num_bins: int = 20,
                   min_count: int = 100) -> jax.Array:
    """Per length bin, the ``quantile`` of alpha over the valid tokens in it -> ``[num_bins]``.

    alpha ``[...]``; positions ``[...]`` int, each token's step ``lengths`` (docs/design.md,
    section 2); mask ``[...]`` bool, the tokens that count (response tokens, not padding). Bin
    ``i = min(positions // bin_tokens, num_bins - 1)``; quantiles interpolate linearly as NumPy's
    default ``percentile``; NaN where a bin holds fewer than ``min_count`` tokens. Pure JAX and
    jittable (one sort of all tokens keyed by bin, then a gather per bin).
    """
    if alpha.shape != positions.shape or (mask is not None and mask.shape != alpha.shape):
        raise ValueError(f"alpha {alpha.shape}, positions {positions.shape} and mask "
                         f"{None if mask is None else mask.shape} must have one shape")
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {quantile}")
    if bin_tokens < 1 or num_bins < 1 or min_count < 1:
        raise ValueError("bin_tokens, num_bins and min_count must be positive, got "
                         f"{bin_tokens}, {num_bins}, {min_count}")
    a = alpha.reshape(-1).astype(jnp.float32)
    bins = jnp.minimum(positions.reshape(-1) // bin_tokens, num_bins - 1).astype(jnp.int32)
    if mask is not None:
        bins = jnp.where(mask.reshape(-1), bins, num_bins)  # invalid tokens sort last
    bins, a = jax.lax.sort((bins, a), num_keys=2)
    counts = jnp.bincount(bins, length=num_bins + 1)[:num_bins]
    starts = jnp.cumsum(counts) - counts
    # NumPy's "linear" method: virtual index h = q (n - 1), lerp between its neighbours, with
    # NumPy's two-sided lerp form so that results agree to the last bit where they can.
    h = quantile * (counts - 1).astype(jnp.float32)
    lo = jnp.floor(h)
    frac = h - lo
    lo = lo.astype(jnp.int32)
    hi = jnp.minimum(lo + 1, counts - 1)
    last = a.shape[0] - 1
    below = a[jnp.clip(starts + lo, 0, last)]
    above = a[jnp.clip(starts + hi, 0, last)]
    diff = above - below
    value = jnp.where(frac >= 0.5, above - diff * (1 - frac), below + diff * frac)
    return jnp.where(counts >= min_count, value, jnp.nan)


@dataclasses.dataclass(frozen=True)
class BetaFit:
    """A Beta(a, b) fitted to ``alpha / scale`` (alpha <= cutoff), with its goodness of fit.

    ks: the Kolmogorov-Smirnov statistic of the fitted CDF against the fitted sample; count: the
    sample size; dropped: how many alpha > cutoff were left out.
    """

    a: float
    b: float
    scale: float
    ks: float
    count: int
    dropped: int

    def cdf(self, alpha) -> np.ndarray:
        """P(alpha' <= alpha) under the fit (of the sample below the cutoff)."""
        x = np.clip(np.asarray(alpha, np.float64) / self.scale, 0.0, 1.0)
        return np.vectorize(lambda t: _betainc(self.a, self.b, t))(x)

    def quantile(self, q: float) -> float:
        """The fitted q-quantile of alpha (bisection on the CDF; 60 halvings reach 1e-18)."""
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if _betainc(self.a, self.b, mid) < q:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi) * self.scale


def fit_scaled_beta(alpha, mask=None, cutoff: float = 0.999) -> BetaFit:
    """Method-of-moments Beta fit of the acceptance rates below ``cutoff`` (host NumPy).

    Rates above the cutoff are dropped (their mass piles at 1, where no Beta fits), the rest are
    rescaled from ``[0, cutoff]`` to ``[0, 1]``. Needs at least 2 distinct values.
    """
    x = np.asarray(alpha, np.float64).ravel()
    if mask is not None:
        x = x[np.asarray(mask, bool).ravel()]
    if not 0.0 < cutoff <= 1.0:
        raise ValueError(f"cutoff must be in (0, 1], got {cutoff}")
    kept = x[x <= cutoff]
    dropped = x.size - kept.size
    if kept.size < 2 or np.ptp(kept) == 0:
        raise ValueError(f"a Beta fit needs at least 2 distinct values <= {cutoff}; got "
                         f"{kept.size} values")
    if kept.min() < 0:
        raise ValueError(f"acceptance rates must be >= 0, got {kept.min()}")
    u = kept / cutoff
    mean, var = u.mean(), u.var()
    common = mean * (1 - mean) / var - 1
    a, b = mean * common, (1 - mean) * common
    u = np.sort(u)
    f = np.array([_betainc(a, b, t) for t in u])
    n = u.size
    ks = max(np.max(np.arange(1, n + 1) / n - f), np.max(f - np.arange(n) / n))
    return BetaFit(a=float(a), b=float(b), scale=cutoff, ks=float(ks), count=int(n),
                   dropped=int(dropped))


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), by its continued fraction (modified
    Lentz), using the symmetry I_x(a, b) = 1 - I_{1-x}(b, a) where the fraction converges slowly."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    frac = d
    for m in range(1, 10_000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            frac *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return math.exp(log_front) * frac / a
