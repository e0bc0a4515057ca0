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


def main_over_cases(cases: dict, run, default_rounds: int) -> None:
    """The shared command line: --rounds N --cases NAME...; calls run(name, case, rounds) for each."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=default_rounds)
    parser.add_argument("--cases", nargs="*", default=list(cases), choices=list(cases))
    args = parser.parse_args()
    for name in args.cases:
        run(name, cases[name], args.rounds)
