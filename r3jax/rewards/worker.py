"""A grader worker process: `python -m r3jax.rewards.worker READ_FD WRITE_FD MEMORY_MB`.

Started by `GradingPool` as a fresh interpreter (never a fork of the trainer, which holds JAX's
threads), it imports math-verify once, limits itself, then answers messages until its input closes.
Messages are JSON, framed by `multiprocessing.connection`: in `[task, answer, references, limit_s]`,
out `[task, correct, reason]`; the first message out is `["ready", pid]`. JSON, not pickle, so even a
worker gone wrong can only send the parent data.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import signal
import sys
from multiprocessing import connection


def limit_resources(memory_mb: int) -> None:
    """Address space capped (huge numbers raise MemoryError instead of swapping), no core dumps."""
    if memory_mb > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def limit_cpu(seconds: float) -> None:
    """Lets the kernel end this process (SIGXCPU) after `seconds` more CPU time."""
    used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(used + seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def serve(conn_in: connection.Connection, conn_out: connection.Connection, memory_mb: int) -> None:
    from r3jax.rewards import equivalence

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; the pool stops its workers
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # a timeout is a result, not a log line
    logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
    equivalence.judge("1", ["1"])  # warm the parser's caches before saying ready
    limit_resources(memory_mb)
    conn_out.send_bytes(json.dumps(["ready", os.getpid()]).encode())
    while True:
        try:
            task, answer, references, limit_s = json.loads(conn_in.recv_bytes())
        except (EOFError, OSError):
            return
        limit_cpu(limit_s)
        try:
            # its own deadline first, so a slow answer comes back as `timeout` and the worker lives on;
            # the pool's wall-clock kill stays for what a signal cannot interrupt (a long call in C)
            correct, reason = equivalence.judge(answer, references, timeout_s=0.8 * limit_s)
        except Exception:  # noqa: BLE001  (MemoryError, RecursionError, anything sympy raises)
            correct, reason = False, "parse_error"
        conn_out.send_bytes(json.dumps([task, bool(correct), reason]).encode())


if __name__ == "__main__":
    read_fd, write_fd, memory = (int(a) for a in sys.argv[1:4])
    serve(connection.Connection(read_fd, writable=False), connection.Connection(write_fd, readable=False), memory)
