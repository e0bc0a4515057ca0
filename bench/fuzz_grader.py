"""Reward-hacking fuzzer for `rewards.grade_batch`: seeded responses that try to collect credit they should
not, and honest respellings that must keep it.

Usage: python bench/fuzz_grader.py [--seed 0] [--n 1000] [--timeout_s 1.0] [--workers 2] [--batch 64]
       [--categories concat sums ...] [--no-data]

A policy learns whatever the reward pays for, so every category below is a way a response could be paid
for something other than the reference. One generator per category yields (response, reference,
equal_by_construction): labels come from how the text was built, never from a second grader (`ref + a`
with a known nonzero `a` is wrong, `ref + a - a` is right; a box before the last `</think>` does not
count: README, "Public API: r3jax.rewards"). Everything goes through one `GradingPool`; per category the
table counts crashes, batches over the pool's time bound, files the injections managed to create, false
credits (credited, built unequal) and lost credits (built equal, not credited). Then one JSON line; the
exit status is 1 when any of those counts is nonzero. References: a fixed varied pool, plus MATH-500's
answers when ../shared/data/rllm/test/math.json exists.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import emit  # noqa: E402
from fuzz_cases import CATEGORIES, Case, cases  # noqa: E402,F401  (the cases, re-exported)

import r3jax  # noqa: E402
from r3jax import rewards  # noqa: E402

SLACK_S = 5.0        # fixed allowance on top of ceil(batch / workers) * timeout_s per batch
FAILURES = ("crashes", "over_time", "files_created", "false_credits", "lost_credits")


def count_files(folders) -> int:
    """Files under the folders, not counting the pool's worker logs."""
    return sum(1 for d in folders if d and os.path.isdir(d) for _, _, files in os.walk(d)
               for f in files if not (f.startswith("worker-") and f.endswith(".log")))


def grade(batch: list[Case], grader) -> list:
    """grade_batch's results; if it raises, the cases one by one, so each exception is pinned to its case."""
    try:
        return rewards.grade_batch([c.response for c in batch], [c.reference for c in batch], grader=grader)
    except Exception:  # noqa: BLE001  (a crash is a finding, not the end of the run)
        out = []
        for c in batch:
            try:
                out += rewards.grade_batch([c.response], [c.reference], grader=grader)
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out


def shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:60]}...[{len(text)} chars]...{text[-(limit - 80):]}"


def fuzz(seed: int, per_category: int | dict, grader: rewards.GradingPool, *, categories=CATEGORIES,
         use_data: bool = True, batch_size: int = 64, slack_s: float = SLACK_S) -> dict:
    """Builds the cases and grades them in batches through `grader` (a GradingPool) from a fresh temporary
    working folder; returns the report: per category and in total the counts of FAILURES, plus cases,
    credited, timeouts, the slowest batch, its bound and up to 3 examples of each kind of failure."""
    watch, home = tempfile.mkdtemp(prefix="fuzz-grader-watch-"), tempfile.mkdtemp(prefix="fuzz-grader-cwd-")
    old_cwd = os.getcwd()
    folders = (watch, home, getattr(grader, "_dir", None))  # the pool's folder is its workers' cwd (optional)
    os.chdir(home)
    try:
        built = cases(seed, per_category, categories=categories, use_data=use_data, watch_dir=watch)
        per, graded_s = {}, 0.0
        for name in categories:
            mine = [c for c in built if c.category == name]
            stats = dict.fromkeys(("cases", "credited", "timeouts", *FAILURES), 0)
            stats.update(cases=len(mine), max_batch_s=0.0, bound_s=0.0, examples={k: [] for k in FAILURES})
            for start in range(0, len(mine), batch_size):
                batch = mine[start:start + batch_size]
                files = count_files(folders)
                began = time.perf_counter()
                results = grade(batch, grader)
                took = time.perf_counter() - began
                graded_s += took
                bound = math.ceil(len(batch) / grader.num_workers) * grader.timeout_s + slack_s
                stats["max_batch_s"], stats["bound_s"] = max(stats["max_batch_s"], took), max(stats["bound_s"], bound)
                new_files = count_files(folders) - files
                late = f"batch of {len(batch)}: {took:.1f} s > {bound:.1f} s"
                found = {"over_time": [{"note": late}] * (took > bound),
                         "files_created": [{"note": f"{new_files} new file(s) in {folders}"}] * new_files}
                for case, r in zip(batch, results, strict=True):
                    ok = isinstance(r, rewards.GradeResult) and r.reason in rewards.REASONS \
                        and isinstance(r.correct, bool) and r.correct == (r.reason == "correct")
                    shown = dict(response=shorten(case.response), reference=case.reference,
                                 result=r.reason if ok else shorten(repr(r)))
                    kind = ("crashes" if not ok else "false_credits" if r.correct and not case.expected
                            else "lost_credits" if case.expected and not r.correct else None)
                    if kind:
                        found.setdefault(kind, []).append(shown)
                    stats["credited"] += ok and r.correct
                    stats["timeouts"] += ok and r.reason == "timeout"
                for kind in FAILURES:
                    stats[kind] += len(found.get(kind, []))
                    stats["examples"][kind] += found.get(kind, [])[:3 - len(stats["examples"][kind])]
            stats["max_batch_s"] = round(stats["max_batch_s"], 2)
            per[name] = stats
    finally:
        os.chdir(old_cwd)
        shutil.rmtree(watch, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    totals = {k: sum(s[k] for s in per.values()) for k in ("cases", "credited", "timeouts", *FAILURES)}
    return {"seed": seed, "cases": len(built), "workers": grader.num_workers, "timeout_s": grader.timeout_s,
            "slack_s": slack_s, "batch": batch_size, "grader": os.path.dirname(r3jax.__file__),
            "per_category": per, "totals": totals, "graded_s": round(graded_s, 1),
            "responses_per_s": round(len(built) / max(graded_s, 1e-9), 1)}


def table(report: dict) -> str:
    cols = ("cases", "credited", "timeouts", *FAILURES, "max_batch_s", "bound_s")
    rows = [("category", *cols)] + [(name, *(s[c] for c in cols)) for name, s in report["per_category"].items()]
    rows.append(("TOTAL", *(report["totals"].get(c, "") for c in cols)))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(cols) + 1)]
    lines = ["  ".join(str(row[i]).rjust(w) if i else str(row[i]).ljust(w) for i, w in enumerate(widths))
             for row in rows]
    for name, s in report["per_category"].items():
        for kind in FAILURES:
            for ex in s["examples"][kind]:
                lines.append(f"  {name} {kind}: " + (ex["note"] if "note" in ex else f"{ascii(ex['response'])} "
                                                     f"(reference {ascii(ex['reference'])}, {ex['result']})"))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=1000, help="cases per category (megabyte: at most 10)")
    parser.add_argument("--timeout_s", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--categories", nargs="*", default=list(CATEGORIES), choices=list(CATEGORIES))
    parser.add_argument("--no-data", action="store_true", help="leave MATH-500's answers out of the references")
    args = parser.parse_args(argv)
    bound = math.ceil(args.batch / args.workers) * args.timeout_s + SLACK_S
    print(f"grader {os.path.dirname(r3jax.__file__)}; {args.workers} workers, timeout {args.timeout_s} s; batch time "
          f"bound ceil(batch / {args.workers}) * {args.timeout_s} + {SLACK_S} s = {bound:.1f} s for {args.batch}",
          flush=True)
    began = time.perf_counter()
    with rewards.GradingPool(args.workers, timeout_s=args.timeout_s) as grader:
        report = fuzz(args.seed, args.n, grader, categories=args.categories, use_data=not args.no_data,
                      batch_size=args.batch)
    report["wall_s"] = round(time.perf_counter() - began, 1)
    print(table(report), flush=True)
    emit({"bench": "fuzz_grader", **report})
    return 1 if any(report["totals"][k] for k in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
