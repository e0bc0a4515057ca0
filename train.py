"""Train a reasoning model with R³ (or the GRPO / DAPO baselines).

    python train.py --config configs/tiny.py --workdir runs/tiny
    python train.py --config configs/r1distill_1p5b.py --workdir runs/r3 --config.algorithm=grpo

Rerunning the same command with the same --workdir resumes from its latest checkpoint, exactly. Any config
field can be overridden with --config.a.b=value. Bad settings, files or shapes fail before anything compiles,
with one message naming the culprit and exit code 2. On several hosts, run the same command on every host with
--distributed (TPU VMs, SLURM) or --coordinator_address/--num_processes/--process_id (scripts/launch_*.py do
it). The work is done by `r3jax.train`; this file wires.
"""

from __future__ import annotations

import os
import runpy
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from r3jax.train import config as run_config

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "arith.py")


def fail(message: str, code: int = 2) -> None:
    print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def config_path(argv: list[str]) -> str:
    """The --config file named on the command line (absl has not parsed it yet)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return DEFAULT_CONFIG


def check_command_line(argv: list[str]) -> None:
    """Unknown --config.* fields get a clear message (with the close names) before absl raises on them."""
    path = config_path(argv).split(":", 1)[0]
    if not os.path.isfile(path):
        fail(f"--config: no config file {path!r}")
    try:
        base = runpy.run_path(path)["get_config"]()
        run_config.check_overrides(argv[1:], base)
        run_config.check_override_values(argv[1:], base)
    except run_config.ConfigError as e:
        fail(str(e))


if __name__ == "__main__":  # before the flags below: config_flags reads the overrides while defining its flag
    check_command_line(sys.argv)

try:  # config_flags applies the --config.* overrides here; one it cannot (a value of the wrong type) fails in one line
    _CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "a configs/*.py file with get_config()")
except Exception as e:  # noqa: BLE001  (ml_collections raises several kinds)
    fail("--config: " + " ".join(str(e).split()))
_WORKDIR = flags.DEFINE_string("workdir", None, "where checkpoints, metrics, plots and the final model go "
                               "(default: runs/<config name>); on several hosts, a folder they all share")
# several hosts (one process each, the same command on all): r3jax.hosts.initialize
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "join the other hosts with jax.distributed, found by JAX's "
                                 "cluster detection (TPU VMs, SLURM, Open MPI)")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0 (or JAX_COORDINATOR_ADDRESS)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes in the run (or JAX_NUM_PROCESSES)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index (or JAX_PROCESS_ID)")
_HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout_s", 100, "a process silent this long is dead: the others stop")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        fail(f"unexpected arguments {argv[1:]}; settings go in --config.a.b=value")
    # imported here so that `--help` and command-line errors never start JAX
    from r3jax import hosts
    from r3jax.train import loop, setup

    try:
        hosts.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, auto=_DISTRIBUTED.value,
                         heartbeat_timeout_s=_HEARTBEAT.value)
    except hosts.DistributedError as e:
        fail(str(e))

    logging.set_verbosity(logging.WARNING)  # Orbax reports every save at INFO

    config = _CONFIG.value
    if _WORKDIR.value and "://" in _WORKDIR.value:
        fail(f"--workdir {_WORKDIR.value!r}: URLs are not supported; mount the bucket (e.g. gcsfuse, as "
             "scripts/launch_tpu_pod.py does) and give its path")
    workdir = _WORKDIR.value or os.path.join("runs", os.path.splitext(os.path.basename(config_path(sys.argv)))[0])
    try:
        setup.check_workdir(workdir)
        run = setup.prepare(config)
        code = loop.train(run, workdir)
    except setup.SetupError as e:
        fail(str(e))
    except loop.TrainingError as e:
        fail(str(e), code=1)
    sys.exit(code)


if __name__ == "__main__":
    app.run(main)
