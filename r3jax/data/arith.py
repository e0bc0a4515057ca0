"""The embedded default's task: left-to-right `+`/`−` chains, solved one step per line, graded like real math.

A problem is a chain read left to right (`Compute 30+7-5+9.`): a two-digit start, then operands 1..9, the
running value never below 0. Its careful solution writes one line per operation inside the thinking part and
then the boxed result, as a distilled reasoning model does:

    30+7=37
    37-5=32
    32+9=41
    </think>
    \\boxed{41}

A shortcut (`shortcut_solution`) stops writing lines (by default before the first) and boxes the answer straight
away, the rest done in the head. The warm start (`scripts/make_arith_base.py`) mixes both, so the base model has
a choice of strategy, and only one of them is reliable on long chains: that choice, not arithmetic, is what RL
can improve on every question, seen or not.

Difficulty is the number of operations (`LEVELS`): easy and medium chains fit the generation budget easily;
hard ones are long enough for slips and shortcuts to cost; a careful solution of an out-of-reach chain needs
more response tokens than `configs/arith.py` allows, so it ends truncated (what R³'s ranking reward, SERR, is
for) and only a lucky shortcut solves it. `splits(seed)` gives the fixed training set and disjoint held-out
sets per level; `write_assets` writes them where `configs/arith.py` reads them, bit for bit the same on every
machine.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import sys

FIRST_OPERAND = (10, 49)
MAX_OPERAND = 9

# level -> the numbers of operations its problems have
LEVELS = {"easy": (1, 2), "medium": (3,), "hard": (4, 5), "out_of_reach": (8,)}
# The warm start (scripts/make_arith_base.py) sees only chains the model could learn: no out-of-reach ones.
WARM_START_OPS = (1, 2, 3, 4, 5)
# RL trains on the levels a policy can solve; out-of-reach questions stay held out, a check that training does
# not teach the model to guess (no strategy fits their solution in the budget, so they only add noise to RL).
TRAIN_LEVELS = ("easy", "medium", "hard")
# how a wrong line is off: a carry or a borrow (±10), a digit (±1, ±2)
SLIPS = (-10, -2, -1, 1, 2, 10)
TRAIN_PER_LEVEL = 64
HELDOUT_PER_LEVEL = 64


@dataclasses.dataclass(frozen=True)
class Chain:
    """operands[0] op[0] operands[1] op[1] ... evaluated left to right."""

    operands: tuple[int, ...]
    ops: tuple[str, ...]

    def __post_init__(self):
        if len(self.operands) != len(self.ops) + 1 or not self.ops or set(self.ops) - {"+", "-"}:
            raise ValueError(f"a chain needs n >= 1 operations in '+-' and n + 1 operands, got {self}")

    @property
    def problem(self) -> str:
        rest = "".join(f"{o}{x}" for o, x in zip(self.ops, self.operands[1:], strict=True))
        return f"Compute {self.operands[0]}{rest}."

    def partial_results(self) -> list[int]:
        """The running value after each operation; the last one is the answer."""
        value, out = self.operands[0], []
        for op, x in zip(self.ops, self.operands[1:], strict=True):
            value = value + x if op == "+" else value - x
            out.append(value)
        return out

    @property
    def answer(self) -> int:
        return self.partial_results()[-1]


def random_chain(rng: random.Random, num_ops: int, max_operand: int = MAX_OPERAND) -> Chain:
    """A two-digit start (`FIRST_OPERAND`), then `num_ops` operands 1..max_operand; a `-` never takes the running
    value below 0, so no line holds a negative number. The answers spread widely: no value is a good guess."""
    value = rng.randint(*FIRST_OPERAND)
    operands, ops = [value], []
    for _ in range(num_ops):
        op = rng.choice("+-") if value > 0 else "+"
        x = rng.randint(1, max_operand if op == "+" else min(max_operand, value))
        value = value + x if op == "+" else value - x
        operands.append(x)
        ops.append(op)
    return Chain(tuple(operands), tuple(ops))


def solution_lines(chain: Chain, results: list[int] | None = None) -> list[str]:
    """One line `a+b=c` per operation, each starting from the previous line's result."""
    results = chain.partial_results() if results is None else results
    lines, left = [], chain.operands[0]
    for op, x, value in zip(chain.ops, chain.operands[1:], results, strict=True):
        lines.append(f"{left}{op}{x}={value}")
        left = value
    return lines


def response(lines: list[str], answer: int) -> str:
    """The assistant's text after the prompt's `<think>\\n`: the step lines, `</think>`, the boxed answer."""
    return "".join(line + "\n" for line in lines) + "</think>\n\\boxed{" + str(answer) + "}"


def worked_solution(chain: Chain) -> str:
    return response(solution_lines(chain), chain.answer)


def shortcut_solution(chain: Chain, written: int) -> str:
    """The careful solution's first `written` lines, then straight to the boxed answer: the rest of the chain is
    done in the head, which a small model gets right less often the more operations are left."""
    if not 0 <= written < len(chain.ops):
        raise ValueError(f"a shortcut writes 0..{len(chain.ops) - 1} of {chain.problem}'s lines, not {written}")
    return response(solution_lines(chain)[:written], chain.answer)


def strategy(text: str, num_ops: int) -> str:
    """What a response did: `careful` (a line per operation before `</think>`), `shortcut` (fewer lines, then the
    answer) or `unfinished` (no `</think>`: truncated or malformed)."""
    head, sep, _ = text.partition("</think>")
    if not sep:
        return "unfinished"
    return "careful" if sum("=" in line for line in head.splitlines()) >= num_ops else "shortcut"


def wrong_solution(chain: Chain, rng: random.Random) -> str:
    """A plausible failed attempt: one step's result is off by a small slip (a carry, a sign), and every later
    line carries the slip forward, so the boxed answer is wrong. (The warm start's reflection examples.)"""
    results = chain.partial_results()
    at = rng.randrange(len(results))
    slip = rng.choice(SLIPS)
    results = results[:at] + [r + slip for r in results[at:]]
    return response(solution_lines(chain, results), results[-1])


def level_of(num_ops: int) -> str:
    for name, counts in LEVELS.items():
        if num_ops in counts:
            return name
    raise ValueError(f"no level has {num_ops} operations; levels: {LEVELS}")


def row(chain: Chain) -> dict:
    """A problem-file row: what `r3jax.data.load_problems` reads, plus the level for reports."""
    return {"problem": chain.problem, "answer": str(chain.answer), "level": level_of(len(chain.ops)),
            "operations": len(chain.ops)}


def splits(seed: int = 0, *, train_per_level: int = TRAIN_PER_LEVEL,
           heldout_per_level: int = HELDOUT_PER_LEVEL) -> tuple[list[dict], dict[str, list[dict]]]:
    """(train rows, {level: held-out rows}): distinct problems, levels balanced, the same for a seed everywhere.
    Training rows come from `TRAIN_LEVELS` only (every level's chains are drawn, so held-out sets do not depend
    on which levels train).

    Each level's operation counts take turns, so a level with two counts holds as many of each."""
    rng = random.Random(seed)
    seen: set[str] = set()
    train, heldout = [], {}
    for name, counts in LEVELS.items():
        chains = []
        while len(chains) < train_per_level + heldout_per_level:
            chain = random_chain(rng, counts[len(chains) % len(counts)])
            if chain.problem not in seen:
                seen.add(chain.problem)
                chains.append(chain)
        train += [row(c) for c in chains[:train_per_level]]
        heldout[name] = [row(c) for c in chains[train_per_level:]]
    random.Random(seed + 1).shuffle(train)
    return [r for r in train if r["level"] in TRAIN_LEVELS], heldout


def write_assets(folder: str | pathlib.Path, seed: int = 0) -> None:
    """`train.jsonl` and `heldout_<level>.jsonl` for `configs/arith.py` (the tokenizer is the base model's)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train, heldout = splits(seed)
    files = {"train.jsonl": train, **{f"heldout_{name}.jsonl": rows for name, rows in heldout.items()}}
    for name, rows in files.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    write_assets(sys.argv[1] if len(sys.argv) > 1 else "configs/arith")
