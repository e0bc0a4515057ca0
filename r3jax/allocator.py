"""Host memory kept in the process: XLA:CPU's per-call buffers are reused, not faulted in again every call.

XLA:CPU allocates a program's temporaries with `malloc` at every call (one 1.5 GB buffer for the medium
model's forward and backward in `bench/train_backward.py`). glibc serves blocks that large with a fresh
`mmap` and unmaps them when freed, so every call faults its whole buffer in again, 4 KiB at a time, and the
kernel zeroes each page: measured here, 380-410k minor faults and 0.6-0.9 s of system time in a 1.5-3 s
call. On a virtual machine that reports freed pages to its host (virtio-balloon free page reporting, as on
this one), a buffer freed while another program or process runs is handed back to the host and costs 2-5 s
of system time to fault in again.

`keep_freed_memory()` makes glibc serve every block from one heap (one arena for all threads, no `mmap` for
large blocks) and never give freed memory back: after the first call of a program its buffer is reused, with
no faults (measured: 0 faults and 1.15-1.25 s per call from the second call on, same program). The prices:
the process keeps its peak heap instead of returning it, and compiling is slower, its many threads sharing
one arena (the embedded default, 12 steps, no compile cache: compile 14.8 s against 11.0 s, then train steps
0.31 s against 0.48 s and sampling 0.10 s against 0.13 s). Worth it for runs (`train.py`, `eval.py`), where
executing dominates and the persistent cache removes the compiles of a rerun; not for the test suite. Call it
before JAX starts its threads (before the first array or compile: threads that already have an arena keep
theirs, and then it does little).
Accelerators' memory is XLA's own and is not affected. Anything but Linux with glibc, or
R3JAX_KEEP_FREED_MEMORY=0: a no-op. `train.py`, `eval.py` and the benchmarks (for every system they time)
call it first thing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys

OPT_OUT = "R3JAX_KEEP_FREED_MEMORY"  # "0": leave glibc's defaults

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
SETTINGS = ((M_ARENA_MAX, 1),       # one arena: a block freed by one thread is reused by the next
            (M_MMAP_MAX, 0),        # large blocks from the heap, not from mmap (munmap on free)
            (M_TRIM_THRESHOLD, -1))  # never hand the heap's free top back to the kernel


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to keep and reuse freed memory (see the module doc). True when applied; False on
    other platforms or with R3JAX_KEEP_FREED_MEMORY=0."""
    if os.environ.get(OPT_OUT) == "0":
        return False
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)
