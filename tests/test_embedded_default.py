"""The embedded default: the committed base model, a shortened `python train.py`, and `scripts/compare.py`."""

import json
import os
import pathlib
import runpy
import subprocess
import sys

import pytest

from r3jax import model as rm
from r3jax import rewards
from r3jax.data import arith, prompts
from r3jax.eval import benchmark

REPO = pathlib.Path(__file__).resolve().parents[1]
BASE = REPO / "configs" / "arith" / "base"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xla_cache")
    return {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", "PYTHONUNBUFFERED": "1"}


def test_base_model_is_a_small_hugging_face_folder():
    names = {p.name for p in BASE.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in BASE.iterdir()) < 8 * 2**20
    config = json.loads((BASE / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["hidden_size"] == 128


def test_base_tokenizer_renders_r1_distill_prompts():
    tokenizer = prompts.load_tokenizer(BASE)
    rendered = prompts.render(tokenizer, "Compute 1+2.")
    assert rendered == "<｜begin▁of▁sentence｜><｜User｜>Compute 1+2.<｜Assistant｜><think>\n"
    ids = prompts.encode(tokenizer, rendered)
    assert tokenizer.decode(ids) == rendered and ids[0] == tokenizer.bos_token_id


def test_base_model_greedy_accuracy_is_in_its_band():
    """Strong where it writes its steps out, falling with difficulty, near zero out of reach, and what
    provenance.json says (greedy, all held-out, the run's budget)."""
    model, _ = rm.load_pretrained(BASE)
    tokenizer = prompts.load_tokenizer(BASE)
    benches = [benchmark.load_benchmark(name, str(REPO / "configs" / "arith" / f"heldout_{name}.jsonl"), tokenizer)
               for name in arith.LEVELS]
    grader = rewards.GradingPool(1, timeout_s=2.0)
    try:
        budget = runpy.run_path(str(REPO / "configs" / "arith.py"))["get_config"]().max_new_tokens
        assert json.loads((BASE / "provenance.json").read_text())["max_new_tokens"] == budget
        got = benchmark.evaluate(model, benches, benchmark.EvalSettings(max_new_tokens=budget, batch_size=64),
                                 tokenizer=tokenizer, grader=grader, eos_ids=(tokenizer.eos_token_id,),
                                 pad_id=tokenizer.pad_token_id, valid_vocab=len(tokenizer))
    finally:
        grader.close()
    stated = json.loads((BASE / "provenance.json").read_text())["greedy_heldout"]
    assert 0.40 <= stated["avg/pass@1"] <= 0.85 and stated["out_of_reach/pass@1"] < 0.1, stated
    levels = [got[f"eval/{name}/pass@1"] for name in arith.LEVELS]
    assert levels == sorted(levels, reverse=True) and levels[0] > levels[-1], levels
    for key, value in stated.items():
        assert got[f"eval/{key}"] == pytest.approx(value, abs=0.03), key


def test_shortened_default_run(env, tmp_path):
    """`python train.py` with no --config: configs/arith.py, evaluated before and after, summary printed."""
    work = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--workdir", str(work), "--config.steps=2",
                           "--config.data.eval_limit=8", "--config.eval.num_samples=2"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["eval/avg/pass@1"] is not None and rows[2]["eval/out_of_reach/solve_none"] is not None
    assert (work / "plots" / "fig4.png").exists() and (work / "final" / "model.safetensors").exists()
    assert json.loads((work / "summary.json").read_text())["before"] == 0
    assert "Held-out accuracy, step 0 -> step 2" in proc.stdout and "overall" in proc.stdout
    assert str(work / "final") in proc.stdout
    config = json.loads((work / "config.json").read_text())
    assert config["model"]["path"] == str(BASE)
    assert config["attention_plan"]["platform"] == "cpu" and config["attention_plan"]["train"] == "xla"
    assert "attention on cpu: train xla" in proc.stdout


def test_compare_runs_every_variant_on_a_two_step_budget(env, tmp_path):
    out = tmp_path / "compare"
    command = [sys.executable, str(REPO / "scripts" / "compare.py"), "--config", str(REPO / "configs" / "tiny.py"),
               "--out", str(out), "--steps", "2", "--eval_every", "1", "--seeds", "0", "--parallel", "2"]
    # one CPU device per run: two runs side by side with 8 fake devices each can starve XLA:CPU's collective
    # rendezvous on 2 cores (it aborts after 40 s), and these runs test the orchestration, not the sharding
    env = {**env, "XLA_FLAGS": env["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=8", "")}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = (out / "compare.md").read_text().splitlines()
    assert len(table) == 2 + 7 and all(f"| {v} |" in "\n".join(table) for v in
                                       ["grpo", "dapo", "r3", "r3-no-ccr", "r3-no-isr", "r3-no-serr", "r3-serr-failed"])
    numbers = json.loads((out / "compare.json").read_text())
    assert numbers["variants"]["r3"]["seeds"] == 1 and (out / "curves.png").exists()
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("done already") == 7, again.stdout + again.stderr


def test_base_model_script_is_reproducible(env, tmp_path):
    """Two warm starts with the same seed write the same weights, a loadable folder and its provenance."""
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "make_arith_base.py"), "--out", str(out),
                               "--steps", "4", "--batch_size", "4", "--reflection_every", "2", "--eval_limit", "2"],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        outs.append(out)
    a, b = ((o / "model.safetensors").read_bytes() for o in outs)
    assert a == b
    model, _ = rm.load_pretrained(outs[0])
    assert model.config.num_hidden_layers == 4
    provenance = json.loads((outs[0] / "provenance.json").read_text())
    assert provenance["steps"] == 4 and "avg/pass@1" in provenance["greedy_heldout"]
