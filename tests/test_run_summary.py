"""A run's before -> after summary (`r3jax.train.summary`) and the comparison's numbers (`r3jax.train.compare`)."""

import json
import pathlib

import numpy as np
import pytest
from rich.console import Console

from r3jax.train import compare, summary


def eval_row(step, easy, hard, none=0.5):
    return {"step": step, "eval/easy/pass@1": easy, "eval/hard/pass@1": hard, "eval/avg/pass@1": (easy + hard) / 2,
            "eval/easy/solve_none": none, "eval/hard/solve_none": none, "eval/avg/solve_none": none}


def train_row(step, **kw):
    return {"step": step, "reward/mean": 0.5, "rollout/length_mean": 40.0, "r3/zero_adv_frac_before": 0.5,
            "r3/zero_adv_frac_after": 0.25, "time/train_s": 1.0, "time/sample_s": 0.5, **kw}


def test_before_after_takes_the_first_and_last_evaluations():
    rows = [eval_row(0, 0.5, 0.1, 0.6), train_row(1), eval_row(2, 0.6, 0.2), train_row(3), eval_row(4, 0.7, 0.3, 0.2)]
    got = summary.before_after(rows)
    assert (got["before"], got["after"]) == (0, 4)
    assert list(got["sets"]) == ["easy", "hard", "avg"]
    assert got["sets"]["avg"]["pass@1"] == (0.3, 0.5)
    assert got["sets"]["hard"]["solve_none"] == (0.6, 0.2)


def test_no_summary_without_two_evaluations():
    assert summary.before_after([train_row(1), eval_row(2, 0.5, 0.5)]) is None


def test_print_summary_writes_summary_json(tmp_path):
    console = Console(record=True, width=140)
    rows = [eval_row(0, 0.5, 0.1), eval_row(4, 0.75, 0.25)]
    summary.print_summary(console, rows, tmp_path, final=tmp_path / "final")
    text = console.export_text()
    assert "overall" in text and "30.0%" in text and "50.0%" in text and "+20.0" in text
    assert str(tmp_path / "final") in text and "metrics.jsonl" in text
    assert json.loads((tmp_path / "summary.json").read_text())["sets"]["avg"]["pass@1"] == [0.3, 0.5]


def run_rows(curve, zero=0.25, ccr=1.0):
    rows = []
    for step, acc in curve:
        trained = train_row(step, **{"r3/zero_adv_frac_after": zero, "r3/ccr_groups": ccr}) if step else {}
        rows.append({**trained, **eval_row(step, acc, acc)})
    return rows


def test_run_numbers_area_and_averages():
    got = compare.run_numbers(run_rows([(0, 0.2), (10, 0.4), (20, 0.4)]))
    assert got["final"] == pytest.approx(0.4)
    assert got["auc"] == pytest.approx((0.3 * 10 + 0.4 * 10) / 20)
    assert got["zero_adv"] == pytest.approx(0.25) and got["ccr_groups"] == pytest.approx(1.0)
    assert got["wall_s"] == pytest.approx(2 * 1.5)


def test_aggregate_counts_steps_to_the_reference_accuracy():
    per_run = {"grpo": [compare.run_numbers(run_rows([(0, 0.2), (10, 0.3), (20, a)])) for a in (0.4, 0.5)],
               "r3": [compare.run_numbers(run_rows([(0, 0.2), (10, a), (20, 0.6)])) for a in (0.45, 0.5)] +
                     [compare.run_numbers(run_rows([(0, 0.2), (10, 0.3), (20, 0.4)]))]}
    table = compare.aggregate(per_run, "grpo")
    assert table["grpo"]["final"]["mean"] == pytest.approx(0.45)
    assert table["grpo"]["final"]["std"] == pytest.approx(np.std([0.4, 0.5], ddof=1))
    assert table["r3"]["to_ref"] == {"target": pytest.approx(0.45), "mean": 10.0, "reached": 2}
    text = compare.markdown(table, "grpo")
    assert text.count("\n") == 4 and "| r3 | 53.3 ± 11.5 | 10 (2/3) |" in text


def test_the_starting_policy_does_not_reach_the_reference():
    assert compare.first_reaching([(0, 0.5), (10, 0.3), (20, 0.45)], 0.4) == 20


def test_plan_names_workdirs_and_refuses_unknown_variants(tmp_path):
    jobs = compare.plan(["grpo", "r3-no-isr"], [0, 1], tmp_path, train_py="train.py", config="c.py", steps=2,
                        eval_every=1, extra=["--config.data.eval_limit=2"])
    assert [(j.variant, j.seed, j.workdir) for j in jobs][1] == ("grpo", 1, tmp_path / "grpo" / "seed1")
    assert "--config.rl.r3.reflection=False" in jobs[3].command and jobs[3].command[-1] == "--config.data.eval_limit=2"
    with pytest.raises(ValueError, match="unknown variants"):
        compare.plan(["gpro"], [0], tmp_path, train_py="t", config="c", steps=1, eval_every=1, extra=[])


def test_plot_writes_a_png(tmp_path):
    per_run = {"grpo": [compare.run_numbers(run_rows([(0, 0.2), (10, 0.3)])) for _ in range(2)]}
    compare.plot(per_run, tmp_path / "curves.png")
    assert pathlib.Path(tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
