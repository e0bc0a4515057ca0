"""A final answer's LaTeX parsed whole, or not at all.

math-verify's `parse` is built to find *an* answer in free text: when the whole boxed text does not
parse, it falls back to the last link of an equation chain and then to any `$...$` or `\\frac{a}{b}`
it can find inside. Fine for reading a benchmark's outputs, fatal for a reward: a policy that boxes
`\\frac{3}{2}\\frac{1}{2}` plus one unparseable character collects the reward for 1/2. Here the
answer text goes through a fixed list of rewrites that drop only decoration (whitespace, `$`, a
final period, `\\left`/`\\right`, digit-group spaces, trailing unit words), and then through
latex2sympy's grammar, which must consume all of it (its rule ends in EOF): otherwise the answer is
a parse error. Text a reader cannot see, candidates joined by "or", numbers written side by side and
boxes inside the box are refused before the grammar runs, because each would otherwise be read as
one number (latex2sympy adds juxtaposed numbers: `4 7` is 11).

Letters keep their case (`N` is not `n`); math-verify's comparison still ignores the case of
multi-letter names (`\\text{East}` = `\\text{east}`).
"""

from __future__ import annotations

import re
import unicodedata

from latex2sympy2_extended import latex2sympy2 as l2s
from math_verify.grader import should_treat_as_complex

# Unicode categories never part of an honest answer: control, format (zero-width and bidirectional
# marks, invisible operators), private use, surrogates, unassigned. Ordinary whitespace is allowed.
HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cs", "Cn"})
ORDINARY_WHITESPACE = frozenset(" \t\n\r\x0b\x0c")

# math-verify's rewrites that only respell (`\dfrac`, `\frac12`, `\left(`, `1/2`, `.5`); its unit
# stripping is left out (it drops any trailing `s`, `t`, `m`...: `5t` would read 5) and so are boxes.
_REWRITES = l2s.NormalizationConfig(basic_latex=True, units=False, malformed_operators=True, nits=True,
                                    boxed="none", equations=False)
_CONVERSION = l2s.ConversionConfig(lowercase_symbols=False)

_UNICODE_MATH = str.maketrans({"\u2212": "-", "\u00d7": "\\times ", "\u00b7": "\\cdot ", "\u03c0": "\\pi ",
                               "\u221e": "\\infty ", "\u2264": "\\le ", "\u2265": "\\ge ", "\u2260": "\\ne ",
                               "\u00b0": "^\\circ ", "\u221a": "\\sqrt "})
_DEGREE = re.compile(r"\\degree\b")
# 10\,000 / 10{,}000 / 10 000: a thousands separator only between groups of exactly three digits
_DIGIT_GROUPS = re.compile(r"(?<![\d.])\d{1,3}(?:(?:\\,|\\ |\\!|\{,\}| )\d{3})+(?![\d])")
_GROUP_SEPARATOR = re.compile(r"\\,|\\ |\\!|\{,\}| ")
# a trailing unit or word: \text{ cm}^2, \mbox{ inches}, \mathrm{kg}, \text{ kcal m}^{-2}
_UNIT = re.compile(r"\\(?:text|textrm|mbox|mathrm|rm)\s*\{([^{}]*)\}\s*(?:\^\s*(?:\{\s*-?\d+\s*\}|-?\d))?\s*$")
_UNIT_WORDS = re.compile(r"[A-Za-z][A-Za-z .\-/]*")
# words that hedge, compare or count are not units: "3 \text{ maybe}" is not 3
_HEDGE_WORDS = frozenset("""
    or and not either else otherwise alternatively instead maybe possibly perhaps probably likely approximately
    approx about roughly nearly almost around circa least most than unless except between to guess answer
    zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen
    seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand million
    billion half halves third thirds quarter quarters""".split())
_EDGE_SPACE = re.compile(r"^(?:\\[,;: !]|\\q?quad(?![A-Za-z])|~|\s)+|(?:\\[,;: !]|\\q?quad(?![A-Za-z])|~|\s)+$")
_TRAILING_SPACE = re.compile(r"(?:\\[,;: !]|\\q?quad|~|\s)+$")
_ALTERNATIVE = re.compile(r"(?<![A-Za-z\\])or(?![A-Za-z])")
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# candidates set side by side: wide spaces and line breaks outside a matrix
_SEPARATORS = re.compile(r"\\q?quad(?![A-Za-z])|\\hspace|\\enspace|\\\\|;")
_MATRIX = re.compile(r"\\begin\{[a-zA-Z]*matrix\}|\\begin\{array\}")
# numbers side by side: `4 7`, `(3) 7`, `4 \; 7` (latex2sympy would add them)
_SPACING = re.compile(r"\\[,;:! ]|~")
_JUXTAPOSED = re.compile(r"(?:\d\.?|\(\s*[-+]?[\d.]+\s*\))\s+[(\[]?\s*[-+]?\.?\d")


class NotWholeAnswer(ValueError):
    """The text is not one answer the grammar reads completely."""


def hidden_characters(text: str) -> list[str]:
    """Names of the characters in `text` whose Unicode category is control/format/private/unassigned."""
    return [unicodedata.name(c, f"U+{ord(c):04X}") for c in text
            if unicodedata.category(c) in HIDDEN_CATEGORIES and c not in ORDINARY_WHITESPACE]


def offers_alternatives(text: str) -> bool:
    """`3 \\text{ or } 4`, `3 (or 4)`: the answer hedges between candidates."""
    return bool(_ALTERNATIVE.search(text))


def clean(text: str) -> str:
    """Decoration dropped: other spaces as plain spaces, Unicode math as LaTeX, `$` delimiters,
    digit-group separators, degree signs, one final period, surrounding whitespace."""
    text = "".join(" " if unicodedata.category(c) in ("Zs", "Zl", "Zp") else c for c in text)
    text = re.sub(r"(?<!\\)\$", "", text.translate(_UNICODE_MATH))
    text = _EDGE_SPACE.sub("", text)
    text = _DIGIT_GROUPS.sub(lambda m: _GROUP_SEPARATOR.sub("", m.group()), text)
    text = _DEGREE.sub(lambda _: "^\\circ", text)
    if text.endswith(".") and not text.endswith("\\."):
        text = text[:-1].rstrip()
    return text


def strip_units(text: str) -> str:
    """Trailing `\\text{...}` unit words (each with an optional integer power) removed, as long as an
    answer remains in front of them: `7 \\text{ apples}` -> `7`, `\\text{Evelyn}` stays."""
    while True:
        m = _UNIT.search(text)
        rest = text[:m.start()] if m else ""
        words = m.group(1).strip() if m else ""
        if (not m or not _UNIT_WORDS.fullmatch(words) or _HEDGE_WORDS & set(re.findall(r"[a-z]+", words.lower()))
                or not _TRAILING_SPACE.sub("", rest).strip()):
            return text
        text = _TRAILING_SPACE.sub("", rest)


def refusal(text: str) -> str | None:
    """Why the cleaned `text` cannot be one honest answer, or None."""
    if _BOX.search(text):
        return "a box inside the answer"
    if not _MATRIX.search(text) and _SEPARATORS.search(text):
        return "candidates separated by wide spaces, line breaks or semicolons"
    if _JUXTAPOSED.search(_SPACING.sub(" ", text)):
        return "numbers side by side"
    return None


def canonical(text: str) -> str:
    """`clean`, units stripped, then math-verify's respelling rewrites (no unit or box handling)."""
    return l2s.normalize_latex(strip_units(clean(text)), _REWRITES).strip()


def parse(text: str):
    """The sympy value of the whole of `text`; raises NotWholeAnswer when the grammar cannot read
    all of it (or the text is refused). No time limit of its own: `equivalence.judge` bounds the whole
    judgement."""
    hidden = hidden_characters(text)
    why = f"hidden characters: {', '.join(sorted(set(hidden)))}" if hidden else refusal(clean(text))
    if why is None:
        text = canonical(text)
        why = refusal(text) or ("empty" if not text else None)
    if why is not None:
        raise NotWholeAnswer(why)

    try:  # math-verify's TimeoutException is a BaseException: a deadline passes through
        return l2s.latex2sympy(text, is_real=not should_treat_as_complex(text), convert_degrees=False,
                               normalization_config=None, conversion_config=_CONVERSION)
    except Exception as e:  # noqa: BLE001  (the grammar's syntax errors, sympy's, MemoryError)
        raise NotWholeAnswer(str(e).splitlines()[0] if str(e) else type(e).__name__) from e
