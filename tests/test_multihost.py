"""Several hosts on one CPU: train.py and eval.py as two real processes joined by `jax.distributed`.

Each process has 4 fake CPU devices; together they form the same 8-device mesh a one-process run has, and run
the same global programs on the same global batch (collectives over gloo instead of in-process), so they must
end where the one-process run ends: parameters within 1e-6 (reduction order across processes may move the last
bit), every logged number alike. A signal to one process stops both at the same step, both resume from that
checkpoint, and a killed process makes the other exit with JAX's error instead of hanging.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "tiny.py")]
EVAL = [sys.executable, str(REPO / "eval.py")]
RUN = ["--config.steps=3", "--config.checkpoint_every=1", "--config.eval_every=0", "--config.data.eval_limit=4"]
TIMING = ("time/", "tokens_per_s", "compile/seconds", "compile/cache_hits", "compile/count_total")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xla_cache")
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "PYTHONUNBUFFERED": "1",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def start_pair(env, command, log_prefix, *, heartbeat=100):
    """Processes 0 and 1 of a two-host run of `command` (or `command(i)`), 4 CPU devices each; output in
    LOG_PREFIX.{i}.log."""
    port, procs = free_port(), []
    for i in range(2):
        log = open(f"{log_prefix}.{i}.log", "w+")  # noqa: SIM115  (closed by finish)
        argv = command(i) if callable(command) else command
        proc = subprocess.Popen(
            [*argv, f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}",
             f"--heartbeat_timeout_s={heartbeat}"],
            env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, stdout=log,
            stderr=subprocess.STDOUT, text=True)
        proc.log = log
        procs.append(proc)
    return procs


def finish(procs, timeout=900):
    """Waits for every process; returns [(exit code, output)]."""
    out = []
    for p in procs:
        try:
            p.wait(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        p.log.seek(0)
        out.append((p.returncode, p.log.read()))
        p.log.close()
    return out


def metrics(workdir):
    return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def wait_for_step(workdir, step, procs, timeout=600):
    deadline = time.monotonic() + timeout
    path = pathlib.Path(workdir) / "metrics.jsonl"
    while not (path.exists() and any(json.loads(r)["step"] >= step for r in path.read_text().splitlines())):
        for p in procs:
            assert p.poll() is None, f"process exited early ({p.returncode})"
        assert time.monotonic() < deadline, f"no step {step} after {timeout} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def one_process(env, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("one") / "run"
    done = subprocess.run([*TRAIN, "--workdir", str(workdir), *RUN], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return workdir


@pytest.fixture(scope="module")
def two_processes(env, tmp_path_factory):
    """Two hosts: SIGTERM to process 1 after step 1, then both rerun with the same command."""
    workdir = tmp_path_factory.mktemp("two") / "run"
    command = [*TRAIN, "--workdir", str(workdir), *RUN]
    procs = start_pair(env, command, workdir)
    wait_for_step(workdir, 1, procs)
    procs[1].send_signal(signal.SIGTERM)
    stopped = finish(procs)
    resumed = finish(start_pair(env, command, f"{workdir}.resumed"))
    return workdir, stopped, resumed


def test_a_signal_to_one_process_stops_both_at_the_same_checkpoint(two_processes):
    _, stopped, _ = two_processes
    assert [code for code, _ in stopped] == [0, 0], stopped
    assert "Stopped at step" in stopped[0][1] and "another process's signal" in stopped[0][1], stopped[0][1]


def test_every_process_resumes_and_finishes(two_processes):
    workdir, stopped, resumed = two_processes
    assert [code for code, _ in resumed] == [0, 0], resumed
    assert "Done: 3 steps." in resumed[0][1] and "Done" not in resumed[1][1]  # process 0 alone reports
    assert [r["step"] for r in metrics(workdir)] == [1, 2, 3]


def test_two_processes_end_where_one_process_ends(one_process, two_processes):
    workdir = two_processes[0]
    one, two = load_file(one_process / "final" / "model.safetensors"), load_file(workdir / "final" /
                                                                                   "model.safetensors")
    assert one.keys() == two.keys()
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=0, atol=1e-6, err_msg=name)


def test_two_processes_log_what_one_process_logs(one_process, two_processes):
    for a, b in zip(metrics(one_process), metrics(two_processes[0]), strict=True):
        keys = [k for k in a if not k.startswith(TIMING)]
        assert sorted(keys) == sorted(k for k in b if not k.startswith(TIMING))
        for k in keys:
            assert (a[k] is None and b[k] is None) or a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k)


def test_evaluation_samples_are_those_of_one_process(one_process, two_processes):
    one = (one_process / "eval" / "step_3.jsonl").read_text()
    assert one and (two_processes[0] / "eval" / "step_3.jsonl").read_text() == one


def test_eval_py_on_two_processes_writes_what_one_process_writes(env, one_process, tmp_path):
    # --model: a train.py workdir, whose checkpoint every process reads its shards of
    args = ["--model", str(one_process), "--data", str(REPO / "configs" / "tiny" / "eval.jsonl"),
            "--limit", "6", "--num_samples", "2", "--max_new_tokens", "12", "--batch_size", "8", "--timeout_s", "2"]
    single = subprocess.run([*EVAL, *args, "--output", str(tmp_path / "one")], env=env, capture_output=True,
                            text=True, timeout=600)
    assert single.returncode == 0, single.stdout + single.stderr
    pair = finish(start_pair(env, [*EVAL, *args, "--output", str(tmp_path / "two")], tmp_path / "two"))
    assert [code for code, _ in pair] == [0, 0], pair
    assert (tmp_path / "two" / "samples.jsonl").read_text() == (tmp_path / "one" / "samples.jsonl").read_text()
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert two["benchmarks"] == one["benchmarks"]


def test_a_killed_process_stops_the_other_with_an_error(env, tmp_path):
    workdir = tmp_path / "run"
    procs = start_pair(env, [*TRAIN, "--workdir", str(workdir), "--config.steps=200", "--config.eval_every=0",
                             "--config.checkpoint_every=0"], workdir, heartbeat=10)
    wait_for_step(workdir, 1, procs)
    procs[1].kill()
    started = time.monotonic()
    (code, out), _ = finish(procs, timeout=120)
    assert time.monotonic() - started < 120
    assert code != 0
    assert "another task died" in out or "tasks are unhealthy" in out, out[-3000:]


def test_half_a_distributed_setting_is_refused_before_jax_starts(env, tmp_path):
    done = subprocess.run([*TRAIN, "--workdir", str(tmp_path / "run"), "--num_processes=2"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--coordinator_address" in done.stderr and "--process_id" in done.stderr, done.stderr


def test_a_workdir_that_is_not_shared_is_refused_by_every_process(env, tmp_path):
    procs = start_pair(env, lambda i: [*TRAIN, "--workdir", str(tmp_path / f"host{i}"), *RUN], tmp_path / "run")
    for code, out in finish(procs, timeout=300):
        assert code == 2, out[-2000:]
        assert "is not one folder shared by all hosts: process(es) 1 cannot see" in out, out[-2000:]


def test_a_url_workdir_is_refused(env, tmp_path):
    done = subprocess.run([*TRAIN, "--workdir", "gs://bucket/run"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "URLs are not supported" in done.stderr, done.stderr


@pytest.mark.parametrize("environ, size", [
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, 32),
    ({"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=true --xla_force_host_platform_device_count=2"}, 8),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "NPROC": "5"}, None),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PJRT_NPROC": "5"}, None),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}, None),
    ({"JAX_NUM_CPU_DEVICES": "4"}, 16),
    ({"JAX_NUM_CPU_DEVICES": "1", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, None),
    ({}, None)], ids=["8_devices", "2_devices_among_flags", "user_nproc", "user_pjrt_nproc", "1_device",
                      "jax_num_cpu_devices", "jax_num_cpu_devices_first", "no_flags"])
def test_fake_cpu_devices_get_threads_for_several_collectives_in_flight_each(environ, size):
    """XLA:CPU's pool (NPROC) gets 4 threads per fake device, unless the user sized it or there is one device."""
    from r3jax import hosts

    before = dict(environ)
    assert hosts.size_cpu_thread_pool(environ) == size
    assert environ == (before if size is None else {**before, "NPROC": str(size)})
