"""Where a run's numbers go: `metrics.jsonl` (one JSON object per step), TensorBoard, and optionally W&B.

`metrics.jsonl` is the record of truth (plots are redrawn from it). On resume from step s, rows after s
are dropped before the run continues, so a run killed at any moment and resumed holds exactly one row per
step, the same rows an uninterrupted run writes (timings aside). TensorBoard events after s are purged the
same way (`purge_step`). Non-finite values are written as null (JSON has no NaN).
"""

from __future__ import annotations

import math
import os
import pathlib

import numpy as np

from r3jax import jsonl


def _number(value):
    value = float(np.asarray(value))
    return value if math.isfinite(value) else None


class Logbook:
    """`write(step, metrics)` and `rows()`. A reader (a multi-host run's processes other than 0, which compute
    the same rows) keeps its rows in memory and writes nothing."""

    def __init__(self, workdir: str | os.PathLike, *, resume_step: int, wandb_config=None, run_config: dict | None
                 = None, writer: bool = True):
        self.workdir = pathlib.Path(workdir)
        self.path = self.workdir / "metrics.jsonl"
        kept = [r for r in jsonl.read(self.path) if r.get("step", 0) <= resume_step]
        self._rows = None if writer else kept
        if not writer:
            return
        jsonl.rewrite(self.path, kept)
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(str(self.workdir / "tb"), purge_step=resume_step + 1)
        self._wandb = _start_wandb(wandb_config, run_config, self.workdir) if wandb_config is not None else None

    def write(self, step: int, metrics: dict) -> dict:
        """Appends one row (flushed to disk before returning) and returns it."""
        row = {"step": int(step), **{k: _number(v) for k, v in sorted(metrics.items())}}
        if self._rows is not None:
            self._rows.append(row)
            return row
        jsonl.append(self.path, [row])
        for key, value in row.items():
            if key != "step" and value is not None:
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        return row

    def rows(self) -> list[dict]:
        return list(self._rows) if self._rows is not None else jsonl.read(self.path)

    def close(self) -> None:
        if self._rows is not None:
            return
        self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(wandb_config, run_config, workdir: pathlib.Path):
    """A W&B run when `wandb.project` is set and the package is installed (`pip install "r3jax[wandb]"`); the
    run id is kept in the workdir so a resumed run continues the same W&B run."""
    if not wandb_config.get("project"):
        return None
    try:
        import wandb
    except ImportError:
        print("wandb.project is set but wandb is not installed (pip install 'r3jax[wandb]'): not logging to W&B")
        return None
    id_file = workdir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
    id_file.write_text(run_id)
    return wandb.init(project=wandb_config["project"], entity=wandb_config.get("entity"),
                      name=wandb_config.get("name"), id=run_id, resume="allow", config=run_config,
                      dir=str(workdir))
