"""A small seeded run of the grader fuzzer (bench/fuzz_grader.py): in every category no reward-hacking
response is credited, no honest one loses its credit, and nothing crashes, overruns the pool's time bound
or writes a file. The references are the fuzzer's fixed pool (no ../shared data), so the run is the same
everywhere; `python bench/fuzz_grader.py` is the full run (>= 10,000 cases).
"""

import importlib.util
import sys
from pathlib import Path

import pytest

from r3jax import rewards

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load_fuzzer():
    """bench/ is not a package: put it on sys.path (the script imports its `common`) and load the script by path."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("fuzz_grader", BENCH / "fuzz_grader.py")
    module = sys.modules["fuzz_grader"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


fuzz_grader = _load_fuzzer()
# a few seconds of grading: huge answers each cost up to timeout_s, megabyte ones are slow to build
PER_CATEGORY = dict.fromkeys(fuzz_grader.CATEGORIES, 25) | {"huge": 10, "megabyte": 2}


@pytest.fixture(scope="module")
def report():
    with rewards.GradingPool(2, timeout_s=1.0) as grader:
        return fuzz_grader.fuzz(0, PER_CATEGORY, grader, use_data=False)


def test_cases_are_seeded_and_labelled_both_ways():
    first = fuzz_grader.cases(3, PER_CATEGORY, use_data=False, watch_dir="/nonexistent")
    assert first == fuzz_grader.cases(3, PER_CATEGORY, use_data=False, watch_dir="/nonexistent")
    assert first != fuzz_grader.cases(4, PER_CATEGORY, use_data=False, watch_dir="/nonexistent")
    assert {c.category for c in first} == set(fuzz_grader.CATEGORIES)
    assert all(c.expected for c in first if c.category == "honest")
    assert not any(c.expected for c in first if c.category in ("invisible", "injection", "huge"))
    assert {c.expected for c in first if c.category in ("sums", "boxes", "think")} == {True, False}


def test_the_report_counts_every_case(report):
    assert report["cases"] == sum(PER_CATEGORY.values())
    assert sum(s["cases"] for s in report["per_category"].values()) == report["cases"]


@pytest.mark.parametrize("category", fuzz_grader.CATEGORIES)
def test_no_category_fools_the_grader(report, category):
    stats = report["per_category"][category]
    failures = {kind: stats[kind] for kind in fuzz_grader.FAILURES}
    assert failures == dict.fromkeys(fuzz_grader.FAILURES, 0), stats["examples"]
