"""Every shared eval set's gold answers, boxed in a response, grade as correct; a perturbed one does not.

Runs the real path (loader -> grade_batch -> pool). Skips when ../shared/data is absent.
"""

import re
from pathlib import Path

import pytest

from r3jax import rewards
from r3jax.data import problems as rp
from r3jax.rewards import equivalence

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
EVAL_SETS = ["rllm/test/aime.json", "rllm/test/amc.json", "rllm/test/math.json", "rllm/test/minerva.json",
             "rllm/test/olympiad_bench.json", "rllm/test/gsm8k.json", "simpletir/aime25.jsonl"]


def perturb(answer: str) -> str:
    """The first digit moved up by one (a different number, same shape), or `+1` appended."""
    text = equivalence.normalize_reference(answer)
    digit = re.search(r"\d", text)
    if digit is None:
        return text + "+1"
    k = digit.start()
    return text[:k] + str((int(text[k]) + 1) % 10) + text[k + 1:]


def respond(answer: str) -> str:
    return f"<think>Some reasoning.</think> The final answer is $\\boxed{{{answer}}}$."


@pytest.fixture(scope="module")
def grader():
    if not DATA.is_dir():
        pytest.skip(f"no shared data folder at {DATA}")
    with rewards.GradingPool(2, timeout_s=5.0) as p:
        yield p


@pytest.mark.parametrize("name", EVAL_SETS)
def test_gold_answers_verify_and_perturbed_ones_fail(grader, name):
    problems = rp.load_problems(DATA / name).problems
    golds = [p.answers for p in problems]
    own = rewards.grade_batch([respond(equivalence.normalize_reference(a[0])) for a in golds], golds, grader=grader)
    assert [(i, r.reason) for i, r in enumerate(own) if not r.correct] == []
    wrong = rewards.grade_batch([respond(perturb(a[0])) for a in golds], golds, grader=grader)
    assert [golds[i][0] for i, r in enumerate(wrong) if r.correct] == []
