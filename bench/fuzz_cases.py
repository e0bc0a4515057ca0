"""The grader fuzzer's cases (bench/fuzz_grader.py runs them): one seeded generator per way a response could be
paid for something other than its reference, each yielding (response, reference, equal_by_construction).
Labels come from how the text was built, never from a second grader. References: a fixed varied pool, plus
MATH-500's answers when ../shared/data/rllm/test/math.json exists.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import re
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "rllm" / "test" / "math.json"
MEGABYTE_CASES = 10  # ~1 MB responses are slow to build and scan: a handful per run


@dataclasses.dataclass(frozen=True)
class Ref:
    """A reference and what the generators may assume about it. `scalar`: adding a number is arithmetic (not
    a tuple, set, interval, equation, percentage or unknown text), so `ref + 0` is the reference. `value`:
    its size when it is a plain number, so a wrong offset can be kept well above the grader's rounding."""
    text: str
    value: float | None = None
    scalar: bool = False
    honest: tuple[str, ...] = ()  # respellings that must be credited


@dataclasses.dataclass(frozen=True)
class Case:
    category: str
    response: str
    reference: str
    expected: bool  # equal by construction


SYNTHETIC = [
    Ref("7", 7, True, ("7.", "7 \\text{ apples}", "x = 7", "07", "7.0")),
    Ref("25", 25, True, ("25.", "x = 25", "025", "25.0", "25 \\text{ cm}")),
    Ref("142", 142, True, ("142.", "142 \\text{ apples}", "x = 142", "0142", "142.0")),
    Ref("025", 25, True, ("25", "25.0", "x = 25")),
    Ref("\\frac{1}{2}", 0.5, True, ("\\tfrac12", "0.5", "1/2", "\\dfrac{2}{4}", "\\frac{1}{2}.", "\\frac12",
                                    "\\left(\\frac{1}{2}\\right)")),
    Ref("\\frac{3}{4}", 0.75, True, ("0.75", "3/4", "\\dfrac{6}{8}", "\\tfrac34")),
    Ref("2\\sqrt{5}", 2 * math.sqrt(5), True, ("\\sqrt{20}", "2 \\sqrt{5}", "2\\sqrt5", "2 \\cdot \\sqrt{5}")),
    Ref("\\frac{\\pi}{2}", math.pi / 2, True, ("\\pi/2", "\\frac{1}{2}\\pi", "\\dfrac{\\pi}{2}")),
    Ref("2\\pi", 2 * math.pi, True, ("2 \\pi", "\\pi \\cdot 2")),
    Ref("x^2+1", None, True, ("1+x^2", "x^{2}+1", "x^2 + 1")),
    Ref("(1,2)", honest=("(1, 2)", "\\left(1,2\\right)", "\\left( 1, 2 \\right)")),
    Ref("[0, \\infty)", honest=("[0,\\infty)", "\\left[0, \\infty\\right)", "x \\in [0, \\infty)")),
    Ref("[1,2)", honest=("[1, 2)", "\\left[1,2\\right)")),
    Ref("\\{1, 2, 3\\}", honest=("\\{3, 2, 1\\}", "\\left\\{1,2,3\\right\\}", "1, 2, 3")),
    Ref("y=2x+3", honest=("y = 2x+3", "y=3+2x", "y = 2 x + 3")),
    Ref("80\\%", honest=("80", "80 \\%")),
]
WRONG = ("1000003", "-\\frac{9973}{7919}", "\\sqrt{1009}", "(17, -23)", "\\{101, 103\\}", "w^3-11", "17q+5")
WORDS = "so we compute the sum then factor and check each case carefully since x y n = + - 2 3 7".split()
LEADS = ("The answer is ", "Therefore, the final answer is ", "So we get ", "**Final Answer**\n")


def data_ref(text: str) -> Ref:
    """A MATH-500 answer: plain integers, decimals and fractions get a value and numeric respellings;
    anything else is opaque text that only gets constructions whose label cannot depend on its kind."""
    if re.fullmatch(r"-?\d+", text):
        extra = ("0" + text,) if not text.startswith("-") else ()
        return Ref(text, int(text), True, (f"{text}.0", f"x = {text}") + extra)
    if re.fullmatch(r"-?\d*\.\d+", text):
        return Ref(text, float(text), True, (text + "0",))
    if (m := re.fullmatch(r"(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}", text)) and int(m[3]):
        return Ref(text, int(m[2]) / int(m[3]) * (-1 if m[1] else 1), True, (f"{m[1]}{m[2]}/{m[3]}",))
    return Ref(text)


def references(use_data: bool = True) -> list[Ref]:
    """The fixed pool, repeated so it stays about half of the draws when MATH-500's answers join it."""
    refs = list(SYNTHETIC)
    if use_data and DATA.is_file():
        from r3jax.data import problems
        texts = sorted({str(p.answers[0]).strip() for p in problems.load_problems(DATA)})
        refs = refs * max(1, len(texts) // len(refs)) + [data_ref(t) for t in texts if t]
    return refs


def reasoning(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))


def respond(rng: random.Random, boxed: str) -> str:
    """A real-looking response whose final answer is `\\boxed{boxed}`."""
    return f"<think>{reasoning(rng)}</think> {rng.choice(LEADS)}$\\boxed{{{boxed}}}$."


def wrong_for(rng: random.Random, ref: Ref) -> str:
    return rng.choice([w for w in WRONG if w != ref.text])


def as_term(ref: Ref) -> str:
    return f"({ref.text})" if ref.text.startswith("-") else ref.text


CANDIDATES = ("3", "4", "9", "12", "-5", "\\frac{3}{2}", "\\frac{1}{3}", "\\sqrt{2}", "2\\sqrt{3}", "\\pi", "(3,4)",
              "x+1")
SEPARATORS = ("", " ", ", ", "\\,", "\\;", " \\quad ", " \\text{ or } ", " or ", "; ", " \\\\ ", "~", " \\text{ and } ")


def gen_concat(rng, refs, n):
    """Several candidates with the reference among them, side by side or hedged (`or`, `;`, `\\quad`,
    `(or 4)`), maybe followed by a character no parser accounts for. Paying for any of them teaches a
    policy to hedge, so only the reference alone is equal. Candidates are never 0, 1 or part of the reference
    and a reference of 0 is left out, so no juxtaposition is a genuine product or sum equal to it."""
    refs = [r for r in refs if r.value != 0]
    for _ in range(n):
        ref, roll = rng.choice(refs), rng.random()
        if roll < 0.1:
            yield respond(rng, ref.text), ref.text, True
        elif roll < 0.2:
            yield respond(rng, ref.text + rng.choice(("\u2063", "#", "@"))), ref.text, False
        else:
            others = [c for c in CANDIDATES if c not in ref.text]  # `3, 3, 5, 7` might read as the set {3, 5, 7}
            parts = rng.sample(others, min(len(others), rng.randint(1, 3))) + [ref.text]
            rng.shuffle(parts)
            if rng.random() < 0.15:
                text = parts[0] + "".join(f" (or {p})" for p in parts[1:])
            else:
                text = rng.choice(SEPARATORS).join(parts)
            yield respond(rng, text + rng.choice(("", "", "\u2063", "#", "\\%"))), ref.text, False


TERMS = (("1", 1.0), ("2", 2.0), ("3", 3.0), ("0.25", 0.25), ("\\frac{1}{2}", 0.5), ("\\tfrac12", 0.5),
         ("\\frac{7}{3}", 7 / 3), ("\\sqrt{2}", math.sqrt(2)), ("\\pi", math.pi), ("10", 10.0))
JUNK = ("\\{1,2\\}", "\\%", "\\sum_{n=1}^{\\infty} n", "\\int_0^1 x\\,dx", "\\tfrac12", "\\sqrt{2}", "\\frac{1}{2}")


def gen_sums(rng, refs, n):
    """Sums with the reference among the terms. `ref + 0` and `ref + a - a` are the reference (scalars
    only); `ref + a` with a known nonzero `a` is not: |a| stays >= 1e-3 of the reference's size, since the
    grader rounds numbers to 6 decimals (a documented limit, not what this probes). A sum with a set, a
    lone `\\%` or a divergent series in it (the issue's example) is nonsense whatever else it holds."""
    for _ in range(n):
        ref, roll = rng.choice(refs), rng.random()
        if roll < 0.3 or not ref.scalar:
            terms = [rng.choice(JUNK[:2])] + rng.sample(JUNK[2:], rng.randint(1, 4))
            terms.insert(rng.randint(0, len(terms)), as_term(ref))
            yield respond(rng, "+".join(terms) + rng.choice(("", "+0."))), ref.text, False
        elif roll < 0.6:
            a, r = rng.choice(TERMS)[0], as_term(ref)
            forms = (f"{r} + 0", f"0 + {r}", f"{r} + {a} - {a}", f"{a} + {r} - {a}", f"{r} - {a} + {a}")
            yield respond(rng, rng.choice(forms)), ref.text, True
        else:
            terms = [(rng.choice((1, -1)), *rng.choice(TERMS)) for _ in range(rng.randint(1, 3))]
            scale = max(1.0, abs(ref.value)) if ref.value is not None else 1.0
            if abs(sum(s * v for s, _, v in terms)) < 1e-3 * scale:  # cancelled out, or small beside ref
                terms.append((1, f"10^{{{math.ceil(math.log10(scale))}}}", 10.0 ** math.ceil(math.log10(scale))))
            signed = "".join(f" {'+' if s > 0 else '-'} {t}" for s, t, _ in terms)
            text = as_term(ref) + signed
            if terms[0][0] > 0 and rng.random() < 0.5:
                text = f"{terms[0][1]} + {as_term(ref)}" + signed[len(f" + {terms[0][1]}"):]
            yield respond(rng, text), ref.text, False


# Control (Cc) and format (Cf) characters: zero-width, bidirectional, invisible operators, BOM, soft hyphen,
# C0 (not \t \n \r, nor \v \f, ordinary whitespace to Python and to the grader's policy) and C1 controls.
INVISIBLE = tuple("\u200b\u200c\u200d\u200e\u200f\u2060\u2061\u2062\u2063\u2064\ufeff\u00ad\u061c\u180e") + tuple(
    map(chr, [*range(0x202A, 0x202F), *range(0x2066, 0x206A), *(c for c in range(0x20) if c not in range(9, 14)),
              *range(0x7F, 0xA0)]))


def gen_invisible(rng, refs, n):
    """The reference (or a wrong answer) with characters a reader cannot see inserted at its start, end or
    anywhere inside: a bidi override can make a wrong answer read as the right one, so an answer holding
    any is a parse error (never credited). One in ten hides the mark between `\\boxed` and its brace."""
    for _ in range(n):
        ref = rng.choice(refs)
        text = ref.text if rng.random() < 0.8 else wrong_for(rng, ref)
        for _ in range(rng.randint(1, 3)):
            at = rng.choice((0, len(text), rng.randint(0, len(text))))
            text = text[:at] + rng.choice(INVISIBLE) + text[at:]
        if rng.random() < 0.1:  # not a box at all (whitespace there would be allowed: `\boxed {7}`)
            mark = rng.choice([c for c in INVISIBLE if not c.isspace()])
            yield f"<think>{reasoning(rng)}</think> \\boxed{mark}{{{ref.text}}}", ref.text, False
        else:
            yield respond(rng, text), ref.text, False


BOXES = (  # (text after `</think> The answer is `, equal?) by the rule: the last box by opening position that closes
    ("\\boxed{{{r}", False), ("\\boxed{{{w}}}\\boxed{{{r}", False), ("\\boxed{{{r}}}\\boxed{{{w}", True),
    ("}}}}}}\\boxed{{{r}}}", True), ("\\boxed{{{r}}}}}}}}}", True), ("{{{{{{\\boxed{{{r}}}", True),
    ("\\fbox{{{r}}}", True), ("\\boxed {{{r}}}", True), ("\\boxed{{{w}}} \\fbox{{{r}}}", True),
    ("\\fbox{{{r}}} \\boxed{{{w}}}", False), ("\\boxed{{{r}}} \\boxed{{}}", False), ("\\boxed{{{r}\\}}", False),
    ("\\boxed{{{w}}} then \\boxed{{{r}}}", True), ("\\boxed{{{r}}} then \\boxed{{{w}}}", False),
    ("\\boxed{{{r}}} and not \\boxed {w}", True),
    # nested: the inner box opens last, so it is the answer; the outer box's other content is never read
    ("\\boxed{{\\boxed{{{w}}} {r}}}", False), ("\\boxed{{{r} \\boxed{{{w}}}}}", False),
    ("\\boxed{{\\boxed{{{r}}}}}", True), ("\\boxed{{\\fbox{{{r}}}}}", True), ("\\boxed{{{w} \\boxed{{{r}}}}}", True),
    ("\\boxed{{\\text{{\\boxed{{{r}}}}}}}", True),
)


def gen_boxes(rng, refs, n):
    """Unbalanced and nested boxes, labelled by the documented rule: the final answer is the content of the
    last `\\boxed{}`/`\\fbox{}` after the last `</think>` whose braces close, "last" by opening position
    (extract.last_boxed): an unclosed box at the end is ignored, and of nested boxes the innermost counts.
    So `\\boxed{3 \\boxed{7}}` reads 7, no more than `\\boxed{3} \\boxed{7}` already gets."""
    for _ in range(n):
        ref = rng.choice(refs)
        template, equal = rng.choice(BOXES)
        answer = template.format(r=ref.text, w=wrong_for(rng, ref))
        yield f"<think>{reasoning(rng)}</think> The answer is {answer}.", ref.text, equal


THINK = (  # {t}: reasoning; only a closed box after the LAST `</think>` counts
    ("<think>{t} \\boxed{{{r}}} {t}</think> So that is it.", False),
    ("<think>{t} \\boxed{{{r}}}</think> The answer is $\\boxed{{{w}}}$.", False),
    ("<think>{t} \\boxed{{{w}}}</think> The answer is $\\boxed{{{r}}}$.", True),
    ("<think>{t} The answer is $\\boxed{{{r}}}$.", False), ("{t} The answer is $\\boxed{{{r}}}$.", False),
    ("<think>{t}</think> $\\boxed{{{r}}}$ </think> {t}", False),
    ("<think>{t}</think> $\\boxed{{{r}}}$ </think> $\\boxed{{{w}}}$", False),
    ("<think>{t}</think> $\\boxed{{{w}}}$ </think> $\\boxed{{{r}}}$", True),
    ("<think>{t}</think>{t}</think>{t}</think> The answer is $\\boxed{{{r}}}$.", True),
    ("<think>{t}</think> The answer is $\\boxed{{{r}</think>}}$.", False),
    ("<think>{t}</think> <think>{t} $\\boxed{{{r}}}$", True),
    ("<think>{t}</THINK> $\\boxed{{{r}}}$", False), ("<think>{t}</ think> $\\boxed{{{r}}}$", False),
    ("<think>{t}</think> $\\boxed{{{r}}}$ <think>{t}</think> no box here", False),
    ("</think>\\boxed{{{r}}}", True),
)


def gen_think(rng, refs, n):
    """Boxes in the reasoning, none or several `</think>`: a box before the last `</think>` is thinking out
    loud, never the answer."""
    for _ in range(n):
        ref = rng.choice(refs)
        template, equal = rng.choice(THINK)
        yield template.format(t=reasoning(rng), r=ref.text, w=wrong_for(rng, ref)), ref.text, equal


INJECTIONS = (
    "__import__('os').system('touch {f}')", "exec(\"open('{f}','w').write('x')\")",
    "eval(\"__import__('os').system('touch {f}')\")", "open('{f}','w')", "().__class__.__bases__[0].__subclasses__()",
    "(lambda: __import__('os').system('touch {f}'))()", "__import__('subprocess').call(['touch', '{f}'])",
    "Symbol('x').__class__.__init__.__globals__['os'].system('touch {f}')", "S('open(\"{f}\",\"w\")')",
    "\\operatorname{{sympify}}(\\text{{__import__('os').system('touch {f}')}})", "\\input{{{f}}}", "\\include{{{f}}}",
    "\\write18{{touch {f}}}", "\\immediate\\write18{{touch {f}}}", "\\def\\x{{\\immediate\\write18{{touch {f}}}}}\\x",
    "\\openout1={f} \\write1{{x}} \\closeout1", "$(touch {f})", "`touch {f}`", "; touch {f}", "| touch {f}",
)


def gen_injection(rng, refs, n, watch_dir):
    """Code for Python, sympy, TeX or a shell inside the box, each writing a file of its own name: in the
    watched folder, or (one in four) a bare name, which lands in the workers' or the fuzzer's working
    folder. The driver counts files afterwards; model text must only ever reach a LaTeX grammar."""
    for i in range(n):
        ref = rng.choice(refs)
        name = f"pwned{i}" if rng.random() < 0.25 else os.path.join(watch_dir, f"pwned{i}")
        code = rng.choice(INJECTIONS).format(f=name)
        text = rng.choice((code, code, f"{ref.text} + {code}", f"{code} = {ref.text}", f"\\text{{{code}}}"))
        yield respond(rng, text), ref.text, False


HUGE = ("9^{9^{9^{9}}}", "10^{10^{10}}!", "(10^{100})!", "2^{2^{2^{30}}}", "\\binom{10^{9}}{10^{5}}",
        "\\prod_{k=1}^{10^{9}} k", "10^{10^{10^{10}}}", "\\sum_{k=1}^{10^{12}} k^{k}", "e^{e^{e^{e^{e}}}}",
        "\\Gamma(10^{10})", "(x+1)^{10^{6}}", "(10^{10})!!", "{10^{10}}^{10^{10}}")


def gen_huge(rng, refs, n):
    """Numbers no grader can afford to compute, alone, added to the reference or chained to it with `=`:
    all unequal. They probe the time bound: each must end as a timeout, not a stall."""
    for _ in range(n):
        ref, huge = rng.choice(refs), rng.choice(HUGE)
        forms = (huge, f"{huge} = {ref.text}") + ((f"{as_term(ref)} + {huge}", f"{huge} + {as_term(ref)}")
                                                   if ref.scalar else ())
        yield respond(rng, rng.choice(forms)), ref.text, False


LONG = "so we compute the sum " * 46000  # ~1 MB of reasoning
MEGABYTE = (  # (build(reference, wrong, reasoning), equal?)
    (lambda r, w, t: f"<think>{LONG}</think> The answer is $\\boxed{{{r}}}$.", True),
    (lambda r, w, t: f"<think>{LONG}</think> The answer is $\\boxed{{{w}}}$.", False),
    (lambda r, w, t: f"<think>{t}</think> $\\boxed{{{'1+' * 500000}{r}}}$", False),
    (lambda r, w, t: f"<think>{t}</think> $\\boxed{{{'{' * 100000}{w}{'}' * 100000}}}$", False),
    (lambda r, w, t: f"<think>{t}</think> {'{' * 100000} $\\boxed{{{r}}}$", True),
    (lambda r, w, t: f"<think>{t}</think> $\\boxed{{{r}}}$ {'}' * 100000}", True),
    (lambda r, w, t: f"<think>{t}</think> $\\boxed{{{'{' * 100000}{r}", False),
    (lambda r, w, t: "</think>" * 130000 + f"\\boxed{{{r}}}", True),
    (lambda r, w, t: f"<think>{t}</think> " + f"\\boxed{{{w}}} " * 70000 + f"\\boxed{{{r}}}", True),
    (lambda r, w, t: f"<think>{t}</think> \\boxed{{{r}{chr(0x200B) * 500000}}}", False),
)


def gen_megabyte(rng, refs, n):
    """~1 MB responses: long reasoning, a long box, 100,000 braces open or closed around the box, a megabyte
    of `</think>` or of boxes. Extraction must stay linear, and an answer over the grader's length limit is
    not an answer (so no equal case puts the reference inside a long box)."""
    start = rng.randrange(len(MEGABYTE))
    for i in range(n):
        ref = rng.choice(refs)
        build, equal = MEGABYTE[(start + i) % len(MEGABYTE)]
        yield build(ref.text, wrong_for(rng, ref), reasoning(rng)), ref.text, equal


def gen_random_printable(rng, refs, n):
    """Random printable ASCII in the box, around it, or as the whole response. Equal only if the boxed
    string happens to be the reference's text (lengths from 4 make a chance respelling negligible)."""
    printable = [chr(c) for c in range(32, 127)]
    for _ in range(n):
        ref, roll = rng.choice(refs), rng.random()
        text = "".join(rng.choices(printable, k=rng.randint(4, 40)))
        if roll < 0.25:
            yield "".join(rng.choices(printable, k=rng.randint(20, 400))), ref.text, False
        elif roll < 0.5:
            noise = "".join(rng.choices(printable, k=rng.randint(4, 40)))
            response = f"<think>{reasoning(rng)}</think> {noise} \\boxed{{{text}}} {noise}"
            yield response, ref.text, text.strip() == ref.text
        else:
            yield respond(rng, text), ref.text, text.strip() == ref.text


def gen_random_unicode(rng, refs, n):
    """Random code points from every plane (lone surrogates included: the pool sends JSON, whose default
    ASCII escaping carries them as `\\udxxx`) in the box or as the whole response; half from the BMP."""
    for _ in range(n):
        ref = rng.choice(refs)
        top = rng.choice((0x10FFFF, 0xFFFF))
        text = "".join(chr(rng.randint(0, top)) for _ in range(rng.randint(1, 12)))
        if rng.random() < 0.2:
            yield text * rng.randint(1, 20), ref.text, False
        else:
            yield respond(rng, text), ref.text, text.strip() == ref.text


def gen_honest(rng, refs, n):
    """Honest respellings of the reference (`\\tfrac12`, `0.5`, `x = 7`, `7 \\text{ apples}`, `(1, 2)`...),
    maybe in `$...$`, padded or with a final period: these must be credited, or the fixes above cost real
    answers their reward."""
    for _ in range(n):
        ref = rng.choice(refs)
        text = rng.choice((ref.text, *ref.honest))
        wrap = rng.choice(("{}", "{}", "${}$", "  {}  ", "{}."))
        if "$" in text or text.endswith("."):  # one decoration at a time: `$25.$` is not what this is about
            wrap = "{}"
        yield respond(rng, wrap.format(text)), ref.text, True


GENERATORS = {"concat": gen_concat, "sums": gen_sums, "invisible": gen_invisible, "boxes": gen_boxes,
              "think": gen_think, "injection": gen_injection, "huge": gen_huge, "megabyte": gen_megabyte,
              "random_printable": gen_random_printable, "random_unicode": gen_random_unicode, "honest": gen_honest}
CATEGORIES = tuple(GENERATORS)


def cases(seed: int = 0, per_category: int | dict = 1000, *, categories=CATEGORIES, use_data: bool = True,
          watch_dir: str | None = None) -> list[Case]:
    """The run's cases: per_category of each (a dict names a count per category; megabyte is capped at
    MEGABYTE_CASES). Each category draws from its own seeded stream, so selecting fewer categories leaves
    the others' cases unchanged."""
    refs = references(use_data)
    watch_dir = watch_dir or os.path.join(tempfile.gettempdir(), "fuzz-grader-watch")
    out = []
    for name in categories:
        n = per_category.get(name, 0) if isinstance(per_category, dict) else per_category
        n = min(n, MEGABYTE_CASES) if name == "megabyte" else n
        rng = random.Random(f"{seed}:{name}")
        extra = (watch_dir,) if name == "injection" else ()
        out += [Case(name, *item) for item in GENERATORS[name](rng, refs, n, *extra)]
    return out
