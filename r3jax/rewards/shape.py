"""The outer form of an answer: a value, a collection, or a bracketed tuple/interval.

sympy forgets how an answer was written: `(1,2)` becomes an open interval, `\\{1,2\\}` and a bare
`1, 2` both become a FiniteSet, and math-verify then compares an interval with a set element by
element and calls them equal. The written form is the model's claim, so it is read from the text:

- `\\{...\\}` and a bare comma list are both a **collection** (unordered): data sets write "all
  solutions" as a bare list and models write them either way, so the two are taken as one kind;
- `(a, b, ...)`, `[a, b]`, `[a, b)`, `(a, b]` and `\\langle a, b \\rangle` are **brackets** of that
  exact pair: `(1,2)` is a tuple or an open interval and stays ambiguous between those two only
  (they are written the same), never equal to `[1,2]` or to a set;
- an inequality (`x > 3`, `1 < x \\le 2`) is a **region**, which an interval or a union may spell;
- anything else is a **value**; a one-element collection also passes for its value.

Shapes nest (a list of tuples is a collection of brackets) and are compared element by element, so
`(1,2), (3,4)` is not `\\{1,2\\}, \\{3,4\\}`. A `\\pm` leaves the number of elements open.
"""

from __future__ import annotations

import re

VALUE = ("value",)
REGION = ("region",)
_TOKEN = re.compile(r"\\\\|\\[{}]|\\[lr]angle(?![A-Za-z])|\\[A-Za-z]+|\\.|[{}()\[\],]|[^{}()\[\],\\]+")
_OPEN = {"{", "(", "[", "\\{", "\\langle"}
_CLOSE = {"}", ")", "]", "\\}", "\\rangle"}
_NAME = re.compile(r"^\s*[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?\s*(?:=|\\in(?![A-Za-z]))(?!.*=)\s*", re.DOTALL)
_PLUS_MINUS = re.compile(r"\\(?:pm|mp)(?![A-Za-z])")
_INEQUALITY = re.compile(r"<|>|\\(?:le|ge|leq|geq|lt|gt|leqslant|geqslant)(?![A-Za-z])")
_COMMA_NUMBER = re.compile(r"\s*-?\d{1,3}(?:,\d{3})+(?:\.\d+)?\s*")  # 10,000 (latex2sympy reads it so too)


def split_top(text: str) -> list[str]:
    """`text` cut at the commas outside every bracket and brace."""
    parts, depth, start = [], 0, 0
    for m in _TOKEN.finditer(text):
        tok = m.group()
        depth += (tok in _OPEN) - (tok in _CLOSE)
        if tok == "," and depth == 0:
            parts.append(text[start:m.start()])
            start = m.end()
    return [*parts, text[start:]]


def enclosure(text: str) -> tuple[str, str, str] | None:
    """(opening, closing, inside) when one bracket pair encloses all of `text`, else None."""
    tokens = [m for m in _TOKEN.finditer(text.strip()) if m.group().strip()]
    if len(tokens) < 2 or tokens[0].group() not in _OPEN - {"{"}:
        return None
    depth = 0
    for i, m in enumerate(tokens):
        depth += (m.group() in _OPEN) - (m.group() in _CLOSE)
        if depth == 0:
            if i != len(tokens) - 1 or m.group() == "}":
                return None
            body = text.strip()
            return tokens[0].group(), m.group(), body[tokens[0].end():m.start()]
    return None


def shape(text: str) -> tuple:
    """The nested form of an answer's text (after `latex.canonical`), as a comparable tuple."""
    text = _NAME.sub("", text, count=1)  # x = 3, x \in [1, 2]: the name is not part of the form
    parts = split_top(text)
    if len(parts) > 1 and not _COMMA_NUMBER.fullmatch(text):
        return _collection(parts)
    outer = enclosure(text)
    if outer is not None:
        opening, closing, inside = outer
        if opening == "\\{":
            return _collection(split_top(inside))
        items = split_top(inside)
        if len(items) > 1:
            return ("brackets", opening + closing, tuple(shape(p) for p in items))
    if _INEQUALITY.search(text):
        return REGION
    return ("collection", None) if _PLUS_MINUS.search(text) else VALUE


def _collection(parts: list[str]) -> tuple:
    if any(_PLUS_MINUS.search(p) for p in parts):
        return ("collection", None)  # 1 \pm \sqrt{5}, -2 has three elements
    return ("collection", tuple(sorted(shape(p) for p in parts)))


def compatible(reference: tuple, answer: tuple) -> bool:
    """Whether an answer of form `answer` may equal a reference of form `reference`."""
    if reference == answer:
        return True
    if reference[0] == answer[0] == "collection":
        return reference[1] is None or answer[1] is None
    if reference == REGION:  # math-verify turns the inequality into a set only when the answer is one
        return answer == VALUE or (answer[0] == "brackets" and len(answer[2]) == 2)
    singleton = ("collection", (VALUE,))
    return {reference, answer} == {VALUE, singleton}
