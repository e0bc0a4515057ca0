"""Shared helpers for benchmarks: alternating timed rounds and one JSON line per case."""

from __future__ import annotations

import json
import statistics
import sys
import time


def alternate(fns: dict, rounds: int = 5) -> dict:
    """Times each callable once per round, alternating, so background load hits all of them alike.

    Returns name -> {median_s, min_s, max_s}. Each callable must block until its work is done.
    """
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)} for name, t in times.items()}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)
    sys.stdout.flush()


def case_parser(cases: dict, default_rounds: int):
    """The shared command line, --rounds N --cases NAME..., as an argparse parser a script may extend."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=default_rounds)
    parser.add_argument("--cases", nargs="*", default=list(cases), choices=list(cases))
    return parser


def main_over_cases(cases: dict, run, default_rounds: int) -> None:
    """Parses `case_parser`'s command line and calls run(name, case, rounds) for each case."""
    args = case_parser(cases, default_rounds).parse_args()
    for name in args.cases:
        run(name, cases[name], args.rounds)


def protocol_out():
    """For a worker process driven over stdin/stdout: returns a line-buffered handle on the real stdout and
    points fd 1 (and sys.stdout) at stderr, so prints and logs from libraries never corrupt the protocol."""
    import os

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def serve(out, timed: dict, queries: dict, ready: dict) -> None:
    """Worker loop: sends `ready` as one JSON line on `out`, then answers one JSON line per request line on stdin.

    A request is a JSON object {"op": NAME, ...}. If NAME is in `timed`, the worker runs timed[NAME]() once
    and answers {"s": seconds}; if it is in `queries`, it answers queries[NAME](**rest), a dict; "quit" ends
    the loop. Nothing runs between requests, so an idle worker only waits on stdin.
    """
    print(json.dumps(ready), file=out, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "quit":
            return
        if op in timed:
            start = time.perf_counter()
            timed[op]()
            reply = {"s": time.perf_counter() - start}
        else:
            reply = queries[op](**request)
        print(json.dumps(reply), file=out, flush=True)


def check_python(python: str, modules: tuple[str, ...], flag: str, recipe: str) -> str:
    """Fails before any timed run when `python` (another virtualenv's interpreter, from `flag`) is missing or
    cannot import `modules`, saying how to make it (`recipe`). Returns the first module's __version__."""
    import subprocess

    probe = f"import {', '.join(modules)}; print(getattr({modules[0]}, '__version__', '?'))"
    try:
        got = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=600)
    except (FileNotFoundError, PermissionError) as e:
        raise SystemExit(f"{flag} {python}: {e.strerror}. Make that virtualenv with\n    {recipe}\n"
                         f"or pass {flag} PATH") from None
    if got.returncode:
        raise SystemExit(f"{flag} {python} cannot import {', '.join(modules)}:\n{got.stderr.strip()[-1500:]}\n"
                         f"Make that virtualenv with\n    {recipe}")
    return got.stdout.strip()

