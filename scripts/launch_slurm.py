r"""Run train.py (or eval.py) on several GPU hosts, one process per host seeing all of its host's GPUs.

    # SLURM: writes an sbatch script and submits it (--print_script only prints it)
    python scripts/launch_slurm.py --nodes 4 --gpus_per_node 8 --partition gpu --time 48:00:00 \
        --config configs/r1distill_1p5b.py --workdir /shared/runs/r3 -- --config.model.path=/models/R1-1.5B
    # Any hosts you can ssh to (the same checkout at the same path on each, e.g. a shared filesystem)
    python scripts/launch_slurm.py --hosts gpu0,gpu1 --config configs/r1distill_1p5b.py --workdir /shared/runs/r3
    python scripts/launch_slurm.py --hosts gpu0,gpu1 --stop            # SIGTERM: save a checkpoint, exit

Under SLURM, `srun` starts one `train.py --distributed` per node and `jax.distributed.initialize()` reads the
coordinator (the first node) and the process ids from SLURM's variables. With --hosts, host i runs
`train.py --coordinator_address=HOST0:PORT --num_processes=N --process_id=I` under nohup, logging to
JOB.I.log in the repository (process 0 writes the run's logs). All processes write the checkpoints, so --workdir
must be on a filesystem every host shares. Flags after `--` go to the script as is. --dry_run prints every
command (and the sbatch script) and runs none.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling launch_common, however loaded
from launch_common import UsageError, count, execute, positive, split_extra  # noqa: E402
from launch_common import fail as _fail  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROG = "launch_slurm.py"


def fail(message: str, code: int = 2) -> int:
    return _fail(PROG, message, code)


def script_args(args) -> list[str]:
    """The script's own flags (after the python executable and the script, before the distributed flags)."""
    if args.script == "eval.py":
        if args.config or args.workdir:
            raise UsageError("--config / --workdir are train.py's; give eval.py its flags after `--`")
        return list(args.extra)
    if not args.config:
        raise UsageError("--config is required for train.py (a configs/*.py file)")
    if not os.path.isfile(os.path.join(args.repo_dir, args.config.split(":", 1)[0])):
        raise UsageError(f"--config: no config file {args.config!r} in {args.repo_dir}")
    if not args.workdir:
        raise UsageError("--workdir is required: a folder on a filesystem that every host shares")
    return [f"--config={args.config}", f"--workdir={args.workdir}"] + args.extra


def sbatch_script(args) -> str:
    """The batch script: SLURM directives, then one srun task per node."""
    if not re.fullmatch(r"(\d+-)?\d+(:\d\d){0,2}", args.time):
        raise UsageError(f"--time {args.time!r}: expected MINUTES, HH:MM:SS or DAYS-HH:MM:SS")
    directives = {"job-name": args.job_name, "nodes": args.nodes or 1, "ntasks-per-node": 1,
                  "gpus-per-node": args.gpus_per_node, "cpus-per-task": args.cpus_per_task, "time": args.time,
                  "output": args.output, "partition": args.partition, "account": args.account}
    if args.signal_grace:
        # SIGTERM this long before the time limit: train.py finishes its step, saves and exits 0.
        directives["signal"] = f"TERM@{args.signal_grace}"
    srun = ["srun", "--kill-on-bad-exit=1", args.python, args.script, "--distributed", *script_args(args)]
    lines = ["#!/bin/bash"] + [f"#SBATCH --{k}={v}" for k, v in directives.items() if v is not None] + [
        "set -euo pipefail",
        "# jax.distributed.initialize() under SLURM gives each process only GPU $SLURM_LOCALID (one process per",
        "# GPU); with one process per node, each must see all of its node's GPUs.",
        "export JAX_LOCAL_DEVICE_IDS=" + ",".join(str(i) for i in range(args.gpus_per_node)),
        f"cd {shlex.quote(args.repo_dir)}",
        shlex.join(srun)]
    return "\n".join(lines) + "\n"


def host_commands(args) -> list[list[str]]:
    """One `ssh HOST ...` per host, starting process I of N in the background (or SIGTERM-ing it with --stop)."""
    hosts = [h for h in args.hosts.split(",") if h]
    if not hosts or len(set(hosts)) != len(hosts):
        raise UsageError(f"--hosts {args.hosts!r}: expected distinct comma-separated host names")
    if args.nodes not in (None, len(hosts)):
        raise UsageError(f"--nodes {args.nodes} but {len(hosts)} --hosts; give one or the other")
    commands = []
    for i, host in enumerate(hosts):
        log, pid = (shlex.quote(os.path.join(args.repo_dir, f"{args.job_name}.{i}.{ext}")) for ext in ("log", "pid"))
        if args.stop:
            remote = (f'pid=$(cat {pid} 2>/dev/null) || exit 0; kill -TERM "$pid" 2>/dev/null; '
                      f'echo "{host}: sent SIGTERM to $pid"')
        else:
            coordinator = hosts[0].rsplit("@", 1)[-1]  # user@host -> host
            argv = [args.python, args.script, f"--coordinator_address={coordinator}:{args.port}",
                    f"--num_processes={len(hosts)}", f"--process_id={i}", *script_args(args)]
            remote = (f"cd {shlex.quote(args.repo_dir)} || exit 1; "
                      f'if kill -0 "$(cat {pid} 2>/dev/null)" 2>/dev/null; then '
                      f'echo "{host}: a run is still going (pid $(cat {pid})); stop it first" >&2; exit 1; fi; '
                      f"nohup {shlex.join(argv)} > {log} 2>&1 < /dev/null & echo $! > {pid}")
        commands.append(["ssh", host, remote])
    if not args.stop and not args.no_follow:
        log = shlex.quote(os.path.join(args.repo_dir, f"{args.job_name}.0.log"))
        commands.append(["ssh", hosts[0], f"tail -n 200 -F {log}"])
    return commands


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--script", default="train.py", choices=["train.py", "eval.py"], help="the program to run")
    p.add_argument("--config", help="train.py's configs/*.py file (relative to --repo_dir, or absolute)")
    p.add_argument("--workdir", help="train.py's --workdir, on a filesystem shared by all hosts")
    p.add_argument("--repo_dir", default=str(ROOT), help="this repository's path on the hosts (default: %(default)s)")
    p.add_argument("--python", default="python", help="the Python on the hosts, e.g. .venv/bin/python "
                   "(default: python, which sbatch takes from the submitting shell's PATH)")
    p.add_argument("--job_name", default="r3jax", help="SLURM's job name; with --hosts, the log/pid file stem")
    p.add_argument("--dry_run", action="store_true", help="print the sbatch script and every command; run none")
    slurm = p.add_argument_group("SLURM")
    slurm.add_argument("--nodes", type=positive, help="hosts, one process each (default: 1)")
    slurm.add_argument("--gpus_per_node", type=positive, default=8, help="GPUs per host (default: 8)")
    slurm.add_argument("--cpus_per_task", type=positive, default=16,
                       help="CPU cores per host's process, for grading and data (default: 16)")
    slurm.add_argument("--time", default="24:00:00", help="the job's time limit (default: 24:00:00)")
    slurm.add_argument("--partition", help="the SLURM partition (default: the cluster's)")
    slurm.add_argument("--account", help="the SLURM account to charge (default: yours)")
    slurm.add_argument("--output", default="%x-%j.out", help="sbatch's log file (default: %%x-%%j.out)")
    slurm.add_argument("--signal_grace", type=count, default=300,
                       help="SIGTERM the run this many seconds before --time ends, so it saves (0: off)")
    slurm.add_argument("--sbatch_file", help="where to write the script (default: JOB_NAME.sbatch here)")
    slurm.add_argument("--print_script", action="store_true", help="print the sbatch script, submit nothing")
    hosts = p.add_argument_group("explicit hosts (no SLURM)")
    hosts.add_argument("--hosts", help="comma-separated host names; the first is the coordinator (process 0)")
    hosts.add_argument("--port", type=positive, default=12345, help="the coordinator's port (default: 12345)")
    hosts.add_argument("--stop", action="store_true", help="SIGTERM the runs on --hosts (they save and exit 0)")
    hosts.add_argument("--no_follow", action="store_true", help="do not tail process 0's log after starting")
    return p


def main(argv: list[str]) -> int:
    own, extra = split_extra(argv)
    args = parser().parse_args(own)
    args.extra = extra
    try:
        if args.hosts:
            commands, script = host_commands(args), None
        elif args.stop:
            raise UsageError("--stop is for --hosts; under SLURM use scancel --signal=TERM JOBID")
        else:
            script = sbatch_script(args)
            commands = [["sbatch", args.sbatch_file or f"{args.job_name}.sbatch"]]
    except UsageError as e:
        return fail(str(e))
    if script is not None and (args.print_script or args.dry_run):
        print(script, end="", flush=True)
        if args.print_script:
            return 0
    elif script is not None:
        pathlib.Path(commands[0][1]).write_text(script)
    return execute(PROG, commands, dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
