"""The README's "Using it" example runs as written on the demo checkpoint, and what it computes
agrees with independent references: the replayed sparse log-probs with what the decode loop
recorded, alpha with a float64 NumPy acceptance rate, the tail with NumPy percentiles."""

import os
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Using it"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def ns():
    cwd = os.getcwd()
    os.chdir(ROOT)          # the example names checkpoints/demo relative to the repository
    try:
        namespace: dict = {}
        exec(compile(_example(), "README.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    return namespace


def _logsoftmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_readme_example_replays_the_rollout(ns):
    r = ns["rollout"]
    mask = np.asarray(r.response_mask)
    assert mask.sum() >= 8
    # every response step after the prefill's ran sparse (5 pages against prompts of 12-16)
    assert np.all(np.asarray(r.budget_pages)[:, 1:][mask[:, 1:]] == 5)
    np.testing.assert_allclose(np.asarray(ns["replayed"])[mask], np.asarray(r.logprobs)[mask],
                               atol=2e-4)


def test_readme_example_alpha_and_tail_match_numpy(ns):
    r = ns["rollout"]
    mask = np.asarray(r.response_mask)
    tokens, plen = np.asarray(r.tokens), np.asarray(r.prompt_lengths)
    lp, lq = _logsoftmax(ns["logits"]), _logsoftmax(ns["logits_sparse"])
    want = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            i = plen[b] + j - 1
            want[b, j] = np.minimum(np.exp(lp[b, i]), np.exp(lq[b, i])).sum()
    alpha = np.asarray(ns["alpha"])
    np.testing.assert_allclose(alpha[mask], want[mask], atol=1e-5)
    assert want[mask].min() < 0.999          # the sparse actor differs somewhere
    # sparse_logits and sparse_logprobs are one forward: the log-softmax at the sampled token
    for b in range(mask.shape[0]):
        for j in np.flatnonzero(mask[b]):
            i = plen[b] + j - 1
            np.testing.assert_allclose(lq[b, i, tokens[b, i + 1]], ns["replayed"][b, j],
                                       atol=2e-4)
    positions = plen[:, None] + np.arange(mask.shape[1])[None, :]
    bins = np.minimum(positions // 32, 8)
    tail = np.asarray(ns["tail"])
    for k in range(9):
        sel = want[mask & (bins == k)]
        if sel.size >= 4:
            np.testing.assert_allclose(tail[k], np.percentile(sel, 5), atol=1e-5)
        else:
            assert np.isnan(tail[k])
    assert np.isfinite(tail).any()
