"""The final answer of a response: the last closed `\\boxed{...}` after `</think>` (R3-SPEC §3).

Pure string work in linear time, safe on untrusted text of any size: braces are matched with one
stack pass, so 10,000 nested braces or a megabyte of text cost one scan, never a recursion.
"""

from __future__ import annotations

import re

THINK_END = "</think>"
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def after_think(response: str) -> str | None:
    """The text after the last `</think>`, or None when the response never closed its reasoning."""
    end = response.rfind(THINK_END)
    return None if end < 0 else response[end + len(THINK_END):]


def matching_braces(text: str) -> dict[int, int]:
    """Index of each `{` -> index of its `}`; escaped `\\{` and `\\}` (LaTeX set braces) are text."""
    pairs, stack = {}, []
    for m in re.finditer(r"\\\\|\\[{}]|[{}]", text):  # `\\` first, so `\\}` is a line break then a brace
        tok = m.group()
        if tok == "{":
            stack.append(m.start())
        elif tok == "}" and stack:
            pairs[stack.pop()] = m.start()
    return pairs


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) whose braces close; None if there is none.

    "Last" is by opening position, so an unclosed box at the end of a cut-off response is ignored and
    the previous complete one counts.
    """
    opens = [m.end() - 1 for m in _BOX.finditer(text)]
    if not opens:
        return None
    pairs = matching_braces(text)
    for start in reversed(opens):
        if start in pairs:
            # ASCII whitespace only: str.strip() would also eat the control characters \x1c-\x1f, which
            # must reach the judge (an answer holding them is refused there)
            return text[start + 1:pairs[start]].strip(" \t\n\r\x0b\x0c")
    return None


def final_answer(response: str) -> tuple[str | None, str | None]:
    """(answer, None) or (None, reason) with reason `no_think_end` or `no_box`."""
    tail = after_think(response)
    if tail is None:
        return None, "no_think_end"
    answer = last_boxed(tail)
    if not answer:
        return None, "no_box"
    return answer, None
