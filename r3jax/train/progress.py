"""What a person watching a run sees: a live `rich` progress bar and one line per evaluation.

The bar shows step/total, mean reward, accuracy, the solve-none fraction, R³'s zero-advantage fraction after
repair, generated tokens/s and the ETA. Without a terminal (a log file, a pod's stdout) there is no live bar:
each step prints one plain line with the same numbers instead.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _fmt(row: dict, key: str, spec: str) -> str:
    value = row.get(key)
    return "-" if value is None else format(value, spec)


class TrainProgress:
    """quiet: show nothing (a multi-host run's processes other than 0)."""

    def __init__(self, *, total: int, done: int, quiet: bool = False):
        self.console = Console(quiet=quiet)
        self._quiet = quiet
        self._progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TextColumn("eta"),
                                  TimeRemainingColumn(), console=self.console, transient=False)
        self._task = self._progress.add_task("train", total=total, completed=done, stats="")
        self._progress.start()
        self._closed = False

    def update(self, step: int, row: dict) -> None:
        stats = (f"reward {_fmt(row, 'reward/mean', '.3f')}  acc {_fmt(row, 'reward/accuracy', '.3f')}  "
                 f"solve-none {_fmt(row, 'groups/solve_none_frac', '.2f')}  "
                 f"zero-adv {_fmt(row, 'r3/zero_adv_frac_after', '.2f')}  "
                 f"{_fmt(row, 'tokens_per_s', ',.0f')} tok/s")
        self._progress.update(self._task, completed=step, stats=stats)
        if not self.console.is_terminal and not self._quiet:
            task = self._progress.tasks[0]
            eta = "-" if task.time_remaining is None else f"{task.time_remaining:.0f}s"
            print(f"step {step}/{task.total}  {stats}  eta {eta}", flush=True)

    def print_eval(self, step: int, metrics: dict) -> None:
        names = sorted({k.split("/")[1] for k in metrics if k.endswith("/pass@1") and not k.startswith("eval/avg")})
        parts = [f"{n} {metrics[f'eval/{n}/pass@1']:.3f} ({metrics[f'eval/{n}/mean_response_tokens']:.0f} tok)"
                 for n in names]
        self._progress.console.print(f"eval @ step {step}: " + "  ".join(parts) +
                                     f"  avg {metrics.get('eval/avg/pass@1', float('nan')):.3f}")

    def print_note(self, text: str) -> None:
        self._progress.console.print(text, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if not self._closed:
            self._progress.stop()
            self._closed = True
