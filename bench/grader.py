"""Responses graded per second per worker by `grade_batch`, against grading in-process in the same run.

Usage: python bench/grader.py [--rounds 3] [--cases math500 synthetic]
Real-looking responses: ~3 KB of reasoning, `</think>`, then a boxed answer; half correct, half a
perturbed answer. The reference is math-verify called directly in this process (no extraction, no
isolation), so `ratio` = pool throughput per worker / in-process throughput: the cost of isolation.
Every timed call grades verdicts nobody has cached: `judge` keeps the verdicts it reached, keyed by the
answer and the references as given, so each call's references carry trailing spaces of their own count
(stripped before grading: the same work, a new key). Reference parses stay cached, as in a run, where a
group's G samples share their question's reference.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from common import alternate, emit, main_over_cases  # noqa: E402

from r3jax import rewards  # noqa: E402
from r3jax.rewards import equivalence, extract  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "rllm" / "test" / "math.json"
SYNTHETIC = ["025", "142", "\\frac{3}{4}", "2\\sqrt{5}", "(1,2)", "x^2+1", "\\{1, 2, 3\\}", "[0, \\infty)", "80\\%",
             "9.6", "-\\frac{1}{2}", "\\pi", "12", "3\\sqrt{2}-1", "\\dfrac{7}{9}", "1, 2", "y=2x+3", "0.25"]
CASES = {"math500": dict(batch=256, source="math500"), "synthetic": dict(batch=256, source="synthetic")}


def gold_answers(source: str) -> list[str]:
    if source == "math500" and DATA.is_file():
        from r3jax.data import problems
        return [p.answers[0] for p in problems.load_problems(DATA)]
    return SYNTHETIC


def responses_for(golds, n, seed=0):
    rng = random.Random(seed)
    words = "so we compute the sum then factor and check each case carefully since x y n = + - 2 3 7".split()
    out, refs = [], []
    for i in range(n):
        gold = golds[i % len(golds)]
        answer = equivalence.normalize_reference(gold) if i % 2 == 0 else equivalence.normalize_reference(gold) + "+1"
        thinking = " ".join(rng.choice(words) for _ in range(600))
        out.append(f"<think>{thinking}</think> Therefore the final answer is $\\boxed{{{answer}}}$.")
        refs.append(gold)
    return out, refs


def run(name: str, case: dict, rounds: int):
    responses, refs = responses_for(gold_answers(case["source"]), case["batch"])
    finals = [extract.final_answer(r)[0] for r in responses]
    record = {"bench": "grader", "case": name, "batch": len(responses),
              "mean_response_chars": round(sum(map(len, responses)) / len(responses))}
    calls = iter(range(1, 10**6))
    fresh = lambda: [r + " " * next(calls) for r in refs]  # noqa: E731  uncached verdicts (module docstring)
    for workers in (1, 2):
        with rewards.GradingPool(workers, timeout_s=5.0) as pool:
            rewards.grade_batch(responses[:8], refs[:8], grader=pool)  # warm the workers (imports, parses)
            timed = alternate({
                "pool": lambda pool=pool: rewards.grade_batch(responses, fresh(), grader=pool),
                "in_process": lambda: [equivalence.judge(a, r) for a, r in zip(finals, fresh(), strict=True)],
            }, rounds)
        per_worker = len(responses) / timed["pool"]["median_s"] / workers
        inline = len(responses) / timed["in_process"]["median_s"]
        record.update({f"pool{workers}_responses_per_s_per_worker": round(per_worker, 1),
                       f"in_process{workers}_responses_per_s": round(inline, 1),
                       f"ratio{workers}": round(per_worker / inline, 3)})
    record["cpus"] = os.cpu_count()
    emit(record)


if __name__ == "__main__":
    main_over_cases(CASES, run, default_rounds=3)
