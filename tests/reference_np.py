"""Float64 NumPy references of docs/design.md, sections 3-6, written from the text, independently
of the JAX code.

Deliberately plain: Python loops over sequences, heads and pages, explicit sorts, no
vectorisation tricks, so that a reader can check each line against docs/design.md. Kernel tests of
other modules may reuse these.
"""

from __future__ import annotations

import math

import numpy as np


def select_pages_np(scores: np.ndarray, n: int, budget: int) -> list[int]:
    """Pages (sorted) one query attends to. scores ``[>= n]`` indexed by page slot."""
    if n <= budget:
        return list(range(n))
    candidates = list(range(1, n - 2))
    # Highest score first; on equal scores the lower page index first.
    ranked = sorted(candidates, key=lambda j: (-float(scores[j]), j))
    chosen = ranked[: budget - 3]
    return sorted([0] + chosen + [n - 2, n - 1])


def centroid_score_np(q_heads: np.ndarray, keys: np.ndarray) -> float:
    """q_heads ``[r, D]`` of one group, keys ``[P, D]`` of one full page -> qbar . mean(keys)."""
    qbar = q_heads.astype(np.float64).mean(axis=0)
    return float(qbar @ keys.astype(np.float64).mean(axis=0))


def quest_score_np(q_heads: np.ndarray, keys: np.ndarray) -> float:
    """max over heads of sum_d max(q_d * kmax_d, q_d * kmin_d)."""
    keys = keys.astype(np.float64)
    kmin, kmax = keys.min(axis=0), keys.max(axis=0)
    best = -math.inf
    for qh in q_heads.astype(np.float64):
        best = max(best, float(np.sum(np.maximum(qh * kmax, qh * kmin))))
    return best


def attend_np(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Exact softmax attention of one query ``[D]`` over ``keys/values [T, D]``, scale D**-0.5."""
    q, keys, values = (x.astype(np.float64) for x in (q, keys, values))
    logits = keys @ q / math.sqrt(q.shape[-1])
    w = np.exp(logits - logits.max())
    return (w / w.sum()) @ values


def sparse_decode_np(q, k_pages, v_pages, page_table, lengths, budget_pages, *, page_size=16,
                     scorer="centroid", centroids=None, return_pages=False):
    """q ``[B, Hq, D]``, k/v_pages ``[Hkv, N, P, D]``, page_table ``[B, M]``, lengths ``[B]``,
    budget_pages ``[B]`` -> ``[B, Hq, D]`` float64 (and the chosen pages per (b, h) if asked).

    ``centroids [Hkv, N, D]``: the centroid scorer's page means as a cache stores them (rounded
    to its dtype); by default the exact means of the keys."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    bsz, hq, d = q.shape
    hkv = k_pages.shape[0]
    r = hq // hkv
    out = np.zeros((bsz, hq, d))
    pages_used = {}
    for b in range(bsz):
        length = int(lengths[b])
        n = -(-length // page_size)
        for h in range(hkv):
            group = q[b, h * r:(h + 1) * r]
            scores = np.full(n, -np.inf)
            for j in range(1, n - 2):  # only full pages are ever scored
                keys = k_pages[h, page_table[b, j]]
                if scorer == "quest":
                    scores[j] = quest_score_np(group, keys)
                elif centroids is None:
                    scores[j] = centroid_score_np(group, keys)
                else:
                    stored = np.asarray(centroids[h, page_table[b, j]], np.float64)
                    scores[j] = float(group.mean(axis=0) @ stored)
            pages = select_pages_np(scores, n, int(budget_pages[b]))
            pages_used[b, h] = pages
            ks, vs = [], []
            for j in pages:
                count = min(page_size, length - j * page_size)
                ks.append(k_pages[h, page_table[b, j], :count])
                vs.append(v_pages[h, page_table[b, j], :count])
            ks, vs = np.concatenate(ks), np.concatenate(vs)
            for i in range(r):
                out[b, h * r + i] = attend_np(group[i], ks, vs)
    return (out, pages_used) if return_pages else out


def teacher_forced_case(rng, *, b=2, t=37, hkv=2, r=2, d=8, page_size=4, dtype=np.float32):
    """Random q ``[b, t, hkv*r, d]``, k/v ``[b, t, hkv, d]`` and budgets ``[b, t]`` in 3..6 for
    teacher-forced attention. Per-page offsets give pages distinct centroids, so selections
    differ between positions."""
    q = rng.standard_normal((b, t, hkv * r, d))
    topics = np.repeat(rng.standard_normal((b, -(-t // page_size), hkv, d)), page_size,
                       axis=1)[:, :t]
    k = rng.standard_normal((b, t, hkv, d)) + 2 * topics
    v = rng.standard_normal((b, t, hkv, d))
    budgets = rng.integers(3, 7, size=(b, t)).astype(np.int32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), budgets


def teacher_forced_np(q, k, v, budget_pages, prompt_lengths, *, page_size=16, scorer="centroid"):
    """One attention layer run token by token as the decode step would: q ``[B, T, Hq, D]``,
    k/v ``[B, T, Hkv, D]``, budget_pages ``[B, T]``, prompt_lengths ``[B]`` -> ``[B, T, Hq, D]``.

    Position i sees its causal prefix (lengths = i + 1) through its own page selection, densely
    while i is a prompt position."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    bsz, t, hq, d = q.shape
    hkv = k.shape[2]
    out = np.zeros_like(q)
    for b in range(bsz):
        for i in range(t):
            length = i + 1
            m = -(-length // page_size)
            # A contiguous cache: page j holds tokens j*P .. j*P+P-1 (zero padded).
            kp = np.zeros((hkv, m, page_size, d))
            vp = np.zeros((hkv, m, page_size, d))
            for tok in range(length):
                kp[:, tok // page_size, tok % page_size] = k[b, tok]
                vp[:, tok // page_size, tok % page_size] = v[b, tok]
            budget = m if i < prompt_lengths[b] else int(budget_pages[b, i])
            out[b, i] = sparse_decode_np(q[b, i][None], kp, vp, np.arange(m)[None], [length],
                                         [budget], page_size=page_size, scorer=scorer)[0]
    return out


# --- mismatch (docs/design.md, section 5) ---

def softmax_np(logits, temperature=1.0):
    z = np.asarray(logits, np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def alpha_exact_np(p, q):
    return np.minimum(p, q).sum(axis=-1)


def alpha_topk_bound_np(p, q, k):
    """sum over q's top-k of min(p, q), per row (p, q full distributions)."""
    out = []
    for pr, qr in zip(p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1])):
        top = np.argsort(-qr, kind="stable")[:k]
        out.append(sum(min(pr[x], qr[x]) for x in top))
    return np.array(out).reshape(p.shape[:-1])


def alpha_paper_np(p, q, k):
    """sum over (p's top-k intersect q's top-k) of min(p, q)."""
    out = []
    for pr, qr in zip(p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1])):
        both = set(np.argsort(-pr, kind="stable")[:k]) & set(np.argsort(-qr, kind="stable")[:k])
        out.append(sum(min(pr[x], qr[x]) for x in both))
    return np.array(out).reshape(p.shape[:-1])


def tail_statistic_np(alpha, positions, mask=None, bin_tokens=2000, quantile=0.05, num_bins=20,
                      min_count=100):
    alpha = np.asarray(alpha, np.float64).ravel()
    positions = np.asarray(positions).ravel()
    mask = np.ones_like(alpha, bool) if mask is None else np.asarray(mask, bool).ravel()
    out = np.full(num_bins, np.nan)
    for i in range(num_bins):
        sel = []
        for a, pos, ok in zip(alpha, positions, mask):
            if ok and min(int(pos) // bin_tokens, num_bins - 1) == i:
                sel.append(a)
        if len(sel) >= min_count:
            out[i] = np.percentile(sel, 100 * quantile)
    return out


# The decode kernels' shared test matrix (GPU, TPU and Triton kernels alike), in pages of 16.
# Lengths: 1 token, partial pages, exact page boundaries (48, 320), a long ragged one.
KERNEL_LENGTHS = [1, 20, 48, 97, 320, 515]
# Budgets: the minimum 3 (reserved pages only), small, exactly n, more than the sequence.
KERNEL_BUDGETS = [3, 3, 3, 4, 20, 40]


def random_kernel_case(rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """Lengths and budgets of one slow-matrix case: five random lengths and a 64-page one, with
    the minimum, small, large, exactly-n and beyond-the-sequence budgets."""
    lengths = rng.integers(1, 1200, size=5).tolist() + [1024]
    budgets = [3, int(rng.integers(3, 20)), int(rng.integers(20, 60)), 8, 100, 64]
    return lengths, budgets


def assert_kernel_close(got: np.ndarray, want: np.ndarray, low_precision: bool) -> None:
    """A kernel's output against the float64 reference: float32 is exact math up to rounding
    (1e-5 relative to the largest output); bf16 rounds the probabilities for P.V and the output
    (1e-2)."""
    assert np.isfinite(got).all()
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < (1e-2 if low_precision else 1e-5), rel
