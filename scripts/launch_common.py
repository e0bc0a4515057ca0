"""What the launch scripts share: argument types, `CMD [args] -- [script args]` splitting, and running a list of
commands (each printed first, exactly as it runs; none run with --dry_run). Standard library only."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Callable


class UsageError(Exception):
    """A bad flag or flag combination; the message names it."""


def count(text: str) -> int:
    """argparse type: an integer >= 0."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's own arguments, those after `--` for train.py / eval.py)."""
    if "--" not in argv:
        return argv, []
    return argv[:argv.index("--")], argv[argv.index("--") + 1:]


def fail(prog: str, message: str, code: int = 2) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return code


def execute(prog: str, commands: list[list[str]], *, dry_run: bool,
            on_interrupt: Callable[[list[str]], None] | None = None) -> int:
    """Prints each command and (unless `dry_run`) runs it; stops at the first that fails, returning its code."""
    for command in commands:
        print(shlex.join(command), flush=True)
        if dry_run:
            continue
        try:
            code = subprocess.run(command).returncode
        except FileNotFoundError:
            return fail(prog, f"{command[0]} is not installed (or not on PATH)", 127)
        except KeyboardInterrupt:
            if on_interrupt is not None:
                on_interrupt(command)
            return 130
        if code:
            return fail(prog, f"exit code {code} from: {shlex.join(command)}", code)
    return 0
