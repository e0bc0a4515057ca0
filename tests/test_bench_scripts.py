"""The benchmark scripts' own code paths at toy sizes (`python bench/...` runs them at full size by hand): they
call the library (some of it private, whose signatures change with it), and a bench that no longer runs, or
that counts wrongly, would otherwise go unnoticed until someone times something."""

import importlib.util
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from r3jax import model as rm
from r3jax.sampling import sampler

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    """bench/ is not a package: put it on sys.path (scripts import its `common`) and load the script by path."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_decode_step_bench_loop_runs_and_its_budget_changes_nothing():
    """bench/decode_step.py times the sampler's own prefill, loop state and decode step, called directly: its loop
    runs, stamps every step, and the cache budget it compares changes no greedy logit."""
    bench = _load("decode_step")
    config = rm.tiny()
    graphdef, params = rm.split_params(rm.init_model(config, seed=0))
    tokens = np.random.RandomState(0).randint(0, config.vocab_size, (4, 6))
    logits = {}
    for budget in (8, 40):
        bench._stamps.clear()
        cfg = sampler.SamplingConfig(max_new_tokens=budget, temperature=0.0)
        logits[budget] = np.asarray(bench._steps(graphdef, cfg, 5, params, tokens, np.ones_like(tokens, bool),
                                                 jax.random.key(0)))
        assert len(bench._stamps) == 5  # one host stamp per step
    np.testing.assert_allclose(logits[40], logits[8], atol=1e-5)


def test_the_long_tail_bench_counts_the_same_rollouts_in_every_schedule(monkeypatch, capsys):
    """bench/long_tail.py at 3 prompts x 2 samples, budget 12: its record's schedules generate the same tokens,
    the static batch steps every row until the longest ends, and utilisation is tokens / slot-steps."""
    bench = _load("long_tail")
    for name, value in dict(VOCAB=256, PROMPT=4, PROMPTS=3, SAMPLES=2, BUDGET=12).items():  # ends: 10 of 256
        monkeypatch.setattr(bench, name, value)
    arch = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    bench.run("toy", dict(arch, slots=(2,)), 1)
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    static, slots = record["static"], record["slots_2"]
    assert static["tokens"] == slots["tokens"] and static["max_length"] == slots["max_length"]
    assert static["slot_steps"] == 6 * static["steps"] == 6 * static["max_length"]
    for r in (static, slots):
        assert r["utilisation"] == round(r["tokens"] / r["slot_steps"], 3) <= 1


def test_the_grader_bench_times_uncached_verdicts(monkeypatch, capsys):
    """bench/grader.py: every timed call grades answers whose verdicts nobody has cached (`judge` keeps the
    verdicts it reached), else it would time cache hits after the first call. 8 responses, 2 rounds, the
    pool with 1 and 2 workers: the in-process side reaches 8 new verdicts per call, 32 in all."""
    bench = _load("grader")
    from r3jax.rewards import equivalence

    monkeypatch.setattr(equivalence, "_VERDICTS", {})
    bench.run("synthetic", dict(batch=8, source="synthetic"), 2)
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(equivalence._VERDICTS) == 2 * 2 * 8
    for workers in (1, 2):
        assert record[f"ratio{workers}"] == pytest.approx(record[f"pool{workers}_responses_per_s_per_worker"]
                                                          / record[f"in_process{workers}_responses_per_s"], rel=0.01)


def test_a_missing_reference_venv_fails_before_any_timed_run(tmp_path):
    """bench/common.check_python (grpo_step's --trl_python, sampler's --tunix_python): a path that is no
    interpreter, or one that lacks a module, ends the bench at once with the flag, the module and the recipe
    for the venv, instead of after the first system's minutes of timed runs."""
    common = _load("common")
    with pytest.raises(SystemExit, match=r"--trl_python .*nothing.*\n.*pip install trl"):
        common.check_python(str(tmp_path / "nothing"), ("json",), "--trl_python", "pip install trl")
    missing = r"--tunix_python .* cannot import json, no_such_module_r3jax(.|\n)*pip install tunix"
    with pytest.raises(SystemExit, match=missing):
        common.check_python(sys.executable, ("json", "no_such_module_r3jax"), "--tunix_python", "pip install tunix")
    import json as stdlib_json
    assert common.check_python(sys.executable, ("json",), "--x", "") == stdlib_json.__version__


def test_the_grpo_bench_refuses_a_run_with_no_steady_step():
    """bench/grpo_step.py: --steps must leave steps after the --skip warm-up ones, else its medians are empty."""
    import argparse
    bench = _load("grpo_step")
    args = argparse.Namespace(rounds=1, skip=2, steps=2, trl_python=sys.executable)
    with pytest.raises(SystemExit, match="--steps > --skip"):
        bench.check_arguments(args)


def test_the_grpo_bench_skips_trl_only_when_no_venv_was_asked_for(monkeypatch, tmp_path):
    """bench/grpo_step.py without --trl_python and without the default TRL venv runs r3jax alone (TRL null, as
    sampler.py does without Tunix); a --trl_python that is given but missing is an error, not a skip."""
    import argparse
    bench = _load("grpo_step")
    monkeypatch.setattr(bench, "DEFAULT_TRL_PYTHON", str(tmp_path / "no_venv" / "python"))
    args = argparse.Namespace(rounds=1, skip=1, steps=3, trl_python=None)
    bench.check_arguments(args)
    assert args.trl_python is None
    with pytest.raises(SystemExit, match="--trl_python"):
        bench.check_arguments(argparse.Namespace(rounds=1, skip=1, steps=3, trl_python=str(tmp_path / "py")))



def test_the_backward_bench_times_the_same_likelihood_in_both_systems(tmp_path, monkeypatch):
    """bench/train_backward.py's two timed calls on its own folder (a toy Qwen2, 3 x 16 tokens): r3jax's summed
    log-likelihood is PyTorch's mean cross-entropy times the B x (T - 1) predicted tokens, and with the entropy
    term's weight at 0 every gradient is PyTorch's times -B x (T - 1): the bench compares one forward and backward."""
    bench = _load("train_backward")
    monkeypatch.setattr(bench, "ENTROPY_WEIGHT", 0.0)
    case = dict(cfg=dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2), batch=3, seq=16)
    bench.write_folder(str(tmp_path), case)
    (objective, loglik), grads = bench.r3jax_call(str(tmp_path), "dots")()
    loss, hf = bench.torch_call(str(tmp_path))()
    predicted = case["batch"] * (case["seq"] - 1)
    assert float(loglik) == float(objective) == pytest.approx(-loss.item() * predicted, rel=1e-5)
    pairs = {"lm_head": hf.lm_head.weight, "embed_tokens": hf.model.embed_tokens.weight}
    for name, weight in pairs.items():
        ours, theirs = np.asarray(grads[name][...]), -predicted * weight.grad.numpy()
        theirs = theirs.T if theirs.shape != ours.shape else theirs
        np.testing.assert_allclose(ours, theirs, atol=1e-4 * np.abs(theirs).max(), err_msg=name)


def test_the_backward_bench_floor_holds_every_flop_and_times_the_product_in_each_layout():
    """bench/train_backward.py's dot floor: its products hold exactly the bench's FLOP count (3 x the forward's,
    causal attention halved), and in each of the four operand layouts both timers compute [b, m, k] x [b, k, n]
    of the stored operands (a layout that computed something else would time the wrong work)."""
    bench = _load("train_backward")
    from model_forward import forward_flops_per_token

    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2)
    dots = bench.dot_list(cfg, batch=3, seq=16)
    flops = sum(2 * x["b"] * x["m"] * x["k"] * x["n"] * x["count"] for x in dots)
    assert flops == pytest.approx(3 * forward_flops_per_token(cfg, 16) * 3 * 16, rel=1e-12)

    for a_t in (False, True):
        for b_t in (False, True):
            a, w = bench._operands(2, 5, 3, 4, a_t, b_t)
            expected = (a.transpose(0, 2, 1) if a_t else a) @ (w.transpose(0, 2, 1) if b_t else w)
            assert expected.shape == (2, 5, 4)
            for timer in (bench.xla_timer, bench.torch_timer):
                got = np.asarray(timer(2, 5, 3, 4, a_t, b_t)())
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"{timer.__name__} {a_t} {b_t}")
    floor = bench.dot_floor(dots[:2], bench.xla_timer, reps=1)
    assert floor["floor_s"] == pytest.approx(sum(x["best_ms"] / 1e3 * x["count"] for x in floor["dots"]), abs=1e-3)


def test_the_sampler_bench_floor_does_the_same_products_in_both_weight_layouts():
    """bench/sampler.py's matmul floor (a prefill of every prompt token, then decode steps on each prompt's
    last row), with the weights stored [out, in] (HF's) or transposed to [in, out]: both layouts chain the
    same products to the same result, so the faster one is a fair floor."""
    bench = _load("sampler")
    case = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2)
    weights, head, x = bench.floor_weights(case, batch=3)
    assert x.shape == (3 * bench.PROMPT, 32)

    def loop(steps, body, x):
        for _ in range(steps):
            x = body(x)
        return x

    results = {}
    for layout in bench.FLOOR_LAYOUTS:
        ws, hw = (weights, head) if layout == "out_in" else bench.in_out(weights, head)
        assert ws[0][4].shape == ((64, 32) if layout == "out_in" else (32, 64))
        results[layout] = bench.floor_call(x, ws, hw, {"keepdims": True}, layout, 4, loop)
    assert results["out_in"].shape == (3, 32)
    np.testing.assert_allclose(results["in_out"], results["out_in"], rtol=1e-6)


def test_the_replay_rows_bench_times_both_layouts_of_one_step_on_real_replays():
    """bench/replay_rows.py at a toy size: CCR appends k = 2 rows for each of the 2 collapsed groups, the chosen
    layout puts them in a segment of their own after on-policy rows read by group, the joined layout keeps one
    segment read row by row, and the two steps' losses agree."""
    bench = _load("replay_rows")
    model = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    shape = dict(prompts=4, samples=2, prompt=8, new=8)
    record = bench.run("toy", dict(collapsed=2), rounds=1, model=model, shape=shape)
    assert record["ccr_appended"] == 4.0 and record["replay_rows"] == 4
    assert record["segments"] == {"apart": [[8, 1, 2], [4, 1, 0]], "joined": [[12, 1, 0]]}
    assert record["same_loss"] and record["apart_s"] > 0 and record["joined_s"] > 0


def test_the_causal_attention_bench_times_both_paths_and_counts_the_scores_read(monkeypatch, capsys):
    """bench/causal_attention.py at T 64 in blocks of 16: both paths run, and 4 blocks read 10/16 of the scores."""
    from r3jax.model import attention

    bench = _load("causal_attention")
    monkeypatch.setattr(attention, "CAUSAL_BLOCK", 16)
    bench.run("toy", dict(batch=1, seq=64), rounds=1)
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["scores_read"] == (16 * 16 + 16 * 32 + 16 * 48 + 16 * 64) / 64 ** 2
    assert record["dense_s"] > 0 and record["skipping_s"] > 0 and record["speedup"] > 0
