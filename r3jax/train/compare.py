"""Same-budget comparisons of algorithms and ablations over seeds: run them, then one table and one plot.

Each (variant, seed) is an ordinary `train.py` run in its own process and workdir (`OUT/<variant>/seed<k>`), so a
comparison resumes like a run does: finished runs are skipped, interrupted ones continue from their last
checkpoint. Everything reported is read back from the runs' `metrics.jsonl`:

    final       held-out accuracy (`eval/avg/pass@1`) at the last step, mean ± sample std over seeds
    to_ref      first evaluated step after 0 at which a run reaches the reference variant's mean final
                accuracy (GRPO's by default): mean over the seeds that reach it, and how many did
    auc         area under the held-out accuracy curve divided by the steps (the mean accuracy over training)
    zero_adv    fraction of groups whose advantages are all zero after R³'s repairs (before, for baselines)
    tokens      mean response tokens of the training rollouts
    wall_s      seconds of the training loop (sampling, grading, training, evaluation)

plus how often each mechanism fired (CCR groups, ISR prompts, SERR-scored responses per step) to explain them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from r3jax import jsonl
from r3jax.train import summary

# name -> train.py overrides. Every R³ variant but the last uses the spec's SERR scope, "truncated", whatever the
# config says, so the ablations differ from `r3` in one mechanism; r3-serr-failed ranks every failed response.
_R3 = ["--config.algorithm=r3", "--config.rl.r3.serr_scope=truncated"]
VARIANTS = {
    "grpo": ["--config.algorithm=grpo"],
    "dapo": ["--config.algorithm=dapo"],
    "r3": _R3,
    "r3-no-ccr": [*_R3, "--config.rl.r3.replay=False"],
    "r3-no-isr": [*_R3, "--config.rl.r3.reflection=False"],
    "r3-no-serr": [*_R3, "--config.rl.r3.ranking=False"],
    "r3-serr-failed": ["--config.algorithm=r3", "--config.rl.r3.serr_scope=failed"],
}
MECHANISMS = {"ccr_groups": "r3/ccr_groups", "isr_prompts": "r3/isr_prompts", "serr_scored": "r3/serr_scored",
              "solve_none": "groups/solve_none_frac", "solve_all": "groups/solve_all_frac",
              "truncated": "rollout/truncated_frac"}
TIME_KEYS = ("time/sample_s", "time/grade_s", "time/train_s", "time/eval_s", "time/other_s")


@dataclasses.dataclass(frozen=True)
class Job:
    variant: str
    seed: int
    workdir: pathlib.Path
    command: tuple[str, ...]


def plan(variants: list[str], seeds: list[int], out: pathlib.Path, *, train_py: str, config: str, steps: int,
         eval_every: int, extra: list[str]) -> list[Job]:
    """One job per (variant, seed); unknown variants are an error listing the known ones."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    jobs = []
    for variant in variants:
        for seed in seeds:
            workdir = out / variant / f"seed{seed}"
            command = (sys.executable, train_py, f"--config={config}", f"--workdir={workdir}",
                       f"--config.seed={seed}", f"--config.steps={steps}", f"--config.eval_every={eval_every}",
                       f"--config.checkpoint_every={eval_every}", "--config.eval_at_start=True",
                       *VARIANTS[variant], *extra)
            jobs.append(Job(variant, seed, workdir, command))
    return jobs


def finished(job: Job, steps: int) -> bool:
    rows = jsonl.read(job.workdir / "metrics.jsonl")
    return any(r["step"] == steps and r.get(summary.EVAL_KEY) is not None for r in rows) and \
        (job.workdir / "final").exists()


def run_jobs(jobs: list[Job], steps: int, *, parallel: int = 1, devices: list[str] | None = None,
             log=print) -> list[tuple[Job, int]]:
    """Runs the unfinished jobs, `parallel` at a time (job slot i gets device devices[i % len] through
    CUDA_VISIBLE_DEVICES / TPU_VISIBLE_CHIPS when given); returns (job, exit code) of those that ran."""
    todo = [j for j in jobs if not finished(j, steps)]
    for j in jobs:
        if j not in todo:
            log(f"  done already: {j.variant} seed {j.seed}")
    slots = list(range(parallel))

    def one(job: Job) -> tuple[Job, int]:
        slot = slots.pop()
        try:
            env = dict(os.environ)
            if devices:
                env["CUDA_VISIBLE_DEVICES"] = env["TPU_VISIBLE_CHIPS"] = devices[slot % len(devices)]
            job.workdir.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            with open(job.workdir / "train.log", "a") as out:
                code = subprocess.run(job.command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
            log(f"  {'finished' if code == 0 else f'FAILED (exit {code}, see {job.workdir}/train.log)'}: "
                f"{job.variant} seed {job.seed} in {time.perf_counter() - t0:.0f}s")
            return job, code
        finally:
            slots.append(slot)

    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(one, todo))


def run_numbers(rows: list[dict]) -> dict:
    """One run's curve and averages from its metrics rows."""
    evals = [(r["step"], r[summary.EVAL_KEY]) for r in rows if r.get(summary.EVAL_KEY) is not None]
    steps = [r for r in rows if r["step"] > 0 and r.get("reward/mean") is not None]
    if not evals or not steps:
        raise ValueError("a run without evaluations or training steps")
    xs, ys = (np.array(v, float) for v in zip(*evals, strict=True))
    span = xs[-1] - xs[0]
    auc = float(np.trapezoid(ys, xs) / span) if span > 0 else float(ys[-1])
    zero = [r.get("r3/zero_adv_frac_after", r.get("r3/zero_adv_frac_before")) for r in steps]
    return {"curve": evals, "final": float(ys[-1]), "auc": auc,
            "zero_adv": float(np.mean([z for z in zero if z is not None])),
            "tokens": float(np.mean([r["rollout/length_mean"] for r in steps])),
            "wall_s": float(sum(r.get(k) or 0.0 for r in steps for k in TIME_KEYS)),
            **{name: float(np.mean([r.get(key) or 0.0 for r in steps])) for name, key in MECHANISMS.items()}}


def first_reaching(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first evaluated step after step 0 at or above target (the starting policy does not count)."""
    return next((step for step, acc in curve if step > 0 and acc >= target - 1e-9), None)


def aggregate(per_run: dict[str, list[dict]], reference: str) -> dict:
    """variant -> mean / std / n of every number, and steps to reach the reference's mean final accuracy."""
    target = float(np.mean([r["final"] for r in per_run[reference]])) if per_run.get(reference) else None
    table = {}
    for variant, runs in per_run.items():
        row = {"seeds": len(runs)}
        for key in ("final", "auc", "zero_adv", "tokens", "wall_s", *MECHANISMS):
            values = np.array([r[key] for r in runs])
            row[key] = {"mean": float(values.mean()), "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
                        "values": values.tolist()}
        if target is not None:
            reached = [s for s in (first_reaching(r["curve"], target) for r in runs) if s is not None]
            row["to_ref"] = {"target": target, "mean": float(np.mean(reached)) if reached else None,
                             "reached": len(reached)}
        table[variant] = row
    return table


def markdown(table: dict, reference: str) -> str:
    """The comparison as a Markdown table (what the README shows)."""
    head = ("| variant | final acc. | steps to " + reference + "'s final | AUC | zero-adv groups | mean tokens "
            "| wall s | CCR groups/step | ISR prompts/step | SERR-scored/step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    def pm(row, key, scale=100, fmt=".1f"):
        return f"{scale * row[key]['mean']:{fmt}} ± {scale * row[key]['std']:{fmt}}"

    for variant, row in table.items():
        ref = row.get("to_ref")
        to_ref = "-" if not ref else (f"{ref['mean']:.0f} ({ref['reached']}/{row['seeds']})" if ref["mean"] is not None
                                      else f"never (0/{row['seeds']})")
        lines.append(f"| {variant} | {pm(row, 'final')} | {to_ref} | {pm(row, 'auc')} | {pm(row, 'zero_adv')} | "
                     f"{pm(row, 'tokens', 1)} | {pm(row, 'wall_s', 1, '.0f')} | {row['ccr_groups']['mean']:.2f} | "
                     f"{row['isr_prompts']['mean']:.2f} | {row['serr_scored']['mean']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(per_run: dict[str, list[dict]], path: pathlib.Path) -> None:
    """Mean held-out accuracy against step per variant, with a band of ± one std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, runs in per_run.items():
        steps = sorted(set.intersection(*[{s for s, _ in r["curve"]} for r in runs]))
        values = np.array([[dict(r["curve"])[s] for s in steps] for r in runs]) * 100
        mean, std = values.mean(0), values.std(0, ddof=1) if len(runs) > 1 else np.zeros(len(steps))
        line, = ax.plot(steps, mean, marker="o", markersize=3, label=f"{variant} (n={len(runs)})")
        ax.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy, pass@1 (%)")
    ax.set_title("Held-out accuracy (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def collect(jobs: list[Job], steps: int) -> tuple[dict[str, list[dict]], list[Job]]:
    """Numbers of the finished runs per variant, and the jobs that are not finished."""
    per_run, missing = {}, []
    for job in jobs:
        if not finished(job, steps):
            missing.append(job)
            continue
        per_run.setdefault(job.variant, []).append(run_numbers(jsonl.read(job.workdir / "metrics.jsonl")))
    return per_run, missing


def write_report(out: pathlib.Path, table: dict, per_run: dict, reference: str, settings: dict) -> str:
    text = markdown(table, reference)
    (out / "compare.md").write_text(text)
    (out / "compare.json").write_text(json.dumps({"settings": settings, "variants": table}, indent=2) + "\n")
    plot(per_run, out / "curves.png")
    return text
