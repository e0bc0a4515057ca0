"""The launch scripts' command lines: what --dry_run prints is exactly what runs, and bad input is refused.

Fake `gcloud` / `git` / `sbatch` / `ssh` programs on PATH record their arguments, so nothing reaches a cloud."""

import argparse
import importlib.util
import json
import os
import pathlib
import shlex
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tpu = load("launch_tpu_pod")
slurm = load("launch_slurm")

POD = ["pod", "--zone=us-central2-b", "--project=proj"]
RUN = ["--config", "configs/tiny.py", "--workdir", "gs://bucket/run"]
EXTRA = ["--", "--config.steps=3", "two words"]
HOSTS_RUN = ["--config", "configs/tiny.py", "--workdir", "/shared/run"]


def call(module, argv, capsys):
    """(exit code, stdout, stderr) of the script's main(argv); argparse's exits included."""
    try:
        code = module.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def commands(out):
    return [shlex.split(line) for line in out.splitlines()]


def shell_words(remote):
    """A remote shell command as words, with ; & > as words of their own."""
    lexer = shlex.shlex(remote, posix=True, punctuation_chars=";&>|")
    lexer.whitespace_split = True
    return list(lexer)


def launched_argv(remote):
    """The argv that a remote command starts under nohup."""
    words = shell_words(remote)
    start = words.index("nohup") + 1
    return words[start:words.index(">", start)]


def remote_of(command):
    (flag,) = [w for w in command if w.startswith("--command=")]
    return flag.removeprefix("--command=")


@pytest.fixture(autouse=True)
def fake_bin(tmp_path, monkeypatch):
    """Fake gcloud, git, sbatch and ssh first on PATH (in every test, so that a bug never reaches a real cloud);
    returns a function giving the calls made so far."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    for name in ("gcloud", "git", "sbatch", "ssh"):
        program = bin_dir / name
        program.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                           f"open({str(log)!r}, 'a').write(json.dumps([{name!r}] + sys.argv[1:]) + '\\n')\n"
                           "sys.exit(int(os.environ.get('FAKE_EXIT', '0')))\n")
        program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def subparsers(parser):
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_tpu_help_documents_every_flag(capsys):
    assert call(tpu, ["--help"], capsys)[0] == 0
    for name, sub in subparsers(tpu.parser()).items():
        code, out, _ = call(tpu, [name, "--help"], capsys)
        assert code == 0 and sub.description
        for action in sub._actions:
            assert action.help, (name, action.dest)
            assert all(option in out for option in action.option_strings)


def test_tpu_create_prints_the_gcloud_command(capsys):
    code, out, _ = call(tpu, ["create", *POD, "--accelerator_type", "v5litepod-32", "--spot", "--dry_run"], capsys)
    assert code == 0
    assert commands(out) == [["gcloud", "compute", "tpus", "tpu-vm", "create", "pod", "--zone=us-central2-b",
                              "--project=proj", "--accelerator-type=v5litepod-32",
                              "--version=v2-alpha-tpuv5-lite", "--spot"]]


@pytest.mark.parametrize("accelerator, runtime", [("v4-32", "tpu-ubuntu2204-base"), ("v5p-32", "v2-alpha-tpuv5"),
                                                  ("v5litepod-16", "v2-alpha-tpuv5-lite"),
                                                  ("v6e-8", "v2-alpha-tpuv6e")])
def test_tpu_runtime_default_per_generation(capsys, accelerator, runtime):
    out = call(tpu, ["create", "pod", "--accelerator_type", accelerator, "--preemptible", "--dry_run"], capsys)[1]
    (command,) = commands(out)
    assert f"--version={runtime}" in command and "--preemptible" in command and "--spot" not in command


def test_tpu_version_flag_overrides_the_default(capsys):
    out = call(tpu, ["create", "pod", "--accelerator_type", "v4-8", "--version", "custom-rt", "--dry_run"], capsys)[1]
    assert "--version=custom-rt" in commands(out)[0]


@pytest.mark.parametrize("accelerator", ["v9-8", "v5e-32", "v4", "tpu-32", "v4-0", "v4-32x"])
def test_tpu_unknown_accelerator_type_is_refused(capsys, accelerator):
    code, out, err = call(tpu, ["create", "pod", "--accelerator_type", accelerator, "--dry_run"], capsys)
    assert code == 2 and out == ""
    assert f"unknown accelerator type '{accelerator}'" in err


def test_tpu_spot_and_preemptible_exclude_each_other(capsys):
    code, _, err = call(tpu, ["create", "pod", "--accelerator_type", "v4-8", "--spot", "--preemptible"], capsys)
    assert code == 2 and "not allowed with argument" in err


def test_tpu_setup_copies_git_head_to_every_worker_and_installs_the_pins(capsys):
    archive, scp, install = commands(call(tpu, ["setup", *POD, "--dry_run"], capsys)[1])
    assert archive[:4] == ["git", "-C", str(ROOT), "archive"] and archive[-1] == "HEAD"
    tarball = next(w for w in archive if w.startswith("--output=")).removeprefix("--output=")
    assert scp[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", tarball] and "--worker=all" in scp
    assert install[4:6] == ["ssh", "pod"] and "--worker=all" in install
    remote = remote_of(install)
    assert "tar -xzf r3jax.tar.gz" in remote and "-m venv .venv" in remote
    assert "'jax[tpu]==0.10.2'" in remote and ".venv/bin/pip install -q -e ." in remote


def test_tpu_setup_can_clone_a_branch_instead(capsys):
    out = call(tpu, ["setup", "pod", "--repo", "https://example.com/r3jax.git", "--branch", "dev", "--dry_run"],
               capsys)[1]
    (install,) = commands(out)
    assert "git clone --depth=1 --branch dev https://example.com/r3jax.git r3jax" in remote_of(install)


def test_tpu_setup_branch_needs_repo(capsys):
    code, out, err = call(tpu, ["setup", "pod", "--branch", "dev", "--dry_run"], capsys)
    assert code == 2 and out == "" and "--branch needs --repo" in err


def test_tpu_run_starts_train_on_all_workers_with_extra_args(capsys):
    start, follow = commands(call(tpu, ["run", *POD, *RUN, "--dry_run", *EXTRA], capsys)[1])
    assert start[4:6] == ["ssh", "pod"] and "--worker=all" in start
    assert launched_argv(remote_of(start)) == [".venv/bin/python", "train.py", "--distributed",
                                               "--config=configs/tiny.py", "--workdir=/mnt/gcs/bucket/run",
                                               "--config.steps=3", "two words"]
    assert "--worker=0" in follow and remote_of(follow) == f"tail -n 200 -F {tpu.LOG}"


def test_tpu_run_mounts_a_gs_workdir_on_every_worker_before_starting(capsys):
    (start,) = commands(call(tpu, ["run", *POD, *RUN, "--no_follow", "--dry_run"], capsys)[1])
    remote = remote_of(start)
    assert "gcsfuse --implicit-dirs bucket /mnt/gcs/bucket" in remote
    assert remote.index("gcsfuse --implicit-dirs") < remote.index("nohup")


def test_tpu_run_logs_to_a_file_and_records_the_pid(capsys):
    (start,) = commands(call(tpu, ["run", "pod", *RUN, "--no_follow", "--dry_run"], capsys)[1])
    remote = remote_of(start)
    assert f"> {tpu.LOG} 2>&1 < /dev/null & echo $! > {tpu.PID}" in remote
    assert remote.index("kill -0") < remote.index("nohup")  # refuses to start a second run


def test_tpu_run_eval_passes_its_flags_through(capsys):
    out = call(tpu, ["run", "pod", "--script", "eval.py", "--no_follow", "--dry_run", "--",
                     "--model", "gs://bucket/run", "--output", "gs://bucket/eval"], capsys)[1]
    assert launched_argv(remote_of(commands(out)[0])) == [".venv/bin/python", "eval.py", "--distributed", "--model",
                                                          "gs://bucket/run", "--output", "gs://bucket/eval"]


@pytest.mark.parametrize("argv, problem", [
    (["--config", "configs/nope.py", "--workdir", "gs://b/r"], "no config file 'configs/nope.py'"),
    (["--config", str(ROOT / "configs/tiny.py"), "--workdir", "gs://b/r"], "relative to the repository"),
    (["--workdir", "gs://b/r"], "--config is required"),
    (["--config", "configs/tiny.py"], "--workdir is required"),
    (["--config", "configs/tiny.py", "--workdir", "runs/x"], "use a gs:// bucket"),
    (["--script", "eval.py", "--config", "configs/tiny.py"], "give eval.py its flags after `--`"),
])
def test_tpu_run_bad_input_is_refused(capsys, argv, problem):
    code, out, err = call(tpu, ["run", "pod", *argv, "--dry_run"], capsys)
    assert code == 2 and out == "" and problem in err


def test_tpu_run_accepts_a_shared_filesystem_when_told(capsys):
    out = call(tpu, ["run", "pod", "--config", "configs/tiny.py", "--workdir", "/mnt/nfs/r", "--shared_fs",
                     "--dry_run"], capsys)[1]
    assert "--workdir=/mnt/nfs/r" in launched_argv(remote_of(commands(out)[0]))


def test_tpu_extra_args_only_for_run(capsys):
    code, out, err = call(tpu, ["stop", "pod", "--dry_run", "--", "--x"], capsys)
    assert code == 2 and out == "" and "only for `run` and `all`" in err


def test_tpu_stop_sends_sigterm_then_sigkill_after_the_grace(capsys):
    (stop,) = commands(call(tpu, ["stop", *POD, "--grace", "7", "--dry_run"], capsys)[1])
    remote = remote_of(stop)
    assert "--worker=all" in stop and "seq 7" in remote
    assert tpu.PID in remote and remote.index("kill -TERM") < remote.index("kill -KILL")


def test_tpu_logs_follows_the_chosen_worker(capsys):
    (logs,) = commands(call(tpu, ["logs", "pod", "--worker", "3", "--lines", "50", "--dry_run"], capsys)[1])
    assert "--worker=3" in logs and remote_of(logs) == f"tail -n 50 -F {tpu.LOG}"


def test_tpu_delete_asks_unless_yes(capsys):
    (ask,) = commands(call(tpu, ["delete", *POD, "--dry_run"], capsys)[1])
    (quiet,) = commands(call(tpu, ["delete", *POD, "--yes", "--dry_run"], capsys)[1])
    assert ask[4:6] == ["delete", "pod"] and "--quiet" not in ask and quiet == ask + ["--quiet"]


def test_tpu_all_creates_sets_up_runs_and_follows_in_order(capsys):
    out = call(tpu, ["all", *POD, "--accelerator_type", "v4-32", *RUN, "--dry_run", *EXTRA], capsys)[1]
    steps = [c[4] if c[0] == "gcloud" else c[0] for c in commands(out)]
    assert steps == ["create", "git", "scp", "ssh", "ssh", "ssh"]
    assert "--config.steps=3" in launched_argv(remote_of(commands(out)[4]))


def test_tpu_all_refuses_a_bad_run_before_creating(capsys):
    code, out, err = call(tpu, ["all", "pod", "--accelerator_type", "v4-32", "--config", "configs/nope.py",
                                "--workdir", "gs://b/r", "--dry_run"], capsys)
    assert code == 2 and out == "" and "no config file" in err


def test_tpu_dry_run_executes_nothing(capsys, fake_bin):
    code = call(tpu, ["all", *POD, "--accelerator_type", "v4-32", *RUN, "--dry_run"], capsys)[0]
    assert code == 0 and fake_bin() == []


def test_tpu_runs_exactly_the_printed_commands(capsys, fake_bin):
    code, out, _ = call(tpu, ["all", *POD, "--accelerator_type", "v4-32", *RUN, *EXTRA], capsys)
    assert code == 0 and fake_bin() == commands(out) and len(commands(out)) == 6


def test_tpu_stops_at_the_first_failing_command(capsys, fake_bin, monkeypatch):
    monkeypatch.setenv("FAKE_EXIT", "3")
    code, _, err = call(tpu, ["all", *POD, "--accelerator_type", "v4-32", *RUN], capsys)
    assert code == 3 and len(fake_bin()) == 1 and "exit code 3" in err


def sbatch_directives(script):
    return dict(line.removeprefix("#SBATCH --").split("=", 1) for line in script.splitlines()
                if line.startswith("#SBATCH"))


def test_slurm_help_documents_every_flag(capsys):
    code, out, _ = call(slurm, ["--help"], capsys)
    assert code == 0
    for action in slurm.parser()._actions:
        assert action.help and all(option in out for option in action.option_strings), action.dest


def test_slurm_script_has_one_task_per_node_with_all_gpus(capsys):
    code, out, _ = call(slurm, ["--nodes", "4", "--gpus_per_node", "4", "--cpus_per_task", "24", "--time",
                                "2-00:00:00", "--partition", "gpu", "--account", "lab", *HOSTS_RUN,
                                "--print_script"], capsys)
    assert code == 0 and out.startswith("#!/bin/bash\n")
    assert sbatch_directives(out) == {"job-name": "r3jax", "nodes": "4", "ntasks-per-node": "1",
                                      "gpus-per-node": "4", "cpus-per-task": "24", "time": "2-00:00:00",
                                      "output": "%x-%j.out", "partition": "gpu", "account": "lab",
                                      "signal": "TERM@300"}
    assert "export JAX_LOCAL_DEVICE_IDS=0,1,2,3" in out.splitlines()


def test_slurm_srun_runs_train_distributed_with_extra_args(capsys):
    out = call(slurm, ["--nodes", "2", *HOSTS_RUN, "--print_script", *EXTRA], capsys)[1]
    (srun,) = [shlex.split(line) for line in out.splitlines() if line.startswith("srun")]
    assert srun == ["srun", "--kill-on-bad-exit=1", "python", "train.py", "--distributed",
                    "--config=configs/tiny.py", "--workdir=/shared/run", "--config.steps=3", "two words"]
    assert f"cd {ROOT}" in out.splitlines()


def test_slurm_optional_directives_are_left_out(capsys):
    out = call(slurm, [*HOSTS_RUN, "--signal_grace", "0", "--print_script"], capsys)[1]
    assert not {"partition", "account", "signal"} & set(sbatch_directives(out))


def test_slurm_dry_run_prints_script_and_sbatch_and_writes_nothing(capsys, fake_bin, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.iterdir())
    code, out, _ = call(slurm, ["--nodes", "2", *HOSTS_RUN, "--dry_run"], capsys)
    assert code == 0 and out.startswith("#!/bin/bash\n")
    assert shlex.split(out.splitlines()[-1]) == ["sbatch", "r3jax.sbatch"]
    assert fake_bin() == [] and sorted(tmp_path.iterdir()) == before


def test_slurm_submits_the_printed_script(capsys, fake_bin, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = call(slurm, ["--nodes", "2", *HOSTS_RUN, "--print_script"], capsys)[1]
    code, out, _ = call(slurm, ["--nodes", "2", *HOSTS_RUN, "--sbatch_file", "job.sbatch"], capsys)
    assert code == 0 and fake_bin() == [["sbatch", "job.sbatch"]] == commands(out)
    assert (tmp_path / "job.sbatch").read_text() == script


@pytest.mark.parametrize("argv, problem", [
    (["--nodes", "0", *HOSTS_RUN], "argument --nodes: expected an integer >= 1, got '0'"),
    (["--nodes", "-1", *HOSTS_RUN], "argument --nodes"),
    (["--gpus_per_node", "0", *HOSTS_RUN], "argument --gpus_per_node"),
    (["--config", "configs/nope.py", "--workdir", "/shared/run"], "no config file 'configs/nope.py'"),
    (["--workdir", "/shared/run"], "--config is required"),
    (["--config", "configs/tiny.py"], "--workdir is required"),
    (["--time", "tomorrow", *HOSTS_RUN], "--time 'tomorrow'"),
    (["--stop"], "--stop is for --hosts"),
    (["--hosts", "a,a", *HOSTS_RUN], "distinct"),
    (["--hosts", "a,b", "--nodes", "3", *HOSTS_RUN], "--nodes 3 but 2 --hosts"),
])
def test_slurm_bad_input_is_refused(capsys, argv, problem):
    code, out, err = call(slurm, [*argv, "--dry_run"], capsys)
    assert code == 2 and out == "" and problem in err


def test_hosts_get_process_ids_0_to_n_minus_1_and_one_coordinator(capsys):
    out = call(slurm, ["--hosts", "me@gpu0,gpu1,gpu2", "--port", "4321", "--python", ".venv/bin/python",
                       *HOSTS_RUN, "--dry_run", *EXTRA], capsys)[1]
    *starts, follow = commands(out)
    assert [c[:2] for c in starts] == [["ssh", "me@gpu0"], ["ssh", "gpu1"], ["ssh", "gpu2"]]
    for i, (_, _, remote) in enumerate(starts):
        assert launched_argv(remote) == [".venv/bin/python", "train.py", "--coordinator_address=gpu0:4321",
                                         "--num_processes=3", f"--process_id={i}", "--config=configs/tiny.py",
                                         "--workdir=/shared/run", "--config.steps=3", "two words"]
        assert f"{ROOT}/r3jax.{i}.log" in remote and f"{ROOT}/r3jax.{i}.pid" in remote
    assert follow == ["ssh", "me@gpu0", f"tail -n 200 -F {ROOT}/r3jax.0.log"]


def test_hosts_stop_sends_sigterm_to_each_process(capsys):
    out = call(slurm, ["--hosts", "gpu0,gpu1", "--stop", "--dry_run"], capsys)[1]
    stops = commands(out)
    assert [c[1] for c in stops] == ["gpu0", "gpu1"]
    for i, (_, _, remote) in enumerate(stops):
        assert f"{ROOT}/r3jax.{i}.pid" in remote and "kill -TERM" in remote and "nohup" not in remote


def test_hosts_run_eval_with_its_flags(capsys):
    out = call(slurm, ["--hosts", "a,b", "--script", "eval.py", "--no_follow", "--dry_run", "--", "--model", "m"],
               capsys)[1]
    assert [launched_argv(c[2])[1:] for c in commands(out)] == [
        ["eval.py", "--coordinator_address=a:12345", "--num_processes=2", f"--process_id={i}", "--model", "m"]
        for i in range(2)]


def test_hosts_run_exactly_the_printed_commands(capsys, fake_bin):
    code, out, _ = call(slurm, ["--hosts", "gpu0,gpu1", *HOSTS_RUN, *EXTRA], capsys)
    assert code == 0 and fake_bin() == commands(out) and len(commands(out)) == 3
