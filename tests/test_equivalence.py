"""Answer equivalence through math-verify (LaTeX parser only), in this process's main thread."""

import pytest

from r3jax.rewards import equivalence

# (model answer, reference(s), correct): an in-repo table covering the data sets' answer formats.
CASES = [
    ("25", "025", True),                                    # AIME strings with leading zeros
    ("142", 142.0, True),                                   # AMC floats
    ("142", "142.0", True),
    ("2^{1009}", "$2^{1009}$", True),                       # OlympiadBench $...$
    ("9.6 \\text{ nm}", "9.6\n", True),                     # Minerva: units, trailing newline
    ("(2,7,13),(1,8,19),(4,5,7)", "$(1,8,19), (2,7,13), (4,5,7)$", True),  # multi-answer sets
    ("221, 8", "$221,$8$", True),                           # OlympiadBench's broken dollars
    ("80", "80\\%", True),
    ("\\dfrac12", "\\frac{1}{2}", True),
    ("0.5", "\\frac{1}{2}", True),
    ("1+x^2", "x^2+1", True),
    ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", True),
    ("[1,2)", "[1,2)", True),
    ("3", "x=3", True),
    ("(-\\infty, 0) \\cup \\{1\\}", "$(-\\infty, 0) \\cup\\{1\\}$.", True),  # a trailing period
    ("\\$18.90", "\\$18.90", True),                          # an escaped dollar is kept
    ("0.02", ["0.01\n", "0.02\n"], True),                   # a list of acceptable answers
    ("24", "25", False),
    ("x^2-1", "x^2+1", False),
    ("(1,2)", "(2,1)", False),                              # tuples are ordered
    ("[1,2]", "[1,2)", False),
    ("0.03", ["0.01", "0.02"], False),
    ("4.6 \\times 10^{-25}", "4.6 \\times 10^{-24}", False),  # tiny numbers compare relatively
    (".0000673", ".0000672", False),
    ("6.72 \\times 10^{-5}", ".0000672", True),
]


@pytest.mark.parametrize("answer, reference, expected", CASES)
def test_equivalence_table(answer, reference, expected):
    correct, reason = equivalence.judge(answer, reference)
    assert correct is expected, reason
    assert reason == ("correct" if expected else "mismatch")


@pytest.mark.parametrize("answer", ["__import__('os').system('touch PWNED')", "exec('1')", "().__class__"])
def test_python_in_an_answer_is_never_run(answer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    correct, _ = equivalence.judge(answer, "3")
    assert not correct
    assert not list(tmp_path.iterdir())


def test_unparseable_answer_is_a_parse_error():
    assert equivalence.judge("\\frac{", "1") == (False, "parse_error")


def test_reference_normalization():
    assert equivalence.normalize_reference(" $x^2$ \n") == "x^2"
    assert equivalence.normalize_reference(142.0) == "142.0"
    with pytest.raises(TypeError, match="reference answer"):
        equivalence.normalize_reference(None)


@pytest.mark.parametrize("answer, reference, expected", [
    ("5.", "5", True),                 # a final period on the answer side too
    ("10\\,000", "10000", True),       # thin spaces between digit groups
    ("45°", "45", True),
    ("45\\degree", "45^\\circ", True),
    ("52", "52_8", True),              # the digits in the base the question asked for
    ("52_9", "52_8", False),           # math-verify drops subscripts: a different base must not pass
    ("4210_{5}", "4210_5", True),
])
def test_answer_side_normalization(answer, reference, expected):
    assert equivalence.judge(answer, reference)[0] is expected


def test_a_slow_comparison_is_a_timeout_not_a_mismatch():
    assert equivalence.judge("9^{9^{9^{9}}}", "1", timeout_s=1) == (False, "timeout")


def test_judge_refuses_to_run_outside_the_main_thread():
    import threading

    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, equivalence.judge, "1", "1")))
    thread.start()
    thread.join()
    assert errors and "main thread" in str(errors[0].value)
