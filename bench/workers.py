"""The benchmarks' worker processes: each system runs in a process of its own, spoken to in JSON lines (the
worker side is `common.serve`), timed one at a time while the others wait, and the CPU that other processes
used meanwhile read from /proc."""

from __future__ import annotations

import json
import os
import subprocess


class Worker:
    """One system's worker process, spoken to in JSON lines; its stderr goes to a log file."""

    def __init__(self, name: str, argv: list, log_path: str, env: dict | None = None):
        self.name, self.log_path = name, log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, bufsize=1, env=env)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            with open(self.log_path) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"{self.name} worker ended (exit {self.proc.returncode}); its stderr ends:\n{tail}")
        return json.loads(line)

    def ask(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def pytest_pids(ours) -> list[int]:
    """Processes other than ours whose command line mentions pytest (a CI run slows every figure)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in ours:
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"pytest" in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def process_ticks(pid: int) -> int:
    """CPU ticks (user + system, all threads) a process has used so far, from /proc; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read().rsplit(")", 1)[1].split()
        return int(stat[11]) + int(stat[12])
    except (OSError, IndexError):
        return 0


def cpu_ticks(pids) -> tuple[int, int]:
    """(busy ticks of the whole machine, ticks used by `pids`) from /proc."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(process_ticks(pid) for pid in pids)  # busy: not idle/iowait


def alternate_workers(workers: dict, op: str, rounds: int, idle_ticks: dict | None = None) -> dict:
    """name -> seconds of `rounds` calls of `op`, one call per worker per round; the first worker rotates.

    idle_ticks, if given, accumulates name -> CPU ticks each worker used while another one was being timed."""
    names = list(workers)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            before = {k: process_ticks(w.proc.pid) for k, w in workers.items() if k != name}
            times[name].append(workers[name].ask(op)["s"])
            if idle_ticks is not None:
                for k, t in before.items():
                    idle_ticks[k] = idle_ticks.get(k, 0) + process_ticks(workers[k].proc.pid) - t
    return times
