"""Checkpoints of a run: Orbax's `CheckpointManager`, asynchronous and atomic, the last N kept.

A checkpoint at step s holds everything the loop needs to continue exactly as if it had not stopped:

- `state`: the whole `TrainState` (params, optimizer state, the R³ buffer, step, RNG key), saved with its
  shardings and restored into the same placement;
- `loop`: JSON: the question iterator's state after step s's batch, the loop's own counters (skipped updates
  in a row, ...), and the run's config (checked against the resuming command's: shapes must match).

Orbax writes into a temporary folder and renames it when complete, so a run killed mid-save leaves the
previous checkpoint as the latest loadable one. A complete checkpoint damaged later (a partial copy from a
bucket, a disk fault) is found when it is read: the loop then moves it aside (`set_aside`, into
`<workdir>/damaged_checkpoints/`) and resumes from the newest one that reads.
"""

from __future__ import annotations

import os
import shutil
import time

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """`save(step, state, loop)`, `latest_step()`, `restore(step, abstract_state) -> (state, loop)`."""

    def __init__(self, directory: str | os.PathLike, *, keep: int, async_save: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))  # Orbax refuses relative paths
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "loop"))

    def save(self, step: int, state, loop: dict) -> None:
        """Starts saving (returns before the write ends when asynchronous); the arrays are copied first, so
        the caller may donate `state` to the next step at once."""
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         loop=ocp.args.JsonSave(loop)))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The complete checkpoints' steps, newest first."""
        return sorted(self._manager.all_steps(), reverse=True)

    def set_aside(self, step: int) -> str:
        """Moves checkpoint `step` (unreadable) out of the managed folder, beside it in `damaged_checkpoints/`, so
        that the run can save that step again; nothing is deleted. Returns where it went. Call on one process."""
        aside = os.path.join(os.path.dirname(self.directory), "damaged_checkpoints")
        os.makedirs(aside, exist_ok=True)
        target = os.path.join(aside, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(os.path.join(self.directory, str(step)), target)
        return target

    def reload(self) -> None:
        """Re-reads which checkpoints the folder holds (after `set_aside`)."""
        self._manager.reload()

    def read_loop(self, step: int) -> dict:
        """The JSON part of a checkpoint alone (config and counters), without reading any array."""
        return self._manager.restore(step, args=ocp.args.Composite(loop=ocp.args.JsonRestore()))["loop"]

    def restore(self, step: int, like):
        """(state, loop) of checkpoint `step`; `like` is a state (or its abstract tree) with the target
        shardings: each array is read straight into its shards."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                  loop=ocp.args.JsonRestore()))
        return out["state"], out["loop"]

    def restore_params(self, step: int, abstract_params, shardings=None):
        """The policy's params alone from checkpoint `step` (nothing else is read: no optimizer state, no
        buffer), each array straight into its sharding when `shardings` is given."""
        shardings = shardings or jax.tree.map(lambda _: None, abstract_params)
        restore = jax.tree.map(lambda x, s: ocp.ArrayRestoreArgs(dtype=x.dtype, sharding=s), abstract_params,
                               shardings)
        args = ocp.args.PyTreeRestore(item={"params": abstract_params}, restore_args={"params": restore},
                                      partial_restore=True)
        return self._manager.restore(step, args=ocp.args.Composite(state=args))["state"]["params"]

    def wait(self) -> None:
        """Blocks until every started save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
