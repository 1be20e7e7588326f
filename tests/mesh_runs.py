"""A trainer run on a device mesh against the same run on one device, step by step: the rollouts
each step sampled (recorded with their draws' Gumbel noise) and the metrics lines. Shared by
tests/test_trainer_mesh.py and tests/test_distill_mesh.py.

On CPU a mesh's programs give the one-device run's numbers to float32 rounding and the same
tokens, checked exactly. On a GPU each layout compiles to other fusions and kernels, so sums run
in another order (docs/design.md, section 10): float results differ at ~1e-6 relative and a draw
near a tie may pick another token, after which the row (and from the next update on, the whole
run) legitimately goes its own way. There a step is compared while every earlier step had the
same tokens; its tolerance:
- step 0 (the same weights, only the order of sums differs): as on CPU; 2 H200s met it.
- later steps: the weights were updated from gradients that differed by ~1e-6 relative, and
  AdamW's normalised step (m / sqrt(v)) magnifies that for entries whose gradient is near 0;
  2 H200s differed by 6.7e-5 relative at step 1 (alpha_topk_bound_mean, bfloat16 compute then):
  1e-3.
Both runs compute in float32 (the model's ``dtype``; the GPU default is bfloat16): weights
updated ~1e-6 apart would otherwise round to neighbouring bfloat16 values at use (2^-8 relative:
1.2e-3 seen on 2 H200s), hiding what is compared, the mesh's own rounding.
"""

from __future__ import annotations

import jax
import numpy as np

TOLERANCE = {"cpu": (1e-5, 1e-6), "first": (1e-5, 1e-6), "later": (1e-3, 1e-5)}


def tolerance(platform: str, step: int) -> tuple[float, float]:
    """(rtol, atol) of a step's metrics and log-probs."""
    return TOLERANCE["cpu" if platform == "cpu" else "first" if step == 0 else "later"]


def recording(inner, rollouts: list):
    """``inner`` (a trainer's ``rollout_fn``) appending each rollout, as :func:`record` gives
    it, to ``rollouts``."""
    def rollout_fn(model, prompts, key, n, **extra):
        out = inner(model, prompts, key, n, **extra)
        rollouts.append(record(out, key, n, extra.get("prompt_ids"), model.config.vocab_size))
        return out
    return rollout_fn


def record(out, key, n: int, prompt_ids, vocab: int) -> dict:
    """A rollout as lists, with the Gumbel noise of each of its draws rebuilt from the call's key
    (row i*n+j draws response position t with ``gumbel(fold_in(stream(i, j), t), (V,))``,
    docs/design.md section 10), for the near-tie check of a differing token."""
    from sparrow_jax.rollout.sampling import step_keys, stream_keys

    s, r = np.asarray(out.logprobs).shape
    ids = np.arange(s // n) if prompt_ids is None else np.asarray(prompt_ids)
    key = jax.random.wrap_key_data(np.asarray(jax.random.key_data(key)))   # off the mesh
    rows, steps = np.meshgrid(np.arange(s), np.arange(r), indexing="ij")
    keys = step_keys(stream_keys(key, ids[rows.ravel() // n], rows.ravel() % n), steps.ravel())
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,)))(keys).reshape(s, r, vocab)
    return {name: np.asarray(value).tolist() for name, value in (
        ("tokens", out.tokens), ("prompt_lengths", out.prompt_lengths),
        ("response_lengths", out.response_lengths), ("logprobs", out.logprobs),
        ("topk_ids", out.topk_ids), ("topk_logprobs", out.topk_logprobs), ("noise", noise))}


def same_tokens(got: dict, want: dict, platform: str, step: int, label: str) -> bool:
    """Two rollouts of one step: the same prompts, and per row the same tokens with close
    sampled log-probs; on a GPU a row may differ from its first differing token on if that draw
    was a near-tie: a flip needs the two tokens' perturbed log-probs (log-prob + the draw's
    Gumbel noise, the same in both runs) within the runs' log-prob differences, at most
    2 x the tolerance. -> whether every token was the same."""
    rtol, atol = tolerance(platform, step)
    wt, gt = np.asarray(want["tokens"]), np.asarray(got["tokens"])
    pl, rl = np.asarray(want["prompt_lengths"]), np.asarray(want["response_lengths"])
    assert wt.shape == gt.shape and np.array_equal(got["prompt_lengths"], pl), label
    if platform == "cpu":
        np.testing.assert_array_equal(gt, wt, err_msg=label)
    wl, gl = np.asarray(want["logprobs"], np.float64), np.asarray(got["logprobs"], np.float64)
    noise = np.asarray(want["noise"], np.float64)
    np.testing.assert_array_equal(noise, np.asarray(got["noise"]), err_msg=label)
    ids, top = np.asarray(want["topk_ids"]), np.asarray(want["topk_logprobs"], np.float64)
    same = True
    for b in range(len(pl)):
        assert np.array_equal(wt[b, :pl[b]], gt[b, :pl[b]]), f"{label}: row {b}'s prompt"
        a, g = wt[b, pl[b]:], gt[b, pl[b]:]
        j = int(np.argmax(a != g)) if (a != g).any() else rl[b]
        # the rebuilt noise is the draws' own: each drawn token is the Gumbel-max of the
        # recorded top-k candidates and itself
        for t in range(min(j + 1, rl[b])):
            pert = top[b, t] + noise[b, t, ids[b, t]]
            assert wl[b, t] + noise[b, t, a[t]] >= pert.max() - 1e-6, (label, b, t)
        np.testing.assert_allclose(gl[b, :j], wl[b, :j], rtol=rtol, atol=atol,
                                   err_msg=f"{label}: row {b}")
        if j < rl[b]:
            assert platform != "cpu", f"{label}: row {b} differs at response token {j}"
            gap = abs(wl[b, j] + noise[b, j, a[j]] - gl[b, j] - noise[b, j, g[j]])
            assert gap <= 2 * (atol + rtol * abs(wl[b, j])), \
                f"{label}: row {b} differs at response token {j}, gap {gap:.3g}: not a near-tie"
            print(f"{label}: row {b} differs at response token {j}, a near-tie (gap {gap:.3g})")
            same = False
        else:
            assert int(np.asarray(got["response_lengths"])[b]) == rl[b], (label, b)
    return same


def check_run(got_metrics: list[dict], got_rollouts: list[dict], ref: dict, platform: str,
              label: str) -> int:
    """A run (its metrics lines; its rollouts, step i's at index i) against the reference (the
    same, under ``metrics`` and ``rollouts``), step by step until the tokens part (GPU only)
    -> the steps whose metrics were compared."""
    want = ref["metrics"]
    assert [r["step"] for r in got_metrics] == [r["step"] for r in want[:len(got_metrics)]]
    for i, (g, w) in enumerate(zip(got_metrics, want)):
        if not same_tokens(got_rollouts[i], ref["rollouts"][i], platform, i, f"{label} step {i}"):
            return i   # from here on the runs train on other samples
        assert set(g) == set(w), (sorted(set(g) ^ set(w)))
        rtol, atol = tolerance(platform, i)
        for k in w:
            # the absolute floor is for values near 0 that are sums of opposite signs (loss)
            np.testing.assert_allclose(g[k], w[k], rtol=rtol, atol=atol,
                                       err_msg=f"{label} step {w['step']} {k}")
    return len(got_metrics)
