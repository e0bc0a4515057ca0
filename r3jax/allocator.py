"""Host memory in huge pages: XLA:CPU's per-call buffers without half a million page faults a call.

XLA:CPU allocates a program's temporaries with `malloc` at every call (one 1.5 GB buffer for the medium
model's forward and backward in `bench/train_backward.py`). glibc serves blocks that large with a fresh
`mmap` and unmaps them when freed, so each call faults its whole buffer in again, 4 KiB at a time, and the
kernel zeroes every page: measured here, 412k minor faults and 0.7-0.9 s of system time in a 2.8-3.4 s call.
With glibc's `glibc.malloc.hugetlb=1` tunable, malloc asks for transparent huge pages (2 MiB) on such
blocks: 1-8k faults, 0.2 s of system time, and the call takes 2.1-2.3 s (same program, same numbers).

The tunable is read when the process starts, so `use_huge_pages()` re-executes the running command once
with it set (before JAX or anything else has started). It does nothing when the variable is already set,
when the machine's transparent huge pages are off (`never`), on glibc older than 2.35 or anything but Linux,
or when `R3JAX_HUGE_PAGES=0`. Accelerators' memory is XLA's own and is not affected.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
OPT_OUT = "R3JAX_HUGE_PAGES"


def _glibc_version() -> tuple[int, ...] | None:
    name, version = platform.libc_ver()
    if name != "glibc" or not version:
        return None
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def _thp_available(path: str = THP_MODE) -> bool:
    """Whether the kernel gives transparent huge pages to a process that asks (mode `always` or `madvise`)."""
    try:
        with open(path) as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def huge_page_env(environ=None) -> dict | None:
    """The environment with the tunable added, or None when nothing should change (see the module doc)."""
    environ = dict(os.environ if environ is None else environ)
    if environ.get(OPT_OUT, "1") == "0" or "glibc.malloc.hugetlb" in environ.get("GLIBC_TUNABLES", ""):
        return None
    version = _glibc_version()
    if not sys.platform.startswith("linux") or version is None or version < (2, 35) or not _thp_available():
        return None
    tunables = environ.get("GLIBC_TUNABLES")
    environ["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}" if tunables else TUNABLE
    return environ


def use_huge_pages() -> None:
    """Re-executes this Python command with `huge_page_env()` when it changes anything; else returns.

    Call it first thing in an entry script's `__main__`: whatever ran before is run again."""
    env = huge_page_env()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
