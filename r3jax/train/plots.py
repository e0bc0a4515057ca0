"""The paper's Fig. 4 curves, redrawn from `metrics.jsonl` rows into `DIR/plots/*.png`.

One PNG per panel (reward, groups, zero_advantage, entropy, length, eval) and `fig4.png` with all of them.
Headless (matplotlib's Agg backend); missing metrics leave their panel empty rather than failing a run.
"""

from __future__ import annotations

import os
import pathlib

# (file name, title, [(metric key or key prefix*, label)], y label)
PANELS = (
    ("reward", "Mean reward", [("reward/mean", "reward"), ("reward/accuracy", "accuracy")], ""),
    ("groups", "Collapsed groups", [("groups/solve_all_frac", "solve-all"), ("groups/solve_none_frac", "solve-none")],
     "fraction of groups"),
    ("zero_advantage", "Zero-advantage groups", [("r3/zero_adv_frac_before", "before R³"),
                                                 ("r3/zero_adv_frac_after", "after R³")], "fraction of groups"),
    ("entropy", "Token entropy", [("rollout/entropy_mean", "mean entropy")], "nats"),
    ("length", "Response length", [("rollout/length_mean", "mean"), ("rollout/length_max", "max")], "tokens"),
    ("eval", "Evaluation", [("eval/*/pass@1", "")], "pass@1"),
)


def _series(rows: list[dict], key: str) -> dict[str, tuple[list, list]]:
    """label suffix -> (steps, values) for a key, or for every key matching a `prefix/*/suffix` pattern."""
    if "*" not in key:
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        return {"": tuple(zip(*points, strict=True))} if points else {}
    head, tail = key.split("*")
    names = sorted({k[len(head):len(k) - len(tail)] for r in rows for k in r if k.startswith(head) and
                    k.endswith(tail)})
    return {name: s for name in names for s in _series(rows, head + name + tail).values()}


def _draw(ax, rows, title, curves, ylabel) -> None:
    for key, label in curves:
        for name, (steps, values) in _series(rows, key).items():
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label or name)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def draw(rows: list[dict], folder: str | os.PathLike) -> list[pathlib.Path]:
    """Writes every panel and fig4.png; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, title, curves, ylabel in PANELS:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        _draw(ax, rows, title, curves, ylabel)
        fig.tight_layout()
        fig.savefig(folder / f"{name}.png", dpi=100)
        plt.close(fig)
        written.append(folder / f"{name}.png")
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (_, title, curves, ylabel) in zip(axes.flat, PANELS, strict=True):
        _draw(ax, rows, title, curves, ylabel)
    fig.tight_layout()
    fig.savefig(folder / "fig4.png", dpi=100)
    plt.close(fig)
    return [*written, folder / "fig4.png"]
