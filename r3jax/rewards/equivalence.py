"""Is an extracted answer equal to a reference? math-verify underneath, LaTeX parsing only.

math-verify's default extraction also tries plain expressions through sympy's `parse_expr`, which
evaluates Python; model text must never reach it, so both sides are parsed with its LaTeX extractor
alone (an ANTLR grammar that builds sympy objects and runs nothing). Its own timeouts use
`signal.alarm`, so call this in a process's main thread: the grading pool's workers do.
"""

from __future__ import annotations

import math
import re
import threading

import math_verify
from math_verify.errors import TimeoutException

_LATEX_ONLY = (math_verify.LatexExtractionConfig(),)
_DOLLAR = re.compile(r"(?<!\\)\$")  # math delimiters, not the escaped currency sign `\$`


_DIGIT_SPACE = re.compile(r"(?<=\d)\\[,;:! ](?=\d)")  # 10\,000: a thin space between digit groups
_DEGREES = re.compile(r"°|\\degree\b")
_BASE = re.compile(r"_\{?(\d+)\}?\s*$")  # 52_8, 4210_{5}: a number written in a base


def normalize_answer(answer: str) -> str:
    """A model's boxed answer: digit-group spaces dropped, ° as ^\\circ, one final period dropped."""
    text = _DEGREES.sub(lambda _: "^\\circ", _DIGIT_SPACE.sub("", answer)).strip()
    return text[:-1].rstrip() if text.endswith(".") and not text.endswith("\\.") else text


def same_base(reference, answer: str) -> bool:
    """math-verify drops subscripts, so 52_9 would equal 52_8: when both name a base, it must agree."""
    ref = _BASE.search(normalize_reference(reference)) if isinstance(reference, str) else None
    ans = _BASE.search(answer)
    return ref is None or ans is None or ref.group(1) == ans.group(1)


def normalize_reference(answer) -> str:
    """A data set's answer as LaTeX text: numbers as written (142.0 stays 142.0, equal to 142 anyway),
    `$` delimiters dropped (OlympiadBench's `$...$`, also its `$221,$8$`), a final period dropped,
    whitespace and trailing newlines stripped (Minerva)."""
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TypeError(f"a reference answer must be a string or a number, got {type(answer).__name__}: {answer!r}")
    text = _DOLLAR.sub("", str(answer)).strip()
    return text[:-1].rstrip() if text.endswith(".") and not text.endswith("\\.") else text


_REFERENCES: dict[str, tuple] = {}


def parse_reference(text: str, timeout_s: int = 3) -> tuple:
    """Parsed normalized reference, cached (the same gold is graded G times per group); an empty result
    (a parse that failed or timed out) is not cached, so one slow moment cannot stick to a question."""
    if text not in _REFERENCES:
        parsed = tuple(math_verify.parse(f"${text}$", extraction_config=_LATEX_ONLY, parsing_timeout=timeout_s))
        if not parsed:
            return parsed
        if len(_REFERENCES) >= 4096:
            _REFERENCES.pop(next(iter(_REFERENCES)))
        _REFERENCES[text] = parsed
    return _REFERENCES[text]


def parse_answer(answer: str, timeout_s: int = 3) -> list:
    """Parsed model answer (the content of its box); [] when nothing parses. Raises on a parse timeout."""
    return math_verify.parse(f"\\boxed{{{answer}}}", extraction_config=_LATEX_ONLY, parsing_timeout=timeout_s,
                             raise_on_error=True)


def small_numbers_agree(gold, answer, rel_tol: float = 1e-6) -> bool:
    """math-verify rounds numbers to 6 decimal places before comparing, so all numbers below ~1e-6
    look equal (Minerva's 4.6e-24 = 4.6e-25, MATH's .0000672 = .0000673). Below 1e-3 this asks
    for relative agreement instead; anything that is not a pair of plain numbers passes through."""
    if not (getattr(gold, "is_number", False) and getattr(answer, "is_number", False)):
        return True
    try:
        a, b = float(gold), float(answer)
    except (TypeError, ValueError, OverflowError):  # complex, or not a finite real: leave it to math-verify
        return True
    if max(abs(a), abs(b)) >= 1e-3:
        return True
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=0.0)


def judge(answer: str, references, timeout_s: int = 3) -> tuple[bool, str]:
    """(correct, reason): reason is `correct`, `mismatch`, `parse_error` or `timeout`.

    references: one acceptable answer or a list of them; the answer is correct if it equals any.
    """
    refs = [references] if isinstance(references, (str, int, float)) else list(references)
    if not refs:
        raise ValueError("judge needs at least one reference answer")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("equivalence.judge uses signal-based timeouts and must run in a main thread; "
                           "use grade_batch / GradingPool, which grade in worker processes")
    answer = normalize_answer(answer)
    try:
        parsed = parse_answer(answer, timeout_s)
    except TimeoutException:
        return False, "timeout"
    except Exception:  # noqa: BLE001  (the grammar or sympy rejected it)
        return False, "parse_error"
    if not parsed:
        return False, "parse_error"
    timed_out = False
    for ref in refs:
        gold = parse_reference(normalize_reference(ref), timeout_s)
        try:
            same = bool(gold) and math_verify.verify(list(gold), parsed, timeout_seconds=timeout_s, raise_on_error=True)
        except TimeoutException:
            timed_out, same = True, False
        except Exception:  # noqa: BLE001  (incomparable objects: not equal)
            same = False
        if same and small_numbers_agree(gold[0], parsed[0]) and same_base(ref, answer):
            return True, "correct"
    if timed_out:
        return False, "timeout"
    # math-verify falls back to the raw string when its grammar rejects the LaTeX: that is a parse error
    return False, "mismatch" if any(not isinstance(x, str) for x in parsed) else "parse_error"
