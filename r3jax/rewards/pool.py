"""A pool of grader processes that can't hang the trainer.

Workers (`r3jax.rewards.worker`) are fresh CPU-only interpreters with math-verify imported once; a
warm spare waits beside them, so replacing a killed worker costs no start-up time. Each answer is
graded under three limits: a wall-clock deadline kept here (past it the worker is killed with
SIGKILL, the spare takes its place, and the answer scores `timeout`), a CPU-time rlimit (the kernel
ends a spinning worker on its own), and an address-space rlimit (a huge power raises MemoryError
in the worker: `parse_error`). A worker that dies for any other reason (killed from outside, a crash
in C) has its answer graded again by a fresh worker, once; a second death scores `timeout`.

So `grade` returns one result per answer, always, within about
ceil(len(answers) / num_workers) * timeout_s, plus a worker start-up (~1.5 s) for each kill beyond
the first of a batch. Model text only ever reaches math-verify's LaTeX parser (see `equivalence`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import connection

import r3jax

START_TIMEOUT_S = 120.0


class GradingPoolError(RuntimeError):
    """The pool could not start or keep its workers."""


@dataclasses.dataclass(eq=False)
class _Worker:
    process: subprocess.Popen
    send: connection.Connection
    recv: connection.Connection
    log: str                     # its stderr, quoted if it fails to start
    ready: bool = False
    task: int | None = None      # index of the answer it is grading
    deadline: float = math.inf   # time.monotonic() past which it is killed


@dataclasses.dataclass
class PoolStats:
    graded: int = 0
    timeouts: int = 0
    crashes: int = 0    # workers that died on their own (or were killed from outside)
    replaced: int = 0   # workers replaced after a kill or a death


class GradingPool:
    """`num_workers` grader processes; `grade(answers, references)` -> [(correct, reason)].

    timeout_s: wall-clock limit per answer. memory_mb: address-space limit per worker (0: none).
    Use as a context manager or call `close()`; a worker also exits when this process does.
    """

    def __init__(self, num_workers: int | None = None, *, timeout_s: float = 3.0, memory_mb: int = 2048):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.num_workers = int(num_workers if num_workers is not None else default_num_workers())
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.stats = PoolStats()
        self._dir = tempfile.TemporaryDirectory(prefix="r3jax-grader-")
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker] = []
        self._spare: _Worker | None = None
        launched: list[_Worker] = []
        try:
            for _ in range(self.num_workers + 1):
                launched.append(self._launch())
            for worker in launched:
                self._await_ready(worker)
        except BaseException:
            for worker in launched:
                _kill(worker)
            self._dir.cleanup()
            raise
        self._workers, self._spare = launched[:-1], launched[-1]

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the active workers (not the spare)."""
        return [w.process.pid for w in self._workers]

    def grade(self, answers, references) -> list[tuple[bool, str]]:
        """Grades answers[i] against references[i] (a string, a number or a list of acceptable ones)."""
        answers, references = list(answers), list(references)
        if len(answers) != len(references):
            raise ValueError(f"{len(answers)} answers but {len(references)} references")
        refs = []
        for i, ref in enumerate(references):
            ref = [ref] if isinstance(ref, (str, int, float)) else list(ref)
            if not ref or not all(isinstance(r, (str, int, float)) and not isinstance(r, bool) for r in ref):
                raise ValueError(f"references[{i}] must be a string, a number or a non-empty list of them: {ref!r}")
            refs.append(ref)
        for i, answer in enumerate(answers):
            if not isinstance(answer, str):
                raise TypeError(f"answers[{i}] must be a string, got {type(answer).__name__}")
        with self._lock:
            if self._closed:
                raise GradingPoolError("this GradingPool is closed")
            return self._run(answers, refs)

    def _run(self, answers, refs) -> list[tuple[bool, str]]:
        results: list = [None] * len(answers)
        pending = collections.deque(range(len(answers)))
        retried: set[int] = set()
        while True:
            for i, worker in enumerate(self._workers):
                if worker.task is None and pending:
                    self._send(i, pending.popleft(), answers, refs, pending)
            busy = [w for w in self._workers if w.task is not None]
            if not busy:
                break
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = connection.wait([w.recv for w in busy], timeout=wait_s)
            for worker in busy:
                if worker.recv in ready:
                    self._collect(worker, results, pending, retried)
                elif time.monotonic() >= worker.deadline:
                    results[worker.task] = (False, "timeout")
                    self.stats.timeouts += 1
                    self._replace(worker)
        self.stats.graded += len(answers)
        return results

    def _send(self, slot: int, task: int, answers, refs, pending) -> None:
        worker = self._workers[slot]
        try:
            worker.send.send_bytes(json.dumps([task, answers[task], refs[task], self.timeout_s]).encode())
        except OSError:  # it died while idle: put the answer back and use a fresh worker
            pending.appendleft(task)
            self.stats.crashes += 1
            self._replace(worker)
            return
        worker.task, worker.deadline = task, time.monotonic() + self.timeout_s

    def _collect(self, worker: _Worker, results, pending, retried) -> None:
        task = worker.task
        try:
            task_id, correct, reason = json.loads(worker.recv.recv_bytes())
        except (EOFError, OSError, ValueError):  # it died (or sent garbage): find out how
            try:
                code = worker.process.wait(1.0)
            except subprocess.TimeoutExpired:
                code = None
            if code == -signal.SIGXCPU or task in retried:
                results[task] = (False, "timeout")
                self.stats.timeouts += 1
            else:
                retried.add(task)
                pending.appendleft(task)
                self.stats.crashes += 1
            self._replace(worker)
            return
        results[task_id] = (bool(correct), str(reason))
        worker.task, worker.deadline = None, math.inf

    def _replace(self, worker: _Worker) -> None:
        """Kills `worker`; the warm spare takes its slot and a new spare starts in the background."""
        _kill(worker)
        spare, self._spare = self._spare, self._launch()
        self._await_ready(spare)
        self._workers[self._workers.index(worker)] = spare
        self.stats.replaced += 1

    def _launch(self) -> _Worker:
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        log = os.path.join(self._dir.name, f"worker-{time.monotonic_ns()}.log")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(r3jax.__file__)), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        with open(log, "wb") as err:
            process = subprocess.Popen(
                [sys.executable, "-m", "r3jax.rewards.worker", str(to_child), str(from_child), str(self.memory_mb)],
                pass_fds=(to_child, from_child), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                cwd=self._dir.name, env=env)
        os.close(to_child)
        os.close(from_child)
        return _Worker(process, connection.Connection(from_parent, readable=False),
                       connection.Connection(to_parent, writable=False), log)

    def _await_ready(self, worker: _Worker) -> None:
        if worker.ready:
            return
        try:
            if not worker.recv.poll(START_TIMEOUT_S):
                raise GradingPoolError(f"a grader worker did not start within {START_TIMEOUT_S:.0f} s")
            json.loads(worker.recv.recv_bytes())
        except (EOFError, OSError) as e:
            with open(worker.log, errors="replace") as f:
                tail = f.read()[-2000:]
            raise GradingPoolError(f"a grader worker died while starting (exit code {worker.process.poll()}): "
                                   f"{tail}") from e
        worker.ready = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        everyone = self._workers + ([self._spare] if self._spare else [])
        for worker in everyone:
            worker.send.close()  # end of input: the worker returns
        for worker in everyone:
            try:
                worker.process.wait(1.0)
            except subprocess.TimeoutExpired:
                pass
            _kill(worker)
        self._dir.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


def _kill(worker: _Worker) -> None:
    if worker.process.poll() is None:
        worker.process.kill()
        worker.process.wait()
    for conn in (worker.send, worker.recv):
        conn.close()


def default_num_workers() -> int:
    """Half the CPUs (the trainer and the sampler's host work keep the rest), at least 1, at most 32."""
    return max(1, min(32, (os.cpu_count() or 2) // 2))
