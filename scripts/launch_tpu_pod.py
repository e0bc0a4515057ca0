r"""Run train.py (or eval.py) on every worker of a Cloud TPU VM slice, through `gcloud compute tpus tpu-vm`.

    python scripts/launch_tpu_pod.py create my-pod --zone us-central1-a --accelerator_type v5litepod-32 --spot
    python scripts/launch_tpu_pod.py setup my-pod --zone us-central1-a      # git HEAD + pinned requirements
    python scripts/launch_tpu_pod.py run my-pod --zone us-central1-a --config configs/r1distill_1p5b.py \
        --workdir gs://my-bucket/r3 -- --config.model.path=/models/DeepSeek-R1-Distill-Qwen-1.5B
    python scripts/launch_tpu_pod.py logs my-pod --zone us-central1-a      # follow worker 0 again
    python scripts/launch_tpu_pod.py stop my-pod --zone us-central1-a      # SIGTERM: save a checkpoint, exit
    python scripts/launch_tpu_pod.py delete my-pod --zone us-central1-a
    python scripts/launch_tpu_pod.py all my-pod --zone ... --accelerator_type v4-32 --config ... --workdir gs://...

Every worker runs the same command: `train.py --distributed` lets `jax.distributed.initialize()` find the slice's
hosts by itself, process 0 writes the logs and all processes write the checkpoints, so --workdir must be a place
every worker sees: a gs://BUCKET/PATH workdir is mounted with gcsfuse at /mnt/gcs/BUCKET on every worker (train.py
reads and writes plain files), or give --shared_fs for a filesystem already mounted everywhere. The run is
started under nohup, so it outlives the ssh session; each worker
logs to ~/r3jax-run.log and Ctrl-C only stops following worker 0's log. Flags after `--` go to the script as is.
--dry_run prints every command, one per line, exactly as it would run, and runs none.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shlex
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling launch_common, however loaded
from launch_common import UsageError, count, execute, split_extra  # noqa: E402
from launch_common import fail as _fail  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROG = "launch_tpu_pod.py"

# The Cloud TPU runtime (VM image) for each generation; see cloud.google.com/tpu/docs/runtimes.
RUNTIMES = {"v2": "tpu-ubuntu2204-base", "v3": "tpu-ubuntu2204-base", "v4": "tpu-ubuntu2204-base",
            "v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5", "v6e": "v2-alpha-tpuv6e"}
JAX_TPU = "jax[tpu]==0.10.2"  # the jax / jaxlib pins of setup.cfg, plus the matching libtpu
REMOTE_DIR = "r3jax"  # the code and its .venv, under each worker's home
LOG, PID = "~/r3jax-run.log", "~/r3jax-run.pid"
GCS_MOUNT = "/mnt/gcs"  # gs://BUCKET workdirs are mounted here on every worker (gcsfuse)


def fail(message: str, code: int = 2) -> int:
    return _fail(PROG, message, code)


def generation(accelerator_type: str) -> str:
    """'v5litepod-32' -> 'v5litepod'; an unknown name is refused, listing the known ones."""
    match = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", accelerator_type)
    if match and match.group(1) in RUNTIMES and int(match.group(2)) > 0:
        return match.group(1)
    hint = " (v5e slices are named v5litepod-N)" if accelerator_type.startswith("v5e") else ""
    raise UsageError(f"--accelerator_type: unknown accelerator type {accelerator_type!r}{hint}; expected "
                     f"GEN-N with GEN one of {', '.join(RUNTIMES)}, e.g. v5litepod-32, v4-32, v5p-32")


def gcloud(verb: str, args) -> tuple[list[str], list[str]]:
    """`gcloud compute tpus tpu-vm VERB ...` with the --zone / --project given (else gcloud's configured ones)."""
    command = ["gcloud", "compute", "tpus", "tpu-vm", verb]
    tail = [f"--zone={args.zone}"] if args.zone else []
    tail += [f"--project={args.project}"] if args.project else []
    return command, tail


def ssh(args, worker: str, remote: str) -> list[str]:
    head, tail = gcloud("ssh", args)
    return head + [args.name] + tail + [f"--worker={worker}", f"--command={remote}"]


def create_commands(args) -> list[list[str]]:
    runtime = args.version or RUNTIMES[generation(args.accelerator_type)]
    head, tail = gcloud("create", args)
    command = head + [args.name] + tail + [f"--accelerator-type={args.accelerator_type}", f"--version={runtime}"]
    return [command + (["--spot"] if args.spot else []) + (["--preemptible"] if args.preemptible else [])]


def setup_commands(args) -> list[list[str]]:
    """Copies the code to every worker (git HEAD as a tarball, or a clone) and installs it in a fresh venv."""
    if args.branch and not args.repo:
        raise UsageError("--branch needs --repo (without --repo the committed HEAD of this checkout is copied)")
    commands, python = [], args.python
    if args.repo:
        branch = ["--branch", args.branch] if args.branch else []
        fetch = f"rm -rf {REMOTE_DIR} && " + shlex.join(["git", "clone", "--depth=1", *branch, args.repo, REMOTE_DIR])
    else:
        tarball = os.path.join(tempfile.gettempdir(), f"r3jax-{args.name}.tar.gz")
        commands.append(["git", "-C", str(ROOT), "archive", "--format=tar.gz", f"--output={tarball}", args.ref])
        head, tail = gcloud("scp", args)
        commands.append(head + [tarball, f"{args.name}:r3jax.tar.gz"] + tail + ["--worker=all"])
        fetch = f"rm -rf {REMOTE_DIR} && mkdir {REMOTE_DIR} && tar -xzf r3jax.tar.gz -C {REMOTE_DIR}"
    # The TPU images ship Python 3.10; the project needs 3.11 (from Ubuntu's own repositories).
    install_python = (f"(command -v {python} >/dev/null || (sudo apt-get update -qq && sudo DEBIAN_FRONTEND="
                      f"noninteractive apt-get install -y -qq {python} {python}-venv))")
    remote = " && ".join([install_python, fetch, f"cd {REMOTE_DIR}", f"{python} -m venv .venv",
                          ".venv/bin/pip install -q --upgrade pip",
                          f".venv/bin/pip install -q -e . {shlex.quote(JAX_TPU)}"])
    return commands + [ssh(args, "all", remote)]


def script_argv(args) -> list[str]:
    """The program every worker runs, relative to the code's folder."""
    argv = [".venv/bin/python", args.script, "--distributed"]
    if args.script == "eval.py":
        if args.config or args.workdir:
            raise UsageError("--config / --workdir are train.py's; give eval.py its flags after `--`")
        return argv + args.extra
    if not args.config:
        raise UsageError("--config is required for train.py (a configs/*.py file of this repository)")
    path = args.config.split(":", 1)[0]
    if os.path.isabs(path):
        raise UsageError(f"--config {args.config!r}: give the path relative to the repository (workers have a copy)")
    if not (ROOT / path).is_file():
        raise UsageError(f"--config: no config file {args.config!r} in {ROOT}")
    if not args.workdir:
        raise UsageError("--workdir is required: a gs:// path that every worker can write")
    if not args.workdir.startswith("gs://") and not args.shared_fs:
        raise UsageError(f"--workdir {args.workdir!r} is local to each worker; use a gs:// bucket, or pass "
                         "--shared_fs if it is a filesystem mounted on every worker")
    return argv + [f"--config={args.config}", f"--workdir={mounted(args.workdir)[1]}"] + args.extra


def mounted(workdir: str) -> tuple[str | None, str]:
    """gs://BUCKET/PATH -> (BUCKET, /mnt/gcs/BUCKET/PATH on each worker); other paths are used as they are."""
    if not workdir.startswith("gs://"):
        return None, workdir
    bucket, _, path = workdir[len("gs://"):].partition("/")
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]", bucket):
        raise UsageError(f"--workdir {workdir!r}: {bucket!r} is not a bucket name")
    return bucket, f"{GCS_MOUNT}/{bucket}" + (f"/{path.strip('/')}" if path.strip("/") else "")


def mount_command(bucket: str) -> str:
    """Mounts the bucket with gcsfuse on a worker unless it is mounted (installing gcsfuse if missing)."""
    install = ("(command -v gcsfuse >/dev/null || (echo \"deb https://packages.cloud.google.com/apt "
               "gcsfuse-$(lsb_release -c -s) main\" | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null && "
               "curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo apt-key add - && "
               "sudo apt-get update -qq && sudo apt-get install -y -qq gcsfuse))")
    where = f"{GCS_MOUNT}/{bucket}"
    return (f"{install} && sudo mkdir -p {where} && sudo chown $USER {where} && (mountpoint -q {where} || "
            f"gcsfuse --implicit-dirs {shlex.quote(bucket)} {where})")


def follow(args, worker: int | str) -> list[str]:
    return ssh(args, str(worker), f"tail -n {args.lines} -F {LOG}")


def run_commands(args) -> list[list[str]]:
    """Starts the script under nohup on every worker (refusing if one is still running there)."""
    running = (f'if kill -0 "$(cat {PID} 2>/dev/null)" 2>/dev/null; then echo "a run is still going on '
               f'$(hostname) (pid $(cat {PID})); stop it first" >&2; exit 1; fi')
    start = f"nohup {shlex.join(script_argv(args))} > {LOG} 2>&1 < /dev/null & echo $! > {PID}"
    bucket = None if args.script == "eval.py" else mounted(args.workdir or "")[0]
    mount = f"{mount_command(bucket)} || exit 1; " if bucket else ""
    commands = [ssh(args, "all", f"cd ~/{REMOTE_DIR} || exit 1; {running}; {mount}{start}")]
    return commands + ([] if args.no_follow else [follow(args, 0)])


def stop_commands(args) -> list[list[str]]:
    """SIGTERM on every worker (train.py finishes its step, saves and exits 0); SIGKILL after --grace seconds."""
    remote = (f'pid=$(cat {PID} 2>/dev/null) || exit 0; kill -TERM "$pid" 2>/dev/null || exit 0; '
              f'for i in $(seq {args.grace}); do kill -0 "$pid" 2>/dev/null || exit 0; sleep 1; done; '
              f'echo "$(hostname): still running after {args.grace} s, sending SIGKILL" >&2; kill -KILL "$pid"')
    return [ssh(args, "all", remote)]


def delete_commands(args) -> list[list[str]]:
    head, tail = gcloud("delete", args)
    return [head + [args.name] + tail + (["--quiet"] if args.yes else [])]


def all_commands(args) -> list[list[str]]:
    script_argv(args)  # refuse a bad run before creating anything
    return create_commands(args) + setup_commands(args) + run_commands(args)


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("name", help="the TPU VM slice's name")
    common.add_argument("--zone", help="e.g. us-central1-a (default: gcloud's compute/zone)")
    common.add_argument("--project", help="the Google Cloud project (default: gcloud's core/project)")
    common.add_argument("--dry_run", action="store_true", help="print every command, one per line; run none")

    create = argparse.ArgumentParser(add_help=False)
    create.add_argument("--accelerator_type", required=True, help="GEN-N: v5litepod-32, v4-32, v5p-32, v6e-8, ...")
    create.add_argument("--version", help="the TPU runtime; default per generation: " +
                        ", ".join(f"{g}: {v}" for g, v in RUNTIMES.items()))
    capacity = create.add_mutually_exclusive_group()
    capacity.add_argument("--spot", action="store_true", help="a Spot slice (cheaper, can be reclaimed)")
    capacity.add_argument("--preemptible", action="store_true", help="a preemptible slice (legacy Spot)")

    setup = argparse.ArgumentParser(add_help=False)
    setup.add_argument("--repo", help="git URL to clone on every worker (default: copy this checkout's --ref)")
    setup.add_argument("--branch", help="the branch or tag to clone from --repo (default: its default branch)")
    setup.add_argument("--ref", default="HEAD", help="the commit of this checkout to copy (uncommitted changes "
                       "are not copied; default: HEAD)")
    setup.add_argument("--python", default="python3.11", help="the Python for the venv; installed with apt "
                       "when missing (default: python3.11)")

    follow_args = argparse.ArgumentParser(add_help=False)
    follow_args.add_argument("--lines", type=count, default=200, help="log lines shown before following")

    run = argparse.ArgumentParser(add_help=False)
    run.add_argument("--script", default="train.py", choices=["train.py", "eval.py"], help="the program to run")
    run.add_argument("--config", help="train.py's configs/*.py file, relative to the repository")
    run.add_argument("--workdir", help="train.py's --workdir, shared by all workers: gs://BUCKET/PATH")
    run.add_argument("--shared_fs", action="store_true", help="accept a non-gs:// --workdir (mounted everywhere)")
    run.add_argument("--no_follow", action="store_true", help="start the run and return, without tailing the log")

    main = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = main.add_subparsers(dest="command", required=True, metavar="COMMAND")
    def add(name, parents, text):
        return sub.add_parser(name, parents=parents, help=text, description=text)

    add("create", [common, create], "create the slice")
    add("setup", [common, setup], "copy the code to every worker, install the pinned requirements and jax[tpu]")
    add("run", [common, run, follow_args], "start the script on every worker (its own flags after `--`), then "
        "follow worker 0's log")
    logs = add("logs", [common, follow_args], "follow a worker's log (Ctrl-C stops following, not the run)")
    logs.add_argument("--worker", type=count, default=0, help="which worker's log (default: 0)")
    stop = add("stop", [common], "SIGTERM the run on every worker (train.py saves a checkpoint and exits 0)")
    stop.add_argument("--grace", type=count, default=600, help="seconds to wait for the exit before SIGKILL")
    delete = add("delete", [common], "delete the slice")
    delete.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    add("all", [common, create, setup, run, follow_args], "create, setup and run (flags of all three)")
    return main


def main(argv: list[str]) -> int:
    own, extra = split_extra(argv)
    args = parser().parse_args(own)
    args.extra = extra
    if extra and args.command not in ("run", "all"):
        return fail(f"extra arguments {extra} are only for `run` and `all`")
    builders = {"create": create_commands, "setup": setup_commands, "run": run_commands, "stop": stop_commands,
                "delete": delete_commands, "all": all_commands,
                "logs": lambda a: [follow(a, a.worker)]}
    try:
        commands = builders[args.command](args)
    except UsageError as e:
        return fail(str(e))
    def interrupted(command):
        if command[-1].startswith("--command=tail"):
            print(f"\nstopped following; the run goes on (`{PROG} logs` follows it again, `stop` ends it)")

    return execute(PROG, commands, dry_run=args.dry_run, on_interrupt=interrupted)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
