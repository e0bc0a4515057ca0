"""A pool of grader processes that can't hang the trainer.

Workers (`r3jax.rewards.worker`) are fresh CPU-only interpreters with math-verify imported once; a
warm spare waits beside them, so replacing a killed worker costs no start-up time. Each answer is
graded under three limits: a wall-clock deadline kept here (past it the worker is killed with
SIGKILL, the spare takes its place, and the answer scores `timeout`), a CPU-time rlimit (the kernel
ends a spinning worker on its own), and an address-space rlimit (a huge power raises MemoryError
in the worker: `parse_error`). A worker that dies for any other reason (killed from outside, a crash
in C) has its answer graded again by a fresh worker, once; a second death scores `timeout`.

So `grade` returns one result per answer, always, within about ceil(len(answers) / num_workers) *
timeout_s plus slack: a killed worker's slot is refilled at once from the warm spares (one per worker
by default), and nothing waits for a process to start while other answers are being graded. Model text
only ever reaches math-verify's LaTeX parser (see `equivalence`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import numbers
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import connection

import numpy as np

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
    spares: warm workers waiting to replace killed ones (default one per worker, so a whole round of
    timeouts costs no start-up). Use as a context manager or call `close()`; a worker also exits when
    this process does. A pool belongs to the process that made it: a forked child must make its own.
    """

    def __init__(self, num_workers: int | None = None, *, timeout_s: float = 3.0, memory_mb: int = 2048,
                 spares: int | None = None):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.num_workers = int(num_workers if num_workers is not None else default_num_workers())
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.num_spares = self.num_workers if spares is None else int(spares)
        if self.num_spares < 0:
            raise ValueError(f"spares must be >= 0, got {spares}")
        self.timeout_s, self.memory_mb = float(timeout_s), int(memory_mb)
        self.stats = PoolStats()
        self._pid = os.getpid()
        self._dir = tempfile.mkdtemp(prefix="r3jax-grader-")
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker] = []
        self._spares: collections.deque[_Worker] = collections.deque()
        launched: list[_Worker] = []
        try:
            for _ in range(self.num_workers + self.num_spares):
                launched.append(self._launch())
            for worker in launched:
                self._await_ready(worker)
        except BaseException:
            for worker in launched:
                _kill(worker)
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._workers, self._spares = launched[:self.num_workers], collections.deque(launched[self.num_workers:])

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the active workers (not the spares)."""
        return [w.process.pid for w in self._workers]

    def grade(self, answers, references) -> list[tuple[bool, str]]:
        """Grades answers[i] against references[i] (a string, a number or a list of acceptable ones)."""
        answers, references = list(answers), list(references)
        if len(answers) != len(references):
            raise ValueError(f"{len(answers)} answers but {len(references)} references")
        refs = [check_references(ref, f"references[{i}]") for i, ref in enumerate(references)]
        for i, answer in enumerate(answers):
            if not isinstance(answer, str):
                raise TypeError(f"answers[{i}] must be a string, got {type(answer).__name__}")
        with self._lock:
            self._check_usable()
            try:
                return self._run(answers, refs)
            except BaseException:  # interrupted mid-batch: no worker may keep a stale task or reply
                for worker in [w for w in self._workers if w.task is not None]:
                    self._replace(worker)
                raise

    def _check_usable(self) -> None:
        if self._closed:
            raise GradingPoolError("this GradingPool is closed")
        if os.getpid() != self._pid:
            raise GradingPoolError(f"this GradingPool belongs to process {self._pid}; its workers cannot serve a "
                                   f"forked child ({os.getpid()}): make a new pool in the child")

    def _run(self, answers, refs) -> list[tuple[bool, str]]:
        results: list = [None] * len(answers)
        pending = collections.deque(range(len(answers)))
        retried: set[int] = set()
        while True:
            for i, worker in enumerate(self._workers):
                if worker.ready and worker.task is None and pending:
                    self._send(i, pending.popleft(), answers, refs, pending)
            busy = [w for w in self._workers if w.task is not None]
            starting = [w for w in self._workers if not w.ready]
            if not busy and not (pending and starting):
                break
            deadline = min([w.deadline for w in busy] + [time.monotonic() + START_TIMEOUT_S])
            ready = connection.wait([w.recv for w in busy + starting], timeout=max(0.0, deadline - time.monotonic()))
            for worker in starting:
                if worker.recv in ready:
                    self._await_ready(worker)
            for worker in busy:
                if worker.recv in ready:
                    self._collect(worker, results, pending, retried)
                elif time.monotonic() >= worker.deadline:
                    results[worker.task] = (False, "timeout")
                    self.stats.timeouts += 1
                    self._replace(worker)
            if starting and not busy and not ready:
                raise GradingPoolError(f"no grader worker started within {START_TIMEOUT_S:.0f} s")
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
        except (EOFError, OSError, ValueError, TypeError):  # it died (or sent garbage): find out how
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
        if task_id != task:  # a reply to another batch's question can only mean a confused worker
            pending.appendleft(task)
            self._replace(worker)
            return
        results[task] = (bool(correct), str(reason))
        worker.task, worker.deadline = None, math.inf

    def _replace(self, worker: _Worker) -> None:
        """Kills `worker`; a warm spare (or a fresh worker, still starting) takes its slot at once, and a new
        spare starts in the background. Nothing here waits for a process to start."""
        _kill(worker)
        fresh = self._launch()
        if self._spares:
            self._spares.append(fresh)
            fresh = self._spares.popleft()
        self._workers[self._workers.index(worker)] = fresh
        self.stats.replaced += 1

    def _launch(self) -> _Worker:
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        log = os.path.join(self._dir, f"worker-{time.monotonic_ns()}.log")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(r3jax.__file__)), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        with open(log, "wb") as err:
            process = subprocess.Popen(
                [sys.executable, "-m", "r3jax.rewards.worker", str(to_child), str(from_child), str(self.memory_mb)],
                pass_fds=(to_child, from_child), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                cwd=self._dir, env=env)
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
        """Stops every worker (waiting for a batch in progress to finish). A forked child's copy of the
        pool does nothing here: the workers and their folder belong to the parent."""
        if self._closed or os.getpid() != self._pid:
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            everyone = self._workers + list(self._spares)
            for worker in everyone:
                worker.send.close()  # end of input: the worker returns
            for worker in everyone:
                try:
                    worker.process.wait(1.0)
                except subprocess.TimeoutExpired:
                    pass
                _kill(worker)
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


def check_references(ref, where: str) -> list:
    """One answer's acceptable references as a non-empty list of str/numbers; a clear error otherwise."""
    one = lambda r: isinstance(r, (str, numbers.Real, np.generic)) and not isinstance(r, (bool, np.bool_))  # noqa: E731
    refs = [ref] if one(ref) else list(ref) if isinstance(ref, (list, tuple)) else None
    if not refs or not all(one(r) for r in refs):
        raise ValueError(f"{where} must be a string, a number or a non-empty list of them, got {ref!r}")
    return [r if isinstance(r, str) else float(r) if isinstance(r, float | np.floating) else int(r) for r in refs]


def _kill(worker: _Worker) -> None:
    if worker.process.poll() is None:
        worker.process.kill()
        worker.process.wait()
    for conn in (worker.send, worker.recv):
        conn.close()


def default_num_workers() -> int:
    """Half the CPUs (the trainer and the sampler's host work keep the rest), at least 1, at most 32."""
    return max(1, min(32, (os.cpu_count() or 2) // 2))
