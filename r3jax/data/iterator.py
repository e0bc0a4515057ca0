"""Which questions each training step sees: a deterministic, resumable, epoch-aware stream of indices.

Epoch `e` visits the questions [0, N) in the order `epoch_permutation(seed, e, N)`. Step after step, the
global batch is the next `batch_size` entries of that order, and process `p` of `P` takes the contiguous
slice [p * batch_size / P, (p + 1) * batch_size / P) of it. A batch never straddles two epochs: the last
`N mod batch_size` questions of each epoch's order are dropped (a different few every epoch).

The whole stream is a pure function of (seed, state), and the state is two integers, so a checkpoint
stores `state.to_dict()` and a restart continues with exactly the batches it would have seen.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class IteratorState:
    """Where the stream stands: the next batch starts at `position` in epoch `epoch`'s order."""

    epoch: int = 0
    position: int = 0

    def __post_init__(self):
        for name in ("epoch", "position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
                raise ValueError(f"IteratorState.{name} must be a non-negative integer, got {value!r}")
            object.__setattr__(self, name, int(value))

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> IteratorState:
        if not isinstance(raw, dict) or set(raw) != {"epoch", "position"}:
            raise ValueError(f"an iterator state is a dict with keys epoch and position, got {raw!r}")
        as_int = lambda x: x.item() if isinstance(x, np.ndarray) and x.ndim == 0 else x  # noqa: E731  (restored 0-d)
        return cls(epoch=as_int(raw["epoch"]), position=as_int(raw["position"]))


def epoch_permutation(seed: int, epoch: int, num_questions: int) -> np.ndarray:
    """The order of questions in one epoch, an int64 permutation of [0, num_questions).

    Stable across numpy versions by construction: `SeedSequence([seed, epoch])` seeds a PCG64 bit
    generator, and the permutation is the stable argsort of its first `num_questions` raw 64-bit outputs.
    Numpy guarantees SeedSequence and the PCG64 stream; it does not guarantee `Generator.permutation`.
    """
    bits = np.random.PCG64(np.random.SeedSequence([seed, epoch])).random_raw(num_questions)
    return np.argsort(bits, kind="stable")


def _check(num_questions: int, batch_size: int, seed: int, process_index: int, process_count: int):
    for name, value, low in (("num_questions", num_questions, 1), ("batch_size", batch_size, 1),
                             ("seed", seed, 0), ("process_index", process_index, 0),
                             ("process_count", process_count, 1)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if batch_size > num_questions:
        raise ValueError(f"batch_size {batch_size} is larger than the {num_questions} questions of an epoch")
    if batch_size % process_count:
        raise ValueError(f"batch_size {batch_size} is not divisible by process_count {process_count}")
    if process_index >= process_count:
        raise ValueError(f"process_index {process_index} is not below process_count {process_count}")


def _start(state: IteratorState, num_questions: int, batch_size: int) -> IteratorState:
    """The state itself, or the next epoch's start when fewer than batch_size questions are left."""
    if state.position + batch_size > num_questions:
        return IteratorState(epoch=state.epoch + 1, position=0)
    return state


def next_batch(state: IteratorState, *, num_questions: int, batch_size: int, seed: int, process_index: int = 0,
               process_count: int = 1) -> tuple[np.ndarray, int, IteratorState]:
    """The next step's questions for this process.

    Returns (indices, epoch, new_state): `indices` are this process's `batch_size / process_count` question
    indices (int32, in [0, num_questions)), `epoch` is the epoch they are drawn from, and `new_state` is
    where the following batch starts (already moved to the next epoch when this one has no full batch left).
    """
    _check(num_questions, batch_size, seed, process_index, process_count)
    state = _start(state, num_questions, batch_size)
    order = epoch_permutation(seed, state.epoch, num_questions)
    per_process = batch_size // process_count
    first = state.position + process_index * per_process
    indices = order[first:first + per_process].astype(np.int32)
    after = dataclasses.replace(state, position=state.position + batch_size)
    return indices, state.epoch, _start(after, num_questions, batch_size)


class QuestionIterator:
    """A stateful shell over `next_batch`: `next(it)` gives (indices, epoch); `it.state` goes in checkpoints."""

    def __init__(self, num_questions: int, batch_size: int, *, seed: int, process_index: int = 0,
                 process_count: int = 1, state: IteratorState | None = None):
        _check(num_questions, batch_size, seed, process_index, process_count)
        self._kwargs = dict(num_questions=num_questions, batch_size=batch_size, seed=seed,
                            process_index=process_index, process_count=process_count)
        self.state = state or IteratorState()

    def __iter__(self) -> QuestionIterator:
        return self

    def __next__(self) -> tuple[np.ndarray, int]:
        indices, epoch, self.state = next_batch(self.state, **self._kwargs)
        return indices, epoch

    def restore(self, state: IteratorState) -> None:
        """Continues from a saved state (e.g. `IteratorState.from_dict(checkpoint["iterator"])`)."""
        if not isinstance(state, IteratorState):
            raise TypeError(f"restore takes an IteratorState (see IteratorState.from_dict), got {type(state)}")
        self.state = state
