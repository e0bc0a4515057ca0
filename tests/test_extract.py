"""Final-answer extraction: the last closed \\boxed{} after </think>, linear time on hostile text."""

import time

import pytest

from r3jax.rewards import extract


@pytest.mark.parametrize("response, answer", [
    ("<think>try \\boxed{1}</think> so \\boxed{2}", "2"),                        # a box inside the thinking is ignored
    ("<think>a</think>\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box
    ("<think>a</think>\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),                      # escaped set braces are text
    ("<think>a</think>\\boxed {  7 }", "7"),                                    # space before the brace
    ("<think>a</think>\\fbox{3}", "3"),
    ("<think>a</think>\\boxed{4} and then \\boxed{5", "4"),                     # an unclosed last box: the one before
    ("<think>a</think><think>b</think>\\boxed{6}", "6"),                        # the last </think> counts
])
def test_final_answer(response, answer):
    assert extract.final_answer(response) == (answer, None)


@pytest.mark.parametrize("response, reason", [
    ("\\boxed{1}", "no_think_end"),
    ("<think>\\boxed{1}", "no_think_end"),
    ("<think>x</think> the answer is 1", "no_box"),
    ("<think>x</think> \\boxed{}", "no_box"),
    ("<think>x</think> \\boxed{1", "no_box"),
])
def test_wrong_by_format(response, reason):
    assert extract.final_answer(response) == (None, reason)


def test_nested_braces_are_matched():
    inner = "{" * 10_000 + "1" + "}" * 10_000
    assert extract.final_answer("<think></think>\\boxed{" + inner + "}") == (inner, None)


def test_hostile_text_costs_linear_time():
    """A megabyte of unclosed boxes and braces: one pass, well under a second."""
    text = "<think></think>" + "\\boxed{" * 100_000 + "{" * 300_000
    start = time.perf_counter()
    assert extract.final_answer(text) == (None, "no_box")
    assert time.perf_counter() - start < 2.0


def test_control_characters_at_the_edges_of_a_box_reach_the_judge():
    # str.strip() treats \x1c-\x1f as whitespace; the grader must see them to refuse the answer
    assert extract.last_boxed("\\boxed{\x1e144\x1f}") == "\x1e144\x1f"
    assert extract.last_boxed("\\boxed{ 144\n}") == "144"
