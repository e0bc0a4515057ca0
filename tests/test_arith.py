"""The embedded default's task (`r3jax.data.arith`): solutions that grade correct, fixed splits, level lengths."""

import collections
import json
import pathlib
import random
import runpy

import pytest

from r3jax import rewards
from r3jax.data import arith
from r3jax.data.problems import load_problems

REPO = pathlib.Path(__file__).resolve().parents[1]


def chains(n=200, seed=0):
    rng = random.Random(seed)
    return [arith.random_chain(rng, rng.choice([1, 2, 3, 4, 5, 8])) for _ in range(n)]


def test_worked_solutions_grade_correct():
    cs = chains()
    graded = rewards.grade_batch([arith.worked_solution(c) for c in cs], [str(c.answer) for c in cs])
    wrong = [(c.problem, g.reason) for c, g in zip(cs, graded, strict=True) if not g.correct]
    assert not wrong


def test_a_wrong_digit_grades_wrong():
    cs = chains()
    wrong = [arith.worked_solution(c).replace(f"\\boxed{{{c.answer}}}", f"\\boxed{{{c.answer + 10}}}") for c in cs]
    assert not any(g.correct for g in rewards.grade_batch(wrong, [str(c.answer) for c in cs]))


def test_wrong_solutions_end_wrong():
    rng = random.Random(1)
    cs = chains()
    graded = rewards.grade_batch([arith.wrong_solution(c, rng) for c in cs], [str(c.answer) for c in cs])
    assert not any(g.correct for g in graded)


def test_steps_are_left_to_right():
    chain = arith.Chain((12, 7, 30, 5), ("+", "-", "+"))
    assert chain.problem == "Compute 12+7-30+5."
    assert arith.worked_solution(chain) == "12+7=19\n19-30=-11\n-11+5=-6\n</think>\n\\boxed{-6}"


def test_bad_chains_are_refused():
    with pytest.raises(ValueError, match="operations"):
        arith.Chain((1, 2), ("*",))
    with pytest.raises(ValueError, match="operands"):
        arith.Chain((1, 2, 3), ("+",))


def test_splits_are_disjoint_balanced_and_fixed():
    train, heldout = arith.splits(0)
    problems = [r["problem"] for r in train] + [r["problem"] for rows in heldout.values() for r in rows]
    assert len(problems) == len(set(problems))
    assert sorted(heldout) == sorted(arith.LEVELS)
    for level, rows in heldout.items():
        assert len(rows) == arith.HELDOUT_PER_LEVEL and {r["level"] for r in rows} == {level}
        trained = arith.TRAIN_PER_LEVEL if level in arith.TRAIN_LEVELS else 0
        assert sum(r["level"] == level for r in train) == trained
    assert arith.splits(0) == (train, heldout)
    assert arith.splits(1)[0] != train


def test_committed_files_are_the_generator_output(tmp_path):
    arith.write_assets(tmp_path)
    for path in tmp_path.glob("*.jsonl"):
        assert (REPO / "configs" / "arith" / path.name).read_bytes() == path.read_bytes(), path.name


def test_committed_files_load_as_problems():
    for path in (REPO / "configs" / "arith").glob("*.jsonl"):
        loaded = load_problems(str(path))
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert [p.answers for p in loaded] == [(r["answer"],) for r in rows]


def test_levels_fit_or_overrun_the_budget():
    """With configs/arith.py's 56-token budget (byte tokens; `</think>` is one token, the end token another),
    every careful solution up to 5 operations fits and no out-of-reach one does."""
    rng = random.Random(0)
    budget = runpy.run_path(str(REPO / "configs" / "arith.py"))["get_config"]().max_new_tokens

    def tokens(n):
        return len(arith.worked_solution(arith.random_chain(rng, n))) - len("</think>") + 2

    assert max(tokens(n) for n in (1, 2, 3, 4, 5) for _ in range(400)) <= budget
    assert min(tokens(8) for _ in range(400)) > budget


def test_running_values_never_go_negative():
    for chain in chains(500):
        assert min(chain.partial_results()) >= 0 and chain.operands[0] >= arith.FIRST_OPERAND[0]


def test_no_answer_is_a_good_guess():
    """A shortcut must not win by guessing: no answer is common at any level (most common < 5%)."""
    rng = random.Random(0)
    for n in (1, 3, 5, 8):
        answers = collections.Counter(arith.random_chain(rng, n).answer for _ in range(4000))
        assert answers.most_common(1)[0][1] < 0.05 * 4000, n


def test_shortcuts_write_the_first_lines_then_the_answer():
    chain = arith.Chain((30, 7, 5, 9), ("+", "-", "+"))
    assert arith.shortcut_solution(chain, 0) == "</think>\n\\boxed{41}"
    assert arith.shortcut_solution(chain, 2) == "30+7=37\n37-5=32\n</think>\n\\boxed{41}"
    with pytest.raises(ValueError, match="0..2"):
        arith.shortcut_solution(chain, 3)
    cs = chains()
    graded = rewards.grade_batch([arith.shortcut_solution(c, 0) for c in cs], [str(c.answer) for c in cs])
    assert all(g.correct for g in graded)


def test_strategy_tells_careful_from_shortcut_and_unfinished():
    chain = arith.Chain((30, 7, 5, 9), ("+", "-", "+"))
    assert arith.strategy(arith.worked_solution(chain), 3) == "careful"
    assert [arith.strategy(arith.shortcut_solution(chain, k), 3) for k in range(3)] == ["shortcut"] * 3
    assert arith.strategy(arith.worked_solution(chain)[:20], 3) == "unfinished"
