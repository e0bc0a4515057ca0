"""XLA compilations of a process: JAX's persistent compilation cache, and a meter of what compiling cost.

With the persistent cache on, a program compiled by an earlier run (same program, same JAX and XLA, same
devices) is read from disk instead of compiled: a second identical run compiles nothing. Every program is
cached, however small or quick to compile (JAX's defaults skip programs that compile in under a second, which
are most of a run's programs; together they cost seconds at every start).

JAX reports each program it compiles or reads from the cache as a `/jax/core/compile/backend_compile_duration`
event (with its seconds), and each read from the persistent cache also as `/jax/compilation_cache/cache_hits`.
`counts()` adds them up since `start_counting()`.
"""

from __future__ import annotations

import dataclasses
import os

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_TOTALS = {"programs": 0, "seconds": 0.0, "cache_hits": 0}
_LISTENING = []


@dataclasses.dataclass(frozen=True)
class Counts:
    programs: int      # programs the process built: compiled, or read from the persistent cache
    seconds: float     # wall time spent building them
    cache_hits: int    # of which read from the persistent cache

    @property
    def compiled(self) -> int:
        """Programs really compiled (not read from the persistent cache)."""
        return self.programs - self.cache_hits

    def since(self, earlier: Counts) -> Counts:
        return Counts(self.programs - earlier.programs, self.seconds - earlier.seconds,
                      self.cache_hits - earlier.cache_hits)

    def metrics(self) -> dict:
        return {"compile/count_total": self.compiled, "compile/seconds": self.seconds,
                "compile/cache_hits": self.cache_hits}

    def describe(self) -> str:
        hits = f" ({self.cache_hits} from the persistent cache)" if self.cache_hits else ""
        return f"built {self.programs} XLA programs in {self.seconds:.1f} s{hits}"


def use_persistent_cache(folder: str | None) -> str | None:
    """Turns JAX's persistent cache on in `folder` (None or "": off) for every program; returns the folder in
    use. JAX_COMPILATION_CACHE_DIR, when set, wins over `folder`, and JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS
    over the threshold of 0 s. Call before anything compiles."""
    if folder and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(folder))
    if not jax.config.jax_compilation_cache_dir:
        return None
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor, whatever the disk
    return jax.config.jax_compilation_cache_dir


def _on_duration(event: str, seconds: float, **_) -> None:
    if event == _BACKEND_COMPILE:
        _TOTALS["programs"] += 1
        _TOTALS["seconds"] += seconds


def _on_event(event: str, **_) -> None:
    if event == _CACHE_HIT:
        _TOTALS["cache_hits"] += 1


def start_counting() -> None:
    """Listens to JAX's compile events from now on (once per process; later calls do nothing)."""
    if not _LISTENING:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _LISTENING.append(True)


def counts() -> Counts:
    return Counts(_TOTALS["programs"], _TOTALS["seconds"], _TOTALS["cache_hits"])
