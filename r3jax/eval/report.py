"""An evaluation's output folder: settings.json, samples.jsonl (the record of truth), results.json, a table, a plot.

Every number in results.json is computed from samples.jsonl alone (`results_from_samples`). Rows are appended a
whole batch at a time as batches finish; an interrupted run leaves at most one partial batch, which a rerun
drops and samples again (`completed_batches`), so a resumed evaluation equals an uninterrupted one. A folder
that holds results of other settings is refused, naming the setting, and nothing in it is touched.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from r3jax import jsonl
from r3jax.eval import passk


class ReportError(ValueError):
    """The output folder cannot take this evaluation; the message names the differing setting."""


def check_settings(folder: pathlib.Path, settings: dict, *, write: bool = True) -> None:
    """Writes settings.json into a new folder (if `write`), or checks that an existing one holds the same
    settings."""
    path = folder / "settings.json"
    if path.exists():
        saved = json.loads(path.read_text())
        for key in sorted(set(saved) | set(settings)):
            if saved.get(key) != settings.get(key):
                raise ReportError(f"--output {folder} holds results of other settings: {key} was "
                                  f"{saved.get(key)!r}, now {settings.get(key)!r}. Use another --output folder")
        return
    if write:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings, indent=2) + "\n")


def read_samples(folder: pathlib.Path) -> list[dict]:
    return jsonl.read(folder / "samples.jsonl")


def completed_batches(folder: pathlib.Path, expected: dict[tuple[str, int], int], *,
                      write: bool = True) -> set[tuple[str, int]]:
    """(benchmark, batch) pairs whose rows are all in samples.jsonl; rows of other batches are removed (if
    `write`)."""
    rows = read_samples(folder)
    counts: dict[tuple[str, int], int] = {}
    for r in rows:
        counts[(r["benchmark"], r["batch"])] = counts.get((r["benchmark"], r["batch"]), 0) + 1
    done = {k for k, n in counts.items() if expected.get(k) == n}
    if write and (folder / "samples.jsonl").exists():
        jsonl.rewrite(folder / "samples.jsonl", [r for r in rows if (r["benchmark"], r["batch"]) in done])
    return done


def sample_rows(bench, batch, samples) -> list[dict]:
    """samples.jsonl rows of one graded batch (`benchmark.Sample`s)."""
    return [{"benchmark": bench.name, "uid": bench.problems[s.question].uid, "sample": s.index, "response": s.text,
             "tokens": s.tokens, "truncated": s.truncated, "correct": s.correct, "reason": s.reason,
             "batch": batch.ordinal} for s in samples]


def append_samples(folder: pathlib.Path, rows: list[dict], name: str = "samples.jsonl") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    jsonl.append(folder / name, rows)


def at_budget(row: dict, budget: int) -> tuple[int, bool, bool]:
    """(tokens, truncated, correct) of a sample cut at a smaller budget: a response longer than the budget
    is cut there and counts as wrong and truncated; a shorter one is unchanged."""
    if row["tokens"] > budget:
        return budget, True, False
    return row["tokens"], row["truncated"], row["correct"]


def summarize(rows: list[dict], num_samples: int, ks: list[int], budget: int) -> dict:
    per_question: dict[str, int] = {}
    tokens, truncated = [], []
    for r in rows:
        n_tok, trunc, correct = at_budget(r, budget)
        per_question[r["uid"]] = per_question.get(r["uid"], 0) + int(correct)
        tokens.append(n_tok)
        truncated.append(trunc)
    out = {f"pass@{k}": passk.mean_pass_at_k(per_question.values(), num_samples, k) for k in ks}
    # solve-none: questions none of whose samples is correct (GRPO's all-wrong groups, on held-out questions)
    out.update(solve_none=float(np.mean([c == 0 for c in per_question.values()])),
               mean_response_tokens=float(np.mean(tokens)), truncation_rate=float(np.mean(truncated)),
               num_questions=len(per_question), num_samples=num_samples)
    return out


def results_from_samples(rows: list[dict], settings: dict, model: dict) -> dict:
    """results.json: per budget and benchmark pass@k, tokens, truncation, counts; the average over benchmarks;
    the settings and the model. The first-level `benchmarks` / `average` are those of the largest budget."""
    names = list(dict.fromkeys(r["benchmark"] for r in rows))
    by_budget = {}
    for budget in settings["max_new_tokens"]:
        per = {name: summarize([r for r in rows if r["benchmark"] == name], settings["num_samples"],
                               settings["pass_k"], budget) for name in names}
        average = {key: float(np.mean([per[n][key] for n in names])) for key in
                   [f"pass@{k}" for k in settings["pass_k"]] + ["solve_none", "mean_response_tokens",
                                                                "truncation_rate"]}
        by_budget[str(budget)] = {"benchmarks": per, "average": average}
    largest = by_budget[str(max(settings["max_new_tokens"]))]
    return {"benchmarks": largest["benchmarks"], "average": largest["average"], "by_budget": by_budget,
            "settings": settings, "model": model,
            **({"skipped_rows": settings["skipped_rows"]} if settings.get("skipped_rows") else {})}


def print_table(results: dict, console) -> None:
    from rich.table import Table

    ks = results["settings"]["pass_k"]
    shown = [k for k in ks if k != 1][-1:]  # pass@1 and the largest k, as the paper's tables
    step = results["model"].get("step")
    table = Table(title=results["model"]["path"] + ("" if step is None else f" (step {step})"))
    for col in ["benchmark", "pass@1", *[f"pass@{k}" for k in shown], "tokens", "truncated", "questions"]:
        table.add_column(col, justify="left" if col == "benchmark" else "right")
    rows = [*results["benchmarks"].items(), ("average", {**results["average"], "num_questions": None})]
    for name, r in rows:
        table.add_row(name, f"{100 * r['pass@1']:.2f}", *[f"{100 * r[f'pass@{k}']:.2f}" for k in shown],
                      f"{r['mean_response_tokens']:,.0f}", f"{100 * r['truncation_rate']:.1f}%",
                      "" if r.get("num_questions") is None else str(r["num_questions"]))
    console.print(table)
    skipped = results["settings"].get("skipped_rows")
    if skipped:  # the table counts fewer questions than the files hold: say so under it
        console.print("Malformed rows left out (--on_error skip): " + ", ".join(f"{n} {k}" for n, k in skipped.items()),
                      highlight=False)


def plot_pass_at_k(results: dict, path: pathlib.Path) -> None:
    """Pass@k against k per benchmark (Fig. 5 a/b); with several budgets, pass@1 against the budget (c/d)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted(int(b) for b in results["by_budget"])
    fig, axes = plt.subplots(1, 2 if len(budgets) > 1 else 1, figsize=(11 if len(budgets) > 1 else 6, 4),
                             squeeze=False)
    ks = results["settings"]["pass_k"]
    for name, r in results["benchmarks"].items():
        axes[0, 0].plot(ks, [100 * r[f"pass@{k}"] for k in ks], marker="o", label=name)
    axes[0, 0].set(xscale="log", xlabel="k", ylabel="pass@k (%)", title="Pass@k")
    axes[0, 0].set_xticks(ks, [str(k) for k in ks])
    if len(budgets) > 1:
        for name in results["benchmarks"]:
            axes[0, 1].plot(budgets, [100 * results["by_budget"][str(b)]["benchmarks"][name]["pass@1"]
                                      for b in budgets], marker="o", label=name)
        axes[0, 1].set(xscale="log", xlabel="max new tokens", ylabel="pass@1 (%)", title="Pass@1 vs budget")
        axes[0, 1].set_xticks(budgets, [str(b) for b in budgets])
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
