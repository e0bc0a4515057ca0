"""The processes of a multi-controller run: start-up, who writes, and rows moving between a host and the mesh.

JAX runs one Python process per host (`jax.distributed`); every process runs the same program on one global
mesh over all devices, and sees only its own devices' shards of a global array. A run uses three moves:

- `local_rows(x)`: the rows of a row-sharded global array that this process's devices hold (a rollout's
  responses, for this host to decode and grade), with their global indices;
- `from_local_rows(like, values)`: the global array of per-row values computed on each host for its own rows
  (`jax.make_array_from_process_local_data`), sharded like `like`: nothing is gathered to one host;
- `gather_objects(items)`: small host-side records (graded evaluation samples) from every process, in process
  order, so that every host computes the same report.

With one process all three are the identity, and the code path is the same.
"""

from __future__ import annotations

import json
import os
import re
import sys

import jax
import numpy as np

# XLA:CPU threads per fake device (`size_cpu_thread_pool`): room for several collectives in flight on each.
CPU_THREADS_PER_DEVICE = 4
ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


class DistributedError(RuntimeError):
    """A multi-process start-up that cannot work; the message names the setting."""


def _from_env(value, name: str, kind):
    if value is not None:
        return value
    text = os.environ.get(ENV[name])
    if text in (None, ""):
        return None
    try:
        return kind(text)
    except ValueError:
        raise DistributedError(f"{ENV[name]}={text!r} is not a valid {kind.__name__}") from None


def wanted(coordinator_address=None, num_processes=None, process_id=None, *, auto: bool = False) -> bool:
    """Whether this process is one of several: asked for (`auto`, explicit settings or their environment
    variables), or started by SLURM with several tasks."""
    explicit = any(_from_env(v, k, str) is not None for k, v in (("coordinator_address", coordinator_address),
                                                                 ("num_processes", num_processes),
                                                                 ("process_id", process_id)))
    return auto or explicit or int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1


def size_cpu_thread_pool(environ=None) -> int | None:
    """Gives XLA:CPU enough threads for its fake devices (`jax_num_cpu_devices`, set by JAX_NUM_CPU_DEVICES or
    `jax.config.update`, else `--xla_force_host_platform_device_count` in XLA_FLAGS, as JAX reads them):
    NPROC = `CPU_THREADS_PER_DEVICE` x devices, unless NPROC or PJRT_NPROC is set. Returns the size it set, None
    when it left the environment alone (one device, or the user's own size).

    XLA:CPU runs every device's program on one pool of threads, max(cores, devices) by default, and runs a
    program's independent operations concurrently; a collective holds its thread until every device in it
    arrives. With 8 devices on 2 cores the pool has 8 threads: when some devices have two collectives in flight
    (an 8-way all-gather and a pairwise one of the same step, seen in the deadlock this prevents), the 8
    threads can all be waiting while the devices they wait for have no thread left to run on, and XLA aborts
    the process after 40 s. Every device issues the same collectives in the same program; a TPU or GPU runs
    each device's collectives on its own stream and has no shared pool to exhaust. Must run before anything
    touches a device (the pool is made with the CPU client)."""
    environ = os.environ if environ is None else environ
    if "NPROC" in environ or "PJRT_NPROC" in environ:
        return None
    configured = jax.config.jax_num_cpu_devices if environ is os.environ else int(
        environ.get("JAX_NUM_CPU_DEVICES", -1))
    found = re.findall(r"--xla_force_host_platform_device_count=(\d+)", environ.get("XLA_FLAGS", ""))
    devices = configured if configured >= 0 else int(found[-1]) if found else 1
    if devices <= 1:
        return None
    environ["NPROC"] = str(CPU_THREADS_PER_DEVICE * devices)
    return CPU_THREADS_PER_DEVICE * devices


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = False, heartbeat_timeout_s: int = 100,
               initialization_timeout_s: int = 300) -> bool:
    """Joins the run's other processes (`jax.distributed.initialize`) when `wanted`; returns whether it did.

    Unset values come from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else from JAX's own
    cluster detection (Cloud TPU VMs, SLURM, Open MPI, Kubernetes). If a process dies, the others stop within
    about `heartbeat_timeout_s` with JAX's "another task died" error instead of waiting forever. Sizes XLA:CPU's
    thread pool for fake devices first (`size_cpu_thread_pool`). Must run before anything touches a device."""
    size_cpu_thread_pool()
    if not wanted(coordinator_address, num_processes, process_id, auto=auto):
        return False
    address = _from_env(coordinator_address, "coordinator_address", str)
    count = _from_env(num_processes, "num_processes", int)
    index = _from_env(process_id, "process_id", int)
    if (address, count, index) != (None, None, None) and None in (address, count, index):
        missing = [f"--{k} (or {ENV[k]})" for k, v in (("coordinator_address", address), ("num_processes", count),
                                                         ("process_id", index)) if v is None]
        raise DistributedError(f"multi-process run: {', '.join(missing)} not set; give all three, or none of them "
                               "on a platform JAX detects (TPU VMs, SLURM, Open MPI)")
    if count is not None and not 0 <= index < count:
        raise DistributedError(f"--process_id {index} is not in [0, --num_processes {count})")
    if jax.config.jax_platforms in (None, "", "cpu") and "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices across processes
    jax.distributed.initialize(address, count, index, heartbeat_timeout_seconds=heartbeat_timeout_s,
                               initialization_timeout=initialization_timeout_s)
    print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} of "
          f"{jax.device_count()} devices; a process silent for {heartbeat_timeout_s} s stops the run",
          file=sys.stderr, flush=True)
    return True


def is_main() -> bool:
    """The process that writes logs, plots, summaries and exported models (process 0)."""
    return jax.process_index() == 0


def local_rows(*arrays: jax.Array) -> tuple[np.ndarray, list[np.ndarray]]:
    """(global row indices, [this process's rows of each array]) for arrays sharded along axis 0 alike.

    Rows that several devices hold (replicated along another mesh axis) come once; every array must be whole
    along its other axes on each device."""
    first = arrays[0]
    if first.is_fully_addressable:
        return np.arange(first.shape[0]), [np.asarray(jax.device_get(a)) for a in arrays]
    out = []
    for a in arrays:
        pieces = {}
        for shard in a.addressable_shards:
            rows, *rest = shard.index
            if any(s != slice(None) and (s.start, s.stop) != (0, n) for s, n in zip(rest, a.shape[1:], strict=True)):
                raise ValueError(f"local_rows: an array of shape {a.shape} is split along a non-row axis "
                                 f"({shard.index}); only row-sharded arrays can be read per host")
            start = rows.start or 0
            pieces.setdefault(start, shard.data)
        starts = sorted(pieces)
        out.append(np.concatenate([np.asarray(pieces[s]) for s in starts]))
    starts = sorted({(s.index[0].start or 0) for s in first.addressable_shards})
    sizes = {(s.index[0].start or 0): (s.index[0].stop or first.shape[0]) - (s.index[0].start or 0)
             for s in first.addressable_shards}
    rows = np.concatenate([np.arange(s, s + sizes[s]) for s in starts])
    return rows, out


def from_local_rows(like: jax.Array, values: np.ndarray) -> jax.Array:
    """The global array whose rows on each process are that process's `values` (its `local_rows` of `like`),
    placed with `like`'s row sharding; `values` may have its own trailing shape and dtype."""
    values = np.asarray(values)
    if like.is_fully_addressable:
        return jax.device_put(values, _row_sharding(like, values.ndim))
    return jax.make_array_from_process_local_data(_row_sharding(like, values.ndim), values,
                                                  (like.shape[0], *values.shape[1:]))


def _row_sharding(like: jax.Array, ndim: int):
    sharding = like.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        row = sharding.spec[0] if len(sharding.spec) else None
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(row, *([None] * (ndim - 1))))
    if ndim != like.ndim:
        raise ValueError(f"from_local_rows: cannot reshape a {type(sharding).__name__} to {ndim} dimensions")
    return sharding


def put_rows(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array that every process holds whole, placed with a row sharding: each process transfers only
    the rows its devices hold (no cross-host equality check, unlike `jax.device_put`)."""
    x = np.asarray(x)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    rows = sorted({(index[0].start or 0, index[0].stop or x.shape[0])
                   for index in sharding.addressable_devices_indices_map(x.shape).values()})
    local = np.concatenate([x[a:b] for a, b in rows])
    return jax.make_array_from_process_local_data(sharding, local, x.shape)


def gather_objects(items: list) -> list:
    """Every process's JSON-able `items`, concatenated in process order (on every process)."""
    if jax.process_count() == 1:
        return list(items)
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(items).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.asarray([data.size], np.int64))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[:data.size] = data
    every = multihost_utils.process_allgather(padded)
    out = []
    for row, size in zip(np.asarray(every).reshape(len(sizes), -1), np.asarray(sizes).reshape(-1), strict=True):
        out.extend(json.loads(row[:size].tobytes().decode()))
    return out


def fetch(x) -> np.ndarray:
    """The whole of a (small) global array on every process."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def barrier(name: str) -> None:
    """Waits until every process reaches `name` (a no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def processes_where(flag: bool) -> list[int]:
    """The indices of the processes where `flag` holds (each process passes its own); the same everywhere."""
    if jax.process_count() == 1:
        return [0] if flag else []
    from jax.experimental import multihost_utils

    return [int(i) for i in np.flatnonzero(multihost_utils.process_allgather(np.asarray([flag], bool)))]


def any_process(flag: bool) -> bool:
    """Whether `flag` holds on any process (each process passes its own); the same answer everywhere."""
    return bool(processes_where(flag))


def check_shared_folder(path, what: str) -> None:
    """Raises DistributedError on every process unless all of them see the same folder at `path` (a file
    process 0 writes there must be visible to each): checkpoints written to host-local folders would not
    restore."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    token = multihost_utils.broadcast_one_to_all(np.asarray(int.from_bytes(os.urandom(4), "little"), np.int64))
    marker = os.path.join(os.fspath(path), f".shared-by-all-hosts-{int(token)}")
    if is_main():
        with open(marker, "w"):
            pass
    barrier("shared folder: marker written")
    blind = processes_where(not os.path.exists(marker))
    barrier("shared folder: marker checked")
    if is_main():
        os.remove(marker)
    if blind:
        raise DistributedError(f"{what} {os.fspath(path)!r} is not one folder shared by all hosts: process(es) "
                               f"{', '.join(map(str, blind))} cannot see what process 0 writes there. Use a shared "
                               "filesystem (NFS, a gcsfuse-mounted bucket) that every host mounts at the same path")


def all_processes(flag: bool) -> bool:
    """Whether `flag` holds on every process; the same answer everywhere."""
    return not any_process(not flag)
