"""grade_batch: correctness, the R³ reward and a reason code per response."""

import pytest

from r3jax import rewards


@pytest.fixture(scope="module")
def grader():
    with rewards.GradingPool(2, timeout_s=2.0) as p:
        yield p


def test_reasons_and_rewards(grader):
    responses = [
        "<think>so</think> The answer is \\boxed{25}.",
        "<think>so</think> \\boxed{24}",
        "The answer is \\boxed{25}",
        "<think>so</think> 25",
        "<think>so</think> \\boxed{)(}",
        "<think>" + "a" * 1_000_000 + "</think>\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
    ]
    results = rewards.grade_batch(responses, ["025"] * 6, num_tokens=[8192, 10, 10, 10, 10, 10], grader=grader)
    assert [r.reason for r in results] == ["correct", "mismatch", "no_think_end", "no_box", "parse_error",
                                           "parse_error"]
    assert [r.correct for r in results] == [True] + [False] * 5
    assert [r.reward for r in results] == [1.75, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert all(r.reason in rewards.REASONS for r in results)


def test_list_of_acceptable_answers_and_no_lengths(grader):
    results = rewards.grade_batch(["<think></think>\\boxed{0.02}"], [["0.01", "0.02"]], grader=grader)
    assert results == [rewards.GradeResult(True, 1.0, "correct")]


def test_shared_pool_is_used_by_default():
    results = rewards.grade_batch(["<think></think>\\boxed{4}"], ["4"], timeout_s=2.0)
    assert results[0].correct
    assert rewards.shared_pool(2.0) is rewards.shared_pool(2.0)


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        rewards.grade_batch(["a", "b"], ["1"])
    with pytest.raises(ValueError, match="num_tokens"):
        rewards.grade_batch(["a"], ["1"], num_tokens=[1, 2])
    with pytest.raises(TypeError, match=r"responses\[0\]"):
        rewards.grade_batch([None], ["1"])
