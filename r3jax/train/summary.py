"""A finished run's verdict: held-out accuracy and solve-none before -> after, and where everything went.

Read from `metrics.jsonl` alone (the first and the last rows that carry an evaluation), so a resumed run
prints the same summary as an uninterrupted one, and `summary.json` holds the same numbers for scripts.
"""

from __future__ import annotations

import json
import pathlib

EVAL_KEY = "eval/avg/pass@1"


def before_after(rows: list[dict], order: list[str] | None = None) -> dict | None:
    """{"before": step, "after": step, "sets": {name: {metric: (before, after)}}}, or None without two evaluations.

    Sets are the evaluation benchmarks (in `order`, else by name), then `avg` (their unweighted mean); metrics
    are pass@1, solve_none, mean_response_tokens and truncation_rate where logged."""
    evaluated = [r for r in rows if r.get(EVAL_KEY) is not None]
    if len(evaluated) < 2:
        return None
    first, last = evaluated[0], evaluated[-1]
    names = sorted({k.split("/")[1] for k in last if k.startswith("eval/") and k.endswith("/pass@1")} - {"avg"},
                   key=lambda n: (order.index(n) if order and n in order else len(order or ()), n))
    sets = {}
    for name in [*names, "avg"]:
        sets[name] = {m: (first.get(f"eval/{name}/{m}"), last.get(f"eval/{name}/{m}"))
                      for m in ("pass@1", "solve_none", "mean_response_tokens", "truncation_rate")
                      if last.get(f"eval/{name}/{m}") is not None}
    return {"before": first["step"], "after": last["step"], "sets": sets}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_summary(console, rows: list[dict], workdir: pathlib.Path, *, final: pathlib.Path,
                  order: list[str] | None = None, skipped_rows: dict | None = None) -> dict | None:
    """Prints the before -> after table and the output locations; writes `summary.json`; returns the numbers.
    skipped_rows: data field -> malformed rows left out of its file (data.on_error="skip"), said under the table
    and kept in summary.json."""
    from rich.table import Table

    result = before_after(rows, order)
    if result is not None:
        table = Table(title=f"Held-out accuracy, step {result['before']} -> step {result['after']} (pass@1; "
                            "solve-none: no sample correct)")
        for col in ("set", "before", "after", "change", "solve-none before", "after", "tokens"):
            table.add_column(col, justify="left" if col == "set" else "right")
        for name, m in result["sets"].items():
            (acc0, acc1), (none0, none1) = m["pass@1"], m.get("solve_none", (None, None))
            change = "-" if acc0 is None else f"{100 * (acc1 - acc0):+.1f}"
            tokens = m.get("mean_response_tokens", (None, None))[1]
            table.add_row("overall" if name == "avg" else name, _pct(acc0), _pct(acc1), change, _pct(none0),
                          _pct(none1), "-" if tokens is None else f"{tokens:.0f}")
        console.print(table)
    if skipped_rows:
        result = {**(result or {}), "skipped_rows": dict(skipped_rows)}
        console.print("Malformed rows left out (data.on_error=skip): "
                      + ", ".join(f"{field} {n}" for field, n in skipped_rows.items()), highlight=False)
    if result is not None:
        (workdir / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    for label, path in (("Final model (Hugging Face folder)", final), ("Metrics", workdir / "metrics.jsonl"),
                        ("TensorBoard", f"tensorboard --logdir {workdir / 'tb'}"),
                        ("Plots (fig4.png: all panels)", workdir / "plots"), ("Evaluation samples", workdir / "eval")):
        console.print(f"{label}: {path}", highlight=False, soft_wrap=True)
    return result
