"""The math reward of the Sparrow recipe, for one response: the last brace-matched ``\\boxed{...}``
of the response and the gold answer, each wrapped in ``$...$``, parsed and compared by
math-verify as ``verify(gold, pred)`` (the order matters: math-verify is not symmetric). 1.0 or
0.0, no format reward.

math-verify's own timeouts use SIGALRM, which only works on a process's main thread; they are
off here (``parsing_timeout=None``, ``timeout_seconds=None``), so this runs on any thread, and
the wall-clock limit is the verifier pool's (:mod:`sparrow_jax.rl.verifier_pool`), which kills
a worker that overruns it. This module imports nothing heavy at load: the pool's workers import
it without JAX.
"""

from __future__ import annotations

import logging
import re

_BOXED = re.compile(r"\\boxed\s*\{")
THINK_END = "</think>"

# Outcomes of one response (the pool adds "timeout" and "error").
CORRECT, WRONG, NO_ANSWER = "correct", "wrong", "no_answer"


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, its braces matched (``\\{`` and
    ``\\}`` are literal braces, not groups); None when there is none or the last is never closed
    (a response cut off inside its answer has no answer)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth, i = 1, start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2          # an escaped character, \{ and \} included, never opens or closes
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def answer_region(text: str, after_think: bool = False) -> str | None:
    """The part of a response the reward reads: all of it, or with ``after_think`` only what
    follows the last ``</think>`` (None when the response never closed its thinking)."""
    if not after_think:
        return text
    cut = text.rfind(THINK_END)
    return None if cut < 0 else text[cut + len(THINK_END):]


def as_math(answer: str) -> str:
    """``answer`` as one LaTeX formula for math-verify: wrapped in ``$...$`` (dollars already
    around it are dropped first, so they are not doubled)."""
    return f"${answer.strip().strip('$').strip()}$"


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ImportError("the `math` reward needs math-verify: pip install math-verify") from None
    # It warns once per process that its timeouts are off; the verifier pool's limit is ours.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def judge(response: str, gold: str, after_think: bool = False) -> tuple[float, str]:
    """-> (reward, outcome) of one decoded response against the gold answer's text; outcome is
    :data:`CORRECT`, :data:`WRONG` or :data:`NO_ANSWER` (no closed box in the region read)."""
    region = answer_region(response, after_think)
    boxed = None if region is None else last_boxed(region)
    if boxed is None:
        return 0.0, NO_ANSWER
    mv = _math_verify()
    gold_parsed = mv.parse(as_math(gold), parsing_timeout=None)
    pred_parsed = mv.parse(as_math(boxed), parsing_timeout=None)
    if gold_parsed and pred_parsed and mv.verify(gold_parsed, pred_parsed, timeout_seconds=None):
        return 1.0, CORRECT
    return 0.0, WRONG


def warm() -> None:
    """A verifier pool worker's start: math-verify and the sympy parts it loads lazily, so the
    first answer's limit is spent on the answer."""
    judge("\\boxed{\\frac{1}{2}}", "0.5")
