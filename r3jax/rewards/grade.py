"""`grade_batch`: responses and reference answers in, correctness, R³ reward and a reason out."""

from __future__ import annotations

import atexit
import dataclasses
import os

from r3jax.rewards import extract, pool, reward

# Why a response scored what it did; metrics count these.
REASONS = ("correct", "no_think_end", "no_box", "mismatch", "timeout", "parse_error")
MAX_ANSWER_CHARS = 2000  # a boxed answer longer than this is not an answer; it never reaches sympy

_default_pools: dict = {}


@dataclasses.dataclass(frozen=True)
class GradeResult:
    correct: bool
    reward: float
    reason: str  # one of REASONS


def grade_batch(responses, answers, *, num_tokens=None, timeout_s: float = 3.0, grader: pool.GradingPool | None = None,
                max_length: int = reward.L_MAX) -> list[GradeResult]:
    """Grades responses[i] against answers[i] (a string, a number, or a list of acceptable ones).

    The final answer is the last closed `\\boxed{}` after `</think>` (R3-SPEC §3); equivalence is
    math-verify's, run in a `GradingPool` (a shared one per timeout unless `grader` is given), so a
    pathological answer costs at most `timeout_s` and scores wrong. reward is `r3_reward` with the
    length bonus when `num_tokens[i]` (the response's token count) is given, else 1 for correct.
    """
    responses, answers = list(responses), list(answers)
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    if num_tokens is not None and len(num_tokens) != len(responses):
        raise ValueError(f"{len(responses)} responses but {len(num_tokens)} num_tokens")
    references = [pool.check_references(a, f"answers[{i}]") for i, a in enumerate(answers)]
    verdicts: list = [None] * len(responses)
    to_check = []
    for i, response in enumerate(responses):
        if not isinstance(response, str):
            raise TypeError(f"responses[{i}] must be a string, got {type(response).__name__}")
        final, reason = extract.final_answer(response)
        if final is None:
            verdicts[i] = (False, reason)
        elif len(final) > MAX_ANSWER_CHARS:
            verdicts[i] = (False, "parse_error")
        else:
            to_check.append((i, final))
    if to_check:
        grader = grader or shared_pool(timeout_s)
        checked = grader.grade([a for _, a in to_check], [references[i] for i, _ in to_check])
        for (i, _), verdict in zip(to_check, checked, strict=True):
            verdicts[i] = verdict
    correct = [c for c, _ in verdicts]
    rewards = reward.r3_reward(correct, num_tokens, max_length)
    return [GradeResult(bool(c), float(r), why) for (c, why), r in zip(verdicts, rewards, strict=True)]


def shared_pool(timeout_s: float = 3.0) -> pool.GradingPool:
    """One pool per timeout for this process (a forked child gets its own), started on first use and
    closed at exit."""
    key = (os.getpid(), float(timeout_s))
    grader = _default_pools.get(key)
    if grader is None or grader._closed:
        grader = _default_pools[key] = pool.GradingPool(timeout_s=timeout_s)
        atexit.register(grader.close)
    return grader
