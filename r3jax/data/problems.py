"""Math problem sets: one record type (`Problem`), one container (`ProblemSet`) and one loader.

`load_problems` reads a JSON array, JSON lines, parquet, or a Hugging Face hub dataset and maps each row
to a `Problem` by the row's schema, so the common math RL files load without per-file flags:

    problem text   `problem`, else `question`, else `extra_info.question`, else the last user message of
                   `prompt` (a list of {role, content} chat messages)
    answers        `answer` (a string, a number, or a list of acceptable answers); if `answer` is null,
                   the `#### 1,234` line that ends a GSM8K `solution`; else `reward_model.ground_truth`;
                   else `gt_answer`

Every answer string is stripped and loses one surrounding `$...$` (OlympiadBench writes `$2^{1009}$`); a
string holding a GSM8K worked solution (hub `openai/gsm8k` puts it in `answer`) becomes the number after its
last `####`, without thousands commas. Integral floats become integers (AMC's `142.0` is "142"); strings are
never parsed as numbers, so AIME's "025" stays "025".

A question's `uid` is a content hash of its whitespace-normalised text, so the same question gets the same
id in every file and every order. Its dense index (`ProblemSet.index_of`) is its position in the set.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

# A hub dataset id: "owner/name", no further slashes (a local path with more parts is a missing file).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_JSON_SUFFIXES = (".json", ".jsonl", ".ndjson")
_PARQUET_SUFFIXES = (".parquet",)


class DataError(ValueError):
    """A problem file or hub dataset that cannot be read, or a row that does not describe a problem."""


class RowIssue(NamedTuple):
    """One row that was skipped or merged, and why. From a file: the file, its 0-based row and, in a JSON-lines
    file, its 1-based line (as editors count). From `merge`: the problem's source and its position in its set."""

    file: str
    row: int
    reason: str
    line: int | None = None

    @property
    def where(self) -> str:
        return f"line {self.line}" if self.line is not None else f"row {self.row}"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One question with its acceptable final answers (any of them is correct)."""

    uid: str
    problem: str
    answers: tuple[str, ...]
    source: str


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What a load did. `rows` were read; `kept` problems came out; every other row is listed with a reason:
    `skipped` malformed rows (only with on_error="skip") and `duplicates` merged into an earlier question."""

    rows: int = 0
    kept: int = 0
    skipped: tuple[RowIssue, ...] = ()
    duplicates: tuple[RowIssue, ...] = ()

    def summary(self) -> str:
        return (f"{self.rows} rows read, {self.kept} problems kept, {len(self.skipped)} malformed rows skipped, "
                f"{len(self.duplicates)} duplicates merged")


@dataclasses.dataclass(frozen=True)
class ProblemSet:
    """An ordered set of problems with distinct uids. A problem's position is its dense question index."""

    problems: tuple[Problem, ...]
    report: LoadReport | None = None  # None: a set built by hand, reported as len(problems) rows kept
    _index: dict[str, int] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.report is None:
            object.__setattr__(self, "report", LoadReport(rows=len(self.problems), kept=len(self.problems)))
        index = {}
        for i, p in enumerate(self.problems):
            if p.uid in index:
                raise ValueError(f"problems {index[p.uid]} and {i} share uid {p.uid}; combine sets with merge()")
            index[p.uid] = i
        object.__setattr__(self, "_index", index)

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, i: int) -> Problem:
        return self.problems[i]

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.problems)

    def index_of(self, uid: str) -> int:
        """The dense index (position) of the question with this uid."""
        if uid not in self._index:
            raise KeyError(f"no problem with uid {uid!r} in this set of {len(self)}")
        return self._index[uid]


def problem_uid(text: str) -> str:
    """The stable id of a question: the first 16 hex digits of sha256 of its whitespace-normalised text."""
    return hashlib.sha256(" ".join(text.split()).encode("utf-8")).hexdigest()[:16]


class _RowError(Exception):
    """Why one row is malformed; `load_problems` adds the file and row index."""


def _nested(row: dict, *keys: str) -> Any:
    """row[k1][k2]..., or None where a level is missing or not an object."""
    for key in keys:
        if not isinstance(row, dict):
            return None
        row = row.get(key)
    return row


def _last_user_message(prompt: Any) -> Any:
    if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
        raise _RowError(f"prompt must be a list of {{role, content}} messages, got {type(prompt).__name__}")
    for message in reversed(prompt):
        if message.get("role") == "user":
            return message.get("content")
    raise _RowError("prompt has no message with role 'user'")


def problem_text(row: dict) -> str:
    """The question text of a row (see the module docstring for which field is used)."""
    for keys in (("problem",), ("question",), ("extra_info", "question")):
        text = _nested(row, *keys)
        if text is not None:
            break
    else:
        if row.get("prompt") is None:
            raise _RowError("no problem text (looked for problem, question, extra_info.question, prompt)")
        text = _last_user_message(row["prompt"])
    if not isinstance(text, str):
        raise _RowError(f"problem text must be a string, got {type(text).__name__}")
    if not text.strip():
        raise _RowError("problem text is empty")
    return text.strip()


def _unwrap_math(answer: str) -> str:
    """Removes one `$...$` around the whole answer; `$1$,$2$` (two spans) is left alone."""
    if len(answer) >= 2 and answer[0] == answer[-1] == "$" and "$" not in answer[1:-1]:
        return answer[1:-1].strip()
    return answer


def _gsm8k_final(text: str) -> str:
    """GSM8K ends a worked solution with `#### 1,234`: the number after the last `####`, without thousands
    commas. Text without `####` is returned as is."""
    if "####" not in text:
        return text
    return text.rsplit("####", 1)[1].strip().replace(",", "")


def _number_text(x: int | float) -> str:
    """142 -> "142", 142.0 -> "142", 0.5 -> "0.5" (repr: the shortest string that reads back exactly)."""
    if isinstance(x, float) and not math.isfinite(x):
        raise _RowError(f"answer {x!r} is not a finite number")
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return repr(x)


def _answer_text(item: Any, field: str) -> str:
    """One answer as a normalised, non-empty string."""
    if isinstance(item, bool) or not isinstance(item, str | int | float):
        raise _RowError(f"{field} must be a string or number, got {type(item).__name__}")
    text = _unwrap_math(_gsm8k_final(item).strip()) if isinstance(item, str) else _number_text(item)
    if not text:
        raise _RowError(f"{field} is empty")
    return text


def _answer_strings(value: Any, field: str) -> tuple[str, ...]:
    """The de-duplicated answers of one field: a string or number, or a non-empty list of them."""
    if not isinstance(value, list):
        return (_answer_text(value, field),)
    if not value:
        raise _RowError(f"{field} is an empty list")
    return tuple(dict.fromkeys(_answer_text(item, f"{field}[{i}]") for i, item in enumerate(value)))


def answer_strings(row: dict) -> tuple[str, ...]:
    """The acceptable answers of a row (see the module docstring for which field is used)."""
    if row.get("answer") is not None:
        return _answer_strings(row["answer"], "answer")
    if isinstance(row.get("solution"), str) and "####" in row["solution"]:
        return _answer_strings(row["solution"], "the #### line of solution")
    if _nested(row, "reward_model", "ground_truth") is not None:
        return _answer_strings(row["reward_model"]["ground_truth"], "reward_model.ground_truth")
    if row.get("gt_answer") is not None:
        return _answer_strings(row["gt_answer"], "gt_answer")
    if "answer" in row:
        raise _RowError("answer is null (and no #### in solution, reward_model.ground_truth or gt_answer)")
    raise _RowError("no answer (looked for answer, #### in solution, reward_model.ground_truth, gt_answer)")


def row_to_problem(row: Any, source: str) -> Problem:
    """Maps one row to a Problem; raises _RowError saying what is wrong with it."""
    if isinstance(row, _BadLine):
        raise _RowError(row.reason)
    if not isinstance(row, dict):
        raise _RowError(f"expected an object, got {type(row).__name__}")
    text = problem_text(row)
    return Problem(uid=problem_uid(text), problem=text, answers=answer_strings(row), source=source)


def _merge_into(problems: dict[str, Problem], first_at: dict[str, int], p: Problem, where: int) -> str | None:
    """Adds p to `problems` (uid -> Problem, insertion-ordered); if its uid is already there, unions the
    answers (order kept) and returns the reason to report the duplicate with."""
    if p.uid not in problems:
        problems[p.uid], first_at[p.uid] = p, where
        return None
    kept = problems[p.uid]
    new = tuple(a for a in p.answers if a not in kept.answers)
    problems[p.uid] = dataclasses.replace(kept, answers=kept.answers + new)
    extra = f"; added answers {list(new)}" if new else ""
    return f"same problem as {kept.source}[{first_at[p.uid]}] (uid {p.uid}){extra}"


def _build(rows: Iterable[Any], file: str, source: str, on_error: str, limit: int | None) -> ProblemSet:
    """Rows -> ProblemSet: malformed rows raise or are skipped, duplicates are merged, all of it reported."""
    problems, first_at, skipped, duplicates, count = {}, {}, [], [], 0
    lines = getattr(rows, "line_numbers", None)  # a JSON-lines file's: row i is on line lines[i]
    for i, row in enumerate(rows):
        if limit is not None and len(problems) >= limit:
            break
        count += 1
        line = None if lines is None else lines[i]
        try:
            p = row_to_problem(row, source)
        except _RowError as e:
            issue = RowIssue(file, i, str(e), line)
            if on_error == "raise":
                raise DataError(f"{file}: {issue.where}: {e}") from None
            skipped.append(issue)
            continue
        reason = _merge_into(problems, first_at, p, i)
        if reason is not None:
            duplicates.append(RowIssue(file, i, reason, line))
    report = LoadReport(count, len(problems), tuple(skipped), tuple(duplicates))
    return ProblemSet(tuple(problems.values()), report)


def merge(*sets: ProblemSet) -> ProblemSet:
    """One set holding every distinct question of `sets`, in order of first appearance.

    A question found again (same uid) keeps its first source and position and gains the other answers.
    The reports are added up; cross-set duplicates are listed with their source and position in their set.
    """
    problems, first_at, duplicates = {}, {}, []
    for s in sets:
        for i, p in enumerate(s):
            reason = _merge_into(problems, first_at, p, i)
            if reason is not None:
                duplicates.append(RowIssue(p.source, i, reason))
    report = LoadReport(
        rows=sum(s.report.rows for s in sets), kept=len(problems),
        skipped=tuple(issue for s in sets for issue in s.report.skipped),
        duplicates=tuple(issue for s in sets for issue in s.report.duplicates) + tuple(duplicates))
    return ProblemSet(tuple(problems.values()), report)


class _BadLine(NamedTuple):
    """A JSON-lines line that does not parse: a malformed row like any other (raised or skipped)."""

    reason: str


class _JsonLines(list):
    """A JSON-lines file's rows, with the 1-based line each came from (`line_numbers`)."""

    line_numbers: list[int]


def _json_lines(text: str, file: str) -> list[Any]:
    """One JSON value per non-blank line; a line that does not parse becomes a `_BadLine` row."""
    rows = _JsonLines()
    rows.line_numbers = []
    for n, line in enumerate(text.split("\n"), start=1):  # not splitlines: JSON strings may hold U+2028
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                rows.append(_BadLine(f"not valid JSON ({e.msg}, column {e.colno})"))
            rows.line_numbers.append(n)
    return rows


def read_json_rows(path: str) -> list[Any]:
    """Rows of a .json (one array, or JSON lines) or .jsonl file."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark some editors write is not data
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if path.lower().endswith(".json"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":  # "Extra data": a valid first value and more after it, i.e. JSON lines
                raise DataError(f"{path}: not valid JSON ({e.msg}, line {e.lineno} column {e.colno})") from None
        else:
            if isinstance(value, list):
                return value
    return _json_lines(text, path)


def read_parquet_rows(path: str) -> list[Any]:
    """Rows of a parquet file as plain dicts (nested structs become dicts, lists stay lists)."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow (or the data extra, "
                          f'pip install "r3jax[data]")') from None
    try:
        return pyarrow.parquet.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None


def read_hub_rows(dataset_id: str, split: str) -> Iterable[Any]:
    """Rows of one split of a Hugging Face hub dataset, via `datasets.load_dataset`."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f'loading {dataset_id!r} from the Hugging Face hub needs the datasets package: '
                          f'pip install "r3jax[hub]"') from None
    try:
        return datasets.load_dataset(dataset_id, split=split)
    except Exception as e:  # offline, unknown id, bad split: datasets raises many types; all mean "not loaded"
        raise DataError(f"could not load {dataset_id!r} (split {split!r}) from the Hugging Face hub; offline, "
                        f"or a wrong id or split? ({type(e).__name__}: {e})") from e


def _rows_and_source(path_or_id: str, split: str) -> tuple[Iterable[Any], str]:
    """Dispatches on what `path_or_id` is: a local file by suffix, else a hub id."""
    path = os.fspath(path_or_id)
    if os.path.isfile(path):
        stem, suffix = os.path.splitext(os.path.basename(path))
        suffix = suffix.lower()
        if suffix in _JSON_SUFFIXES:
            return read_json_rows(path), stem
        if suffix in _PARQUET_SUFFIXES:
            return read_parquet_rows(path), stem
        raise DataError(f"{path}: unknown problem file type {suffix!r}; "
                        f"expected one of {', '.join(_JSON_SUFFIXES + _PARQUET_SUFFIXES)}")
    if os.path.exists(path):
        raise DataError(f"{path} is not a file")
    if _HUB_ID.match(path) and not path.endswith(_JSON_SUFFIXES + _PARQUET_SUFFIXES):
        return read_hub_rows(path, split), path
    raise FileNotFoundError(f"no such problem file: {path} (nor is it a hub dataset id like owner/name)")


def load_problems(path_or_id: str | os.PathLike, *, source: str | None = None, split: str = "train",
                  on_error: str = "raise", limit: int | None = None) -> ProblemSet:
    """Loads a problem set from a .json/.jsonl/.parquet file or a Hugging Face hub dataset id ("owner/name").

    Args:
      path_or_id: a local file, or (when no such path exists) a hub id, loaded with `datasets`.
      source: the `Problem.source` tag; defaults to the file stem or the hub id.
      split: the hub split; ignored for local files.
      on_error: "raise" (a malformed row raises DataError naming the file and its line in a JSON-lines file, else
        its 0-based row) or "skip" (it is left out and listed in `report.skipped`).
      limit: stop after this many distinct problems (the first ones in file order).

    Duplicate questions (same uid) are merged into the first: answers united, listed in `report.duplicates`.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    rows, default_source = _rows_and_source(path_or_id, split)
    name = os.fspath(path_or_id)
    problem_set = _build(rows, name, source or default_source, on_error, limit)
    if not problem_set:
        detail = f"; first skipped: {problem_set.report.skipped[0].where}: " \
                 f"{problem_set.report.skipped[0].reason}" if problem_set.report.skipped else ""
        raise DataError(f"{name}: no problems ({problem_set.report.summary()}){detail}")
    return problem_set
