"""Append-only JSON-lines records that survive a kill: metrics.jsonl, samples.jsonl.

Rows are appended and fsync'ed before the caller goes on; a kill can leave only a last line cut short,
which `read` leaves out; `rewrite` replaces a file atomically (a temporary file, then a rename).
"""

from __future__ import annotations

import json
import os
import pathlib


def read(path: str | os.PathLike) -> list[dict]:
    """The complete rows of a file (none when it does not exist)."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # the row a kill cut off
    return rows


def append(path: str | os.PathLike, rows: list[dict]) -> None:
    """Appends rows and waits until they are on disk."""
    with open(path, "a") as f:
        f.write("".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def rewrite(path: str | os.PathLike, rows: list[dict]) -> None:
    """Replaces the file's rows at once: a reader sees the old rows or the new ones, never a mix."""
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))
    os.replace(tmp, path)
