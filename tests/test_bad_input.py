"""Bad input to the two programs, through their real command lines: exit 2, one line on stderr naming the field,
flag or file, no traceback, nothing written. One row per kind of mistake; configs/tiny.py and the committed arith
model keep every case small."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--config", str(REPO / "configs" / "tiny.py")]

TRAIN_CASES = [  # (id, arguments, what the line must say)
    ("unknown_field", ["--config.sampels_per_prompt=4"], "unknown config field 'sampels_per_prompt'; did you mean "
                                                         "samples_per_prompt"),
    ("unknown_nested_field", ["--config.rl.learnin_rate=1e-5"], "did you mean rl.learning_rate"),
    ("not_an_integer", ["--config.steps=abc"], "config field steps must be an integer, got 'abc'"),
    ("not_a_number", ["--config.rl.learning_rate=nan"], "config field rl.learning_rate must be a finite number"),
    ("not_a_bool", ["--config.eval_at_start=maybe"], "config field eval_at_start must be true or false"),
    ("negative_learning_rate", ["--config.rl.learning_rate=-1"], "config field rl.learning_rate must be positive, "
                                                                 "got -1.0"),
    ("negative_warmup", ["--config.rl.warmup_steps=-3"], "config field rl.warmup_steps must be non-negative"),
    ("zero_grad_clip", ["--config.rl.max_grad_norm=0"], "config field rl.max_grad_norm must be positive"),
    ("r3_probability", ["--config.rl.r3.tau=1.5"], "config field rl.r3.tau must be in [0, 1]"),
    ("zero_steps", ["--config.steps=0"], "config field steps must be a positive integer"),
    ("zero_eval_samples", ["--config.eval.num_samples=0"], "config field eval.num_samples must be a positive integer"),
    ("eval_top_p", ["--config.eval.top_p=1.5"], "config field eval.top_p must be in (0, 1]"),
    ("grading_timeout", ["--config.grading.timeout_s=0"], "config field grading.timeout_s must be > 0"),
    ("grading_workers", ["--config.grading.workers=0"], "config field grading.workers must be a positive integer"),
    ("mesh_axis", ["--config.mesh.tensor=0"], "config field mesh.tensor must be -1 (fill) or a positive integer"),
    ("micro_batches", ["--config.rl.num_micro_batches=0"], "config field rl.num_micro_batches must be at least 1"),
    ("no_config_file", ["--config", "/no/such/config.py"], "--config: no config file '/no/such/config.py'"),
    ("data_on_error", ["--config.data.on_error=ignore"], "config field data.on_error must be 'raise' or 'skip'"),
]


def run(program, args, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(REPO / program), *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)


def assert_one_line_error(done, program, message):
    assert done.returncode == 2, done.stderr + done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith(f"{program}: error:")]
    assert len(errors) == 1, done.stderr
    assert message in errors[0], errors[0]


@pytest.mark.parametrize("args, message", [c[1:] for c in TRAIN_CASES], ids=[c[0] for c in TRAIN_CASES])
def test_train_py_refuses_bad_settings_in_one_line(tmp_path, args, message):
    workdir = tmp_path / "run"
    config = [] if args[:1] == ["--config"] else TINY
    done = run("train.py", [*config, "--workdir", str(workdir), *args], tmp_path)
    assert_one_line_error(done, "train.py", message)
    assert not workdir.exists()  # nothing written


def test_train_py_refuses_a_workdir_that_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("not a folder")
    done = run("train.py", [*TINY, "--workdir", str(tmp_path / "taken")], tmp_path)
    assert_one_line_error(done, "train.py", f"--workdir '{tmp_path / 'taken'}' is a file, not a folder")
    assert (tmp_path / "taken").read_text() == "not a folder"


def test_train_py_names_what_an_empty_model_folder_lacks(tmp_path):
    (tmp_path / "empty").mkdir()
    done = run("train.py", [*TINY, "--workdir", str(tmp_path / "run"), f"--config.model.path={tmp_path / 'empty'}"],
               tmp_path)
    assert_one_line_error(done, "train.py", "has no config.json and no *.safetensors weights (it is empty)")
    (tmp_path / "empty" / "config.json").write_text("{}")
    done = run("train.py", [*TINY, "--workdir", str(tmp_path / "run"), f"--config.model.path={tmp_path / 'empty'}"],
               tmp_path)
    assert_one_line_error(done, "train.py", "has no *.safetensors weights;")


EVAL_CASES = [
    ("zero_samples", ["--num_samples", "0"], "--num_samples must be a positive integer, got 0"),
    ("negative_temperature", ["--temperature", "-1"], "--temperature must be >= 0"),
    ("top_p", ["--top_p", "0"], "--top_p must be in (0, 1]"),
    ("zero_limit", ["--limit", "0"], "--limit must be a positive integer"),
    ("zero_timeout", ["--timeout_s", "0"], "--timeout_s must be > 0 seconds"),
    ("unknown_preset", ["--benchmarks", "aime99"], "--benchmarks: unknown preset 'aime99'"),
    ("empty_model_folder", ["--model", "EMPTY"], "neither a Hugging Face folder"),
]


@pytest.mark.parametrize("args, message", [c[1:] for c in EVAL_CASES], ids=[c[0] for c in EVAL_CASES])
def test_eval_py_refuses_bad_settings_in_one_line(tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    args = [str(tmp_path / "empty") if a == "EMPTY" else a for a in args]
    base = ["--model", str(REPO / "configs" / "arith" / "base"), "--data",
            str(REPO / "configs" / "arith" / "heldout_easy.jsonl"), "--output", str(tmp_path / "out")]
    done = run("eval.py", [*base, *args], tmp_path)
    assert_one_line_error(done, "eval.py", message)
    assert not (tmp_path / "out").exists()


def test_eval_py_refuses_an_output_that_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("results")
    done = run("eval.py", ["--model", str(REPO / "configs" / "arith" / "base"), "--data",
                           str(REPO / "configs" / "arith" / "heldout_easy.jsonl"), "--output", str(tmp_path / "taken")],
               tmp_path)
    assert_one_line_error(done, "eval.py", "is a file, not a folder")


def with_bad_line(source: pathlib.Path, target: pathlib.Path, line: int) -> pathlib.Path:
    """`source`'s lines with a malformed one (a row without an answer) put at 1-based `line`."""
    lines = source.read_text().splitlines()
    lines.insert(line - 1, '{"problem": "What is 2+2?"}')
    target.write_text("\n".join(lines) + "\n")
    return target


def test_a_malformed_training_row_stops_the_run_naming_file_and_line(tmp_path):
    bad = with_bad_line(REPO / "configs" / "tiny" / "train.jsonl", tmp_path / "train.jsonl", 3)
    done = run("train.py", [*TINY, "--workdir", str(tmp_path / "run"), f"--config.data.train={bad}"], tmp_path)
    assert_one_line_error(done, "train.py", f"data.train: {bad}: line 3: no answer")
    assert not (tmp_path / "run").exists()


def test_a_malformed_benchmark_row_stops_eval_naming_file_and_line(tmp_path):
    bad = with_bad_line(REPO / "configs" / "arith" / "heldout_easy.jsonl", tmp_path / "easy.jsonl", 5)
    done = run("eval.py", ["--model", str(REPO / "configs" / "arith" / "base"), "--data", str(bad), "--output",
                           str(tmp_path / "out")], tmp_path)
    assert_one_line_error(done, "eval.py", f"{bad}: line 5: no answer")


def test_eval_skips_malformed_rows_on_request_and_says_so(tmp_path):
    """--on_error skip: the row is left out, said on stderr and under the table, and counted in results.json."""
    import json

    bad = with_bad_line(REPO / "configs" / "arith" / "heldout_easy.jsonl", tmp_path / "easy.jsonl", 2)
    done = run("eval.py", ["--model", str(REPO / "configs" / "arith" / "base"), "--data", str(bad), "--output",
                           str(tmp_path / "out"), "--on_error", "skip", "--limit", "2", "--num_samples", "1",
                           "--max_new_tokens", "8", "--compilation_cache", ""], tmp_path)
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"easy: skipped 1 malformed row of {bad} (line 2: no answer" in done.stderr
    assert "Malformed rows left out (--on_error skip): easy 1" in done.stdout
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["skipped_rows"] == {"easy": 1} and results["benchmarks"]["easy"]["num_questions"] == 2
