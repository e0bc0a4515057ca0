"""`python train.py` end to end on configs/tiny.py: outputs, exact resume after real kills, signals, bad input.

Every run is a real subprocess. They share one XLA compilation cache (a process after the first compiles
nothing), and the uninterrupted reference run is made once per module.
"""

import json
import os
import pathlib
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "tiny.py")]
TIMING_KEYS = ("time/", "tokens_per_s", "compile/seconds", "compile/cache_hits", "compile/count_total")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The test process's environment, less conftest's NPROC: train.py sizes XLA:CPU's thread pool for its 8 fake
    devices itself (`hosts.size_cpu_thread_pool`), as a user's run does."""
    cache = tmp_path_factory.mktemp("xla_cache")
    return {**{k: v for k, v in os.environ.items() if k != "NPROC"}, "JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
            "PYTHONUNBUFFERED": "1"}


def train(env, workdir, *overrides, timeout=900):
    """train.py on configs/tiny.py (8 fake CPU devices: conftest's XLA_FLAGS, whose groups of 4 rows span two
    devices). A watchdog: a run that has not exited after `timeout` s fails naming the last step it logged."""
    try:
        return subprocess.run([*TRAIN, "--workdir", str(workdir), *overrides], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        logged = [r["step"] for r in rows(workdir)]
        pytest.fail(f"train.py {' '.join(overrides)} hung: no exit after {timeout} s, last step logged: "
                    f"{logged[-1] if logged else 'none'} (a collective waiting on another program's devices?)")


def start(env, workdir, *overrides):
    """A background run whose output goes to a file beside the workdir (a pipe nobody reads could fill)."""
    log = open(pathlib.Path(workdir).with_suffix(".log"), "w+")  # noqa: SIM115  (closed with the process)
    proc = subprocess.Popen([*TRAIN, "--workdir", str(workdir), *overrides], env=env, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc


def output(proc):
    proc.log.seek(0)
    return proc.log.read()


def rows(workdir):
    path = pathlib.Path(workdir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_rows(workdir, n, proc, timeout=600):
    deadline = time.monotonic() + timeout
    while len(rows(workdir)) < n:
        assert proc.poll() is None, output(proc)
        assert time.monotonic() < deadline, f"no row {n} after {timeout} s"
        time.sleep(0.05)


def without_timings(table):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)} for r in table]


def final_params(workdir):
    from safetensors.numpy import load_file

    return load_file(str(pathlib.Path(workdir) / "final" / "model.safetensors"))


def assert_same_run(got, want):
    assert without_timings(rows(got)) == without_timings(rows(want))
    a, b = final_params(got), final_params(want)
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name  # bitwise


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reference")
    done = train(env, workdir)
    assert done.returncode == 0, done.stderr + done.stdout
    return workdir


def test_outputs_hold_the_logged_values(reference):
    table = rows(reference)
    assert [r["step"] for r in table] == [1, 2, 3, 4, 5, 6]
    for key in ("reward/mean", "groups/solve_none_frac", "r3/zero_adv_frac_before", "r3/zero_adv_frac_after",
                "policy/loss", "policy/grad_norm", "policy/logprob_mismatch", "policy/skipped_steps",
                "compile/count", "time/sample_s", "time/grade_s", "time/train_s", "time/other_s", "tokens_per_s",
                "rollout/entropy_mean"):
        assert all(key in r for r in table), key
    assert [r["compile/count"] for r in table] == [0] * 6  # no recompilation after step 2
    assert "eval/arith/pass@1" in table[2] and "eval/arith/pass@1" in table[5]
    assert [r["data/epoch"] for r in table] == [0, 0, 0, 0, 1, 1]  # 16 questions, 4 per step
    # every question is hard for a random model: ISR prompts fill their 4 slots from epoch 2 on, not before
    assert [r["r3/isr_prompts"] for r in table] == [0, 0, 0, 0, 4, 4]
    logged = tensorboard_scalars(reference / "tb")
    assert logged["reward/mean"] == [(r["step"], pytest.approx(r["reward/mean"])) for r in table]
    for name in ("reward", "groups", "zero_advantage", "entropy", "length", "eval", "fig4"):
        png = reference / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, name


def tensorboard_scalars(folder):
    """tag -> [(step, value)] from the TFRecord event files (length, crc, event proto, crc)."""
    from tensorboardX.proto import event_pb2

    out = {}
    for file in sorted(pathlib.Path(folder).glob("events.out.tfevents.*")):
        data = file.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_final_model_reloads_in_transformers_with_the_same_logits(reference):
    import torch
    import transformers

    from r3jax import model as rm

    folder = reference / "final"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("What is 3 + 4? <think>", add_special_tokens=False)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits.numpy()
    ours, _ = rm.load_pretrained(folder)
    got = np.asarray(ours(np.array([ids]), attention_mask=np.ones((1, len(ids)), bool)))
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_a_second_identical_run_compiles_nothing(tmp_path):
    """The config's persistent cache (no JAX_* cache variables: the defaults of a user's run) in a fresh folder:
    the first run compiles and says how long it took; the second, in another workdir, reads every program."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    cache = f"--config.compilation_cache={tmp_path / 'cache'}"
    outputs = []
    for name in ("first", "second"):
        done = train({**env, "PYTHONUNBUFFERED": "1"}, tmp_path / name, cache, "--config.steps=2")
        assert done.returncode == 0, done.stderr + done.stdout
        outputs.append(done.stdout)
    first, second = rows(tmp_path / "first"), rows(tmp_path / "second")
    assert first[0]["compile/count_total"] > 10 and first[0]["compile/seconds"] > 0
    assert first[0]["compile/cache_hits"] == 0 and "compile: built" in outputs[0]
    assert [r["compile/count_total"] for r in second] == [0, 0]  # counted: nothing compiled
    assert second[-1]["compile/cache_hits"] == first[-1]["compile/count_total"]
    assert "from the persistent cache" in outputs[1]


@pytest.mark.parametrize("kill_after_rows", [4, 5], ids=["at_epoch_end_mid_save", "mid_step"])
def test_resume_after_sigkill_is_bitwise_identical(env, reference, tmp_path, kill_after_rows):
    """Killed with SIGKILL right after step 4's row (the epoch's last step, its checkpoint being written) or
    during step 6 (checkpoint 4 complete), then rerun: the same params, bit for bit, and the same rows."""
    workdir = tmp_path / "run"
    proc = start(env, workdir)
    wait_for_rows(workdir, kill_after_rows, proc)
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done = train(env, workdir)
    assert done.returncode == 0, done.stderr + done.stdout
    assert_same_run(workdir, reference)


def test_sigterm_finishes_the_step_saves_and_exits_zero(env, reference, tmp_path):
    workdir = tmp_path / "run"
    proc = start(env, workdir)
    wait_for_rows(workdir, 1, proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=600)
    assert proc.returncode == 0, output(proc)
    assert "Resume with the same command" in output(proc)
    stopped = len(rows(workdir))
    assert stopped < 6 and (workdir / "checkpoints" / str(stopped)).is_dir()
    done = train(env, workdir)
    assert done.returncode == 0, done.stderr + done.stdout
    assert_same_run(workdir, reference)


def test_resume_refuses_a_changed_shape_and_allows_a_new_learning_rate(env, reference, tmp_path):
    """Also: a save that was cut off (Orbax's temporary folder left behind) is not a checkpoint."""
    import shutil

    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    partial = tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp-1234" / "state"
    partial.mkdir(parents=True)
    (partial / "junk").write_bytes(b"\0" * 100)
    refused = train(env, tmp_path, "--config.samples_per_prompt=2", "--config.steps=8")
    assert refused.returncode == 2
    assert "samples_per_prompt" in refused.stderr and "checkpoint: 4, now: 2" in refused.stderr
    allowed = train(env, tmp_path, "--config.rl.learning_rate=1e-4", "--config.steps=7")
    assert allowed.returncode == 0, allowed.stderr + allowed.stdout
    assert [r["step"] for r in rows(tmp_path)] == list(range(1, 8))


def cut_short(checkpoint: pathlib.Path) -> None:
    """Every file of a checkpoint's arrays cut to half its length (a partial copy, a disk fault)."""
    files = [f for f in (checkpoint / "state").rglob("*") if f.is_file() and f.stat().st_size > 1]
    assert files
    for f in files:
        with open(f, "r+b") as handle:
            handle.truncate(f.stat().st_size // 2)


def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(env, reference, tmp_path):
    """Checkpoints 4 and 6 kept; 6's array files cut short. The rerun says so, moves 6 aside, resumes from 4 and
    ends bit for bit as the uninterrupted run, with the same rows (the first resumed row also counts the damaged
    checkpoint). When no checkpoint reads, one line names the folder and how to start over."""
    import shutil

    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    cut_short(tmp_path / "checkpoints" / "6")
    done = train(env, tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "checkpoint step 6 cannot be read" in done.stdout and "resuming from step 4" in done.stdout
    assert [p.name.split("-")[0] for p in (tmp_path / "damaged_checkpoints").iterdir()] == ["6"]
    got = rows(tmp_path)
    assert got[4].pop("resume/damaged_checkpoints") == 1
    assert without_timings(got) == without_timings(rows(reference))
    a, b = final_params(tmp_path), final_params(reference)
    assert all(np.array_equal(a[name], b[name]) for name in b)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["4", "6"]

    for step in ("4", "6"):
        cut_short(tmp_path / "checkpoints" / step)
    refused = train(env, tmp_path)
    assert refused.returncode == 2, refused.stderr + refused.stdout
    assert f"no checkpoint in {tmp_path / 'checkpoints'} can be read" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_three_non_finite_updates_in_a_row_stop_the_run(env, tmp_path):
    done = train(env, tmp_path, "--config.rl.learning_rate=1e30", "--config.rl.max_grad_norm=1e30")
    assert done.returncode == 1, done.stderr + done.stdout
    assert "3 updates in a row" in done.stderr and "non-finite" in done.stderr
    table = rows(tmp_path)
    assert [r["policy/skipped"] for r in table[-3:]] == [1.0, 1.0, 1.0]
    assert table[-1]["policy/skipped_steps"] == 3


@pytest.mark.parametrize("overrides, message", [
    (["--config.rl.learnin_rate=1e-5"], "unknown config field 'rl.learnin_rate'; did you mean rl.learning_rate"),
    (["--config.model.path=/no/such/model"], "model.path: model folder '/no/such/model' does not exist"),
    (["--config.data.train=/no/such/train.jsonl"], "data.train: problem file '/no/such/train.jsonl' does not exist"),
    (["--config.prompts_per_step=3"], "must split evenly over the 8 devices"),
    (["--config.max_new_tokens=1000"], "exceeds the model's max_position_embeddings (1024)"),
    (["--config.temperature=0"], "temperature must be > 0"),
], ids=["unknown_field", "model", "data", "mesh", "positions", "temperature"])
def test_bad_input_is_one_clear_message_and_exit_2(env, tmp_path, overrides, message):
    done = train(env, tmp_path / "run", *overrides, timeout=120)
    assert done.returncode == 2, done.stderr + done.stdout
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before anything ran


def test_a_dataset_without_usable_rows_is_refused(env, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_without_fields": 1}\n{"problem": "", "answer": ""}\n')
    done = train(env, tmp_path / "run", f"--config.data.train={bad}", timeout=120)
    assert done.returncode == 2, done.stderr + done.stdout
    assert "data.train" in done.stderr and "line 1" in done.stderr


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "r3"])
def test_every_algorithm_runs_two_steps_on_8_devices_with_groups_spanning_devices(env, tmp_path, algorithm):
    """P = 4 groups of G = 4 rows on 8 devices: every group spans two. R³ with ISR from the first epoch and
    every question counted hard on 4 questions (an epoch a step), so step 2 samples and trains reflection groups
    (from step 1's wrong answers) beside the plain ones. The watchdog in `train` turns a hang into a failure
    naming the step."""
    isr = ["--config.rl.r3.reflection_start_epoch=1", "--config.rl.r3.tau=1.0", "--config.data.limit=4"] \
        if algorithm == "r3" else []
    done = train(env, tmp_path, f"--config.algorithm={algorithm}", "--config.steps=2", *isr, timeout=420)
    assert done.returncode == 0, done.stderr + done.stdout
    table = rows(tmp_path)
    assert [r["step"] for r in table] == [1, 2]
    if algorithm == "r3":
        assert table[1]["r3/isr_prompts"] > 0
    else:
        assert all(r["r3/isr_prompts"] == 0 and r["r3/ccr_appended"] == 0 for r in table)
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_eval_py_on_the_workdir_gives_train_py_s_numbers(env, reference, tmp_path):
    """configs/tiny.py evaluates greedily, 16 tokens, the first 8 questions, batches of 8, eval seed 0."""
    done = subprocess.run([sys.executable, str(REPO / "eval.py"), "--model", str(reference), "--data",
                           str(REPO / "configs" / "tiny" / "eval.jsonl"), "--num_samples", "1", "--temperature", "0",
                           "--max_new_tokens", "16", "--limit", "8", "--batch_size", "8", "--output",
                           str(tmp_path / "eval")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr + done.stdout
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["model"] == {"path": str(reference), "kind": "train_workdir", "step": 6}
    got = results["benchmarks"]["eval"]
    logged = rows(reference)[-1]
    for key in ("pass@1", "mean_response_tokens", "truncation_rate"):
        assert got[key] == logged[f"eval/arith/{key}"], key
    strip = lambda path: [{k: v for k, v in json.loads(x).items() if k != "benchmark"}  # noqa: E731
                          for x in path.read_text().splitlines()]
    assert strip(tmp_path / "eval" / "samples.jsonl") == strip(reference / "eval" / "step_6.jsonl")
