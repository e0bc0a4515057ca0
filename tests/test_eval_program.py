"""eval.py: the unbiased Pass@k, results reproducible from samples.jsonl, resume, length sweeps, bad input."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from r3jax.eval import passk, report

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny"
EVAL = [sys.executable, str(REPO / "eval.py")]


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 0, 1, 0.0), (4, 0, 4, 0.0),                 # nothing correct
    (4, 4, 1, 1.0), (4, 4, 4, 1.0),                 # everything correct
    (5, 1, 5, 1.0),                                 # k = n: one correct sample is enough
    (5, 2, 2, 1 - 3 / 10),                          # 1 - C(3,2) / C(5,2)
    (16, 3, 1, 3 / 16),                             # pass@1 = c / n
    (16, 3, 4, 1 - 715 / 1820),                     # 1 - C(13,4) / C(16,4)
])
def test_unbiased_pass_at_k_hand_values(n, c, k, expected):
    assert passk.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        passk.pass_at_k(4, 1, 8)


def _row(bench, uid, sample, tokens, truncated, correct):
    return {"benchmark": bench, "uid": uid, "sample": sample, "response": "", "tokens": tokens,
            "truncated": truncated, "correct": correct, "reason": "correct" if correct else "mismatch", "batch": 0}


def test_results_and_length_sweep_from_rows():
    rows = [_row("a", "q1", 0, 10, False, True), _row("a", "q1", 1, 30, True, False),
            _row("a", "q2", 0, 20, False, True), _row("a", "q2", 1, 25, False, True),
            _row("b", "q3", 0, 5, False, False), _row("b", "q3", 1, 5, False, True)]
    settings = {"num_samples": 2, "max_new_tokens": [16, 32], "pass_k": [1, 2]}
    out = report.results_from_samples(rows, settings, {"path": "m", "step": None})
    a32, a16 = out["by_budget"]["32"]["benchmarks"]["a"], out["by_budget"]["16"]["benchmarks"]["a"]
    assert a32 == {"pass@1": 0.75, "pass@2": 1.0, "solve_none": 0.0, "mean_response_tokens": 21.25,
                   "truncation_rate": 0.25, "num_questions": 2, "num_samples": 2}
    # at 16 tokens: q1's 30-token and q2's 20- and 25-token samples are cut there, wrong and truncated
    assert a16 == {"pass@1": 0.25, "pass@2": 0.5, "solve_none": 0.5, "mean_response_tokens": 14.5,
                   "truncation_rate": 0.75, "num_questions": 2, "num_samples": 2}
    assert out["benchmarks"] == out["by_budget"]["32"]["benchmarks"]
    assert out["average"]["pass@1"] == pytest.approx((0.75 + 0.5) / 2)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xla_cache")
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random tiny Qwen2 in Hugging Face format with the toy tokenizer (what train.py's final/ looks like)."""
    from r3jax import model as rm

    folder = tmp_path_factory.mktemp("model")
    config = rm.tiny(vocab_size=264, hidden_size=32, intermediate_size=64, max_position_embeddings=512,
                     eos_token_id=256, bos_token_id=257)
    rm.save_pretrained(rm.init_model(config, seed=1), folder)
    for f in (TINY / "tokenizer").iterdir():
        shutil.copy(f, folder)
    return folder


def evaluate(env, model, output, *extra, timeout=600):
    cmd = [*EVAL, "--model", str(model), "--data", str(TINY / "eval.jsonl"), "--output", str(output),
           "--batch_size", "8", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


SAMPLED = ["--num_samples", "4", "--max_new_tokens", "12", "--temperature", "1.0", "--top_p", "0.9",
           "--pass_k", "1,2,4", "--limit", "16"]


@pytest.fixture(scope="module")
def uninterrupted(env, model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "run"
    done = evaluate(env, model_dir, out, *SAMPLED)
    assert done.returncode == 0, done.stderr + done.stdout
    return out


def recount(rows, ks, n):
    per = {}
    for r in rows:
        per.setdefault(r["uid"], []).append(r["correct"])
    return {**{f"pass@{k}": float(np.mean([passk.pass_at_k(n, sum(v), k) for v in per.values()])) for k in ks},
            "solve_none": float(np.mean([sum(v) == 0 for v in per.values()])),
            "mean_response_tokens": float(np.mean([r["tokens"] for r in rows])),
            "truncation_rate": float(np.mean([r["truncated"] for r in rows])), "num_questions": len(per),
            "num_samples": n}


def test_results_json_is_a_count_over_samples_jsonl(uninterrupted):
    rows = [json.loads(line) for line in (uninterrupted / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 16 * 4 and len({(r["uid"], r["sample"]) for r in rows}) == 64
    results = json.loads((uninterrupted / "results.json").read_text())
    assert results["benchmarks"]["eval"] == pytest.approx(recount(rows, [1, 2, 4], 4))
    assert results["settings"]["temperature"] == 1.0 and results["model"]["kind"] == "huggingface"
    assert (uninterrupted / "pass_at_k.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_after_a_kill_equals_an_uninterrupted_run(env, model_dir, uninterrupted, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([*EVAL, "--model", str(model_dir), "--data", str(TINY / "eval.jsonl"), "--output",
                             str(out), "--batch_size", "8", *SAMPLED], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    samples = out / "samples.jsonl"
    while proc.poll() is None and not (samples.exists() and samples.read_text().count("\n") >= 1):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # and a batch cut in the middle of a row, as a kill during the write leaves it
    text = samples.read_text()
    samples.write_text(text[:len(text) // 2 + 7])
    done = evaluate(env, model_dir, out, *SAMPLED)
    assert done.returncode == 0, done.stderr + done.stdout
    got = json.loads((out / "results.json").read_text())
    want = json.loads((uninterrupted / "results.json").read_text())
    assert got["benchmarks"] == want["benchmarks"]
    key = lambda r: (r["uid"], r["sample"])  # noqa: E731
    rows = lambda p: sorted((json.loads(x) for x in (p / "samples.jsonl").read_text().splitlines()), key=key)  # noqa: E731
    assert rows(out) == rows(uninterrupted)


def test_a_greedy_length_sweep_equals_separate_runs(env, model_dir, tmp_path):
    greedy = ["--num_samples", "1", "--temperature", "0", "--limit", "8"]
    sweep = evaluate(env, model_dir, tmp_path / "sweep", *greedy, "--max_new_tokens", "4,16")
    assert sweep.returncode == 0, sweep.stderr
    short = evaluate(env, model_dir, tmp_path / "short", *greedy, "--max_new_tokens", "4")
    assert short.returncode == 0, short.stderr
    swept = json.loads((tmp_path / "sweep" / "results.json").read_text())["by_budget"]["4"]["benchmarks"]
    alone = json.loads((tmp_path / "short" / "results.json").read_text())["benchmarks"]
    assert swept == alone
    assert swept["eval"]["truncation_rate"] > 0  # the cut really happened


def test_bad_input_exits_2_and_overwrites_nothing(env, model_dir, uninterrupted, tmp_path):
    before = (uninterrupted / "samples.jsonl").read_bytes()
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"problem": "", "answer": ""}\n')
    cases = [
        (["--model", str(model_dir), "--data", str(empty), "--output", str(tmp_path / "d")],
         f"{empty}: line 1: problem text is empty"),
        (["--model", str(model_dir), "--data", str(empty), "--output", str(tmp_path / "e"), "--on_error", "skip"],
         "no problems"),
        (["--model", str(model_dir), "--data", "/no/such.jsonl", "--output", str(tmp_path / "a")], "no file"),
        (["--model", str(tmp_path), "--data", str(TINY / "eval.jsonl"), "--output", str(tmp_path / "b")],
         "neither a Hugging Face folder"),
        (["--model", str(model_dir), "--data", str(TINY / "eval.jsonl"), "--output", str(tmp_path / "c"),
          "--num_samples", "2", "--pass_k", "1,4"], "smaller than the largest --pass_k 4"),
        (["--model", str(model_dir), "--data", str(TINY / "eval.jsonl"), "--output", str(uninterrupted),
          "--batch_size", "8", *SAMPLED[:-4], "--pass_k", "1,2,4", "--limit", "8"], "limit was 16, now 8"),
    ]
    for args, message in cases:
        done = subprocess.run([*EVAL, *args], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, (args, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert (uninterrupted / "samples.jsonl").read_bytes() == before
