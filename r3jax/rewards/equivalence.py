"""Is an extracted answer equal to a reference? Whole answers only, math-verify's comparison underneath.

Both sides are read by `latex.parse` (latex2sympy's LaTeX grammar, which runs nothing: math-verify's
plain-expression mode goes through sympy's `parse_expr`, which evaluates Python, so model text never
reaches it), and must be read completely. Then the written forms must agree (`shape`: sets, tuples and
intervals are different things), an answer may not offer alternatives ("or") or hide an equation chain
behind the reference, and math-verify's `verify` compares the values. One deadline bounds the whole
judgement (`signal.setitimer`, fractions of a second: math-verify's own `signal.alarm` has whole seconds
only, so a 1 s pool limit could never be met from inside and every slow answer cost a killed worker); it
needs a process's main thread, which the grading pool's workers are.
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
import signal
import threading

import math_verify
import sympy
from math_verify.errors import TimeoutException
from sympy.core.relational import Relational

from r3jax.rewards import latex, shape

_DOLLAR = re.compile(r"(?<!\\)\$")  # math delimiters, not the escaped currency sign `\$`
_BASE = re.compile(r"_\{?(\d+)\}?\s*$")  # 52_8, 4210_{5}: a number written in a base
_LATEX_ONLY = (math_verify.LatexExtractionConfig(),)
# math-verify's internal alarms are switched off (judge's deadline replaces them); it warns once that the
# caller must then bound the time itself, which judge does
math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True


def normalize_answer(answer: str) -> str:
    """A model's boxed answer without decoration (see `latex.clean`)."""
    return latex.clean(answer)


def normalize_reference(answer) -> str:
    """A data set's answer as LaTeX text: numbers as written (142.0 stays 142.0, equal to 142 anyway),
    `$` delimiters dropped (OlympiadBench's `$...$`, also its `$221,$8$`), a final period dropped,
    whitespace and trailing newlines stripped (Minerva)."""
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TypeError(f"a reference answer must be a string or a number, got {type(answer).__name__}: {answer!r}")
    text = _DOLLAR.sub("", str(answer)).strip()
    return text[:-1].rstrip() if text.endswith(".") and not text.endswith("\\.") else text


def same_base(reference, answer: str) -> bool:
    """math-verify drops subscripts, so 52_9 would equal 52_8: when both name a base, it must agree."""
    ref = _BASE.search(normalize_reference(reference)) if isinstance(reference, str) else None
    ans = _BASE.search(answer)
    return ref is None or ans is None or ref.group(1) == ans.group(1)


_REFERENCES: dict[str, object] = {}


def parse_reference(text: str):
    """A normalized reference's value, cached (the same gold is graded G times per group); None when
    it does not parse (a failed or timed-out parse is not cached, so one slow moment cannot stick).

    References are trusted text: one the whole-answer parser refuses (a data set's odd spelling) is
    read by math-verify's own extraction instead, so a question is never unanswerable."""
    if text not in _REFERENCES:
        try:
            value = latex.parse(text)
        except latex.NotWholeAnswer:
            found = math_verify.parse(f"${text}$", extraction_config=_LATEX_ONLY, parsing_timeout=None)
            value = next((v for v in found if not isinstance(v, str)), None)
        if value is None:
            return None
        if len(_REFERENCES) >= 4096:
            _REFERENCES.pop(next(iter(_REFERENCES)))
        _REFERENCES[text] = value
    return _REFERENCES[text]


def small_numbers_agree(gold, answer, rel_tol: float = 1e-6) -> bool:
    """math-verify rounds numbers to 6 decimal places before comparing, so all numbers below ~1e-6
    look equal (Minerva's 4.6e-24 = 4.6e-25, MATH's .0000672 = .0000673). Below 1e-3 this asks
    for relative agreement instead; anything that is not a pair of plain numbers passes through.
    An exact difference of 0 agrees first: float() of an unevaluated `0 + 2 - 2` is 4.7e-125."""
    if not (getattr(gold, "is_number", False) and getattr(answer, "is_number", False)):
        return True
    try:
        if sympy.simplify(gold - answer) == 0:
            return True
        a, b = float(sympy.N(gold, 30)), float(sympy.N(answer, 30))
    except (TypeError, ValueError, OverflowError):  # complex, or not a finite real: leave it to math-verify
        return True
    if max(abs(a), abs(b)) >= 1e-3:
        return True
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=0.0)


def _items(value) -> list:
    return [value, *value.args] if isinstance(value, (sympy.FiniteSet, sympy.Tuple)) else [value]


def relations_fit(gold, answer) -> bool:
    """math-verify compares only the right-hand side when the answer is an equation and the reference is
    not, so `2 = \\frac{1}{2}` would pass for 1/2: there, an equation must name a variable (`x = 7`).
    An equation chain (`y = 99 = 2x+3`) passes only for a reference that is itself a chain."""
    gold_items = _items(gold)
    gold_relations = any(isinstance(g, (Relational, sympy.And)) for g in gold_items)
    for a in _items(answer):
        if isinstance(a, sympy.And) and not any(isinstance(g, sympy.And) for g in gold_items):
            return False
        if not gold_relations and isinstance(a, Relational) and not (
                isinstance(a, sympy.Eq) and isinstance(a.lhs, sympy.Symbol)):
            return False
    return True


def _verbatim(text: str) -> str:
    return re.sub(r"\s+", "", latex.canonical(text))


@contextlib.contextmanager
def deadline(seconds: float):
    """Raises math-verify's TimeoutException in this (main) thread once `seconds` have passed. Yields a dict
    whose `expired` says whether it fired: math-verify catches exceptions inside its own steps, so the alarm can
    end a comparison early as a plain False that is no verdict.

    The garbage collector is off inside the block. Python runs the handler wherever the main thread is, and an
    exception raised inside a gc callback (JAX registers one) is printed and dropped: one alarm lost so let
    `(x+1)^{10^{4}}` expand for 54 s against a 0.4 s deadline (CI, 2026-12-05). The alarm stays one-shot: one
    that fired again could land in the cleanup below and outlive the block."""
    clock = {"expired": False}

    def expire(signum, frame):
        clock["expired"] = True
        raise TimeoutException(f"no verdict within {seconds} s")

    collecting = gc.isenabled()
    gc.disable()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield clock
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if collecting:
            gc.enable()


def judge(answer: str, references, timeout_s: float = 3.0) -> tuple[bool, str]:
    """(correct, reason): reason is `correct`, `mismatch`, `parse_error` or `timeout` (no verdict within
    `timeout_s` seconds).

    references: one acceptable answer or a list of them; the answer is correct if it equals any.
    """
    refs = [references] if isinstance(references, (str, int, float)) else list(references)
    if not refs:
        raise ValueError("judge needs at least one reference answer")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("equivalence.judge uses signal-based timeouts and must run in a main thread; "
                           "use grade_batch / GradingPool, which grade in worker processes")
    key = (answer, tuple(refs))
    if key in _VERDICTS:  # a group's G samples often give the same answer to the same question
        return _VERDICTS[key]
    try:
        with deadline(timeout_s) as clock:
            verdict = _judge(*key)
    except TimeoutException:
        return False, "timeout"
    if clock["expired"]:  # the alarm ended it inside math-verify, which turned it into False: no verdict
        return False, "timeout"
    if len(_VERDICTS) >= _CACHE_SIZE:
        _VERDICTS.pop(next(iter(_VERDICTS)))
    _VERDICTS[key] = verdict  # only verdicts reached in time are kept
    return verdict


_CACHE_SIZE = 8192
_VERDICTS: dict[tuple, tuple[bool, str]] = {}


def _judge(answer: str, refs: tuple) -> tuple[bool, str]:
    """The verdict (uncached; `judge` keeps those reached within the deadline)."""
    try:
        parsed = latex.parse(answer)
    except latex.NotWholeAnswer:
        # the grammar cannot read some honest answers (`E_1, E_2`); one written exactly as a reference is
        if not latex.hidden_characters(answer) and any(_verbatim(answer) == _verbatim(normalize_reference(r))
                                                       for r in refs):
            return True, "correct"
        return False, "parse_error"
    text = latex.canonical(answer)
    for ref in refs:
        ref_text = normalize_reference(ref)
        gold = parse_reference(ref_text)
        if gold is None or (latex.offers_alternatives(answer) and not latex.offers_alternatives(ref_text)):
            continue
        if not shape.compatible(shape.shape(latex.canonical(ref_text)), shape.shape(text)):
            continue
        if not relations_fit(gold, parsed):
            continue
        try:  # the deadline is judge's: math-verify's own whole-second alarm would replace it
            same = math_verify.verify(gold, parsed, timeout_seconds=None, raise_on_error=True)
        except Exception:  # noqa: BLE001  (incomparable objects: not equal)
            same = False
        if same and small_numbers_agree(gold, parsed) and same_base(ref, latex.clean(answer)):
            return True, "correct"
    return False, "mismatch"
