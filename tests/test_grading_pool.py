"""The grading pool: one result per answer, in order, within its time bound, whatever the answers do."""

import math
import os
import threading
import time

import pytest

from r3jax import rewards
from r3jax.rewards import pool as grading_pool

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def grader():
    with rewards.GradingPool(2, timeout_s=TIMEOUT_S, memory_mb=1024) as p:
        yield p


def test_grades_in_order(grader):
    answers = ["25", "24", "\\frac{1}{2}", "x+1", "5"]
    refs = ["025", "25", ["0.5"], "1+x", 5.0]
    assert grader.grade(answers, refs) == [(True, "correct"), (False, "mismatch"), (True, "correct"),
                                           (True, "correct"), (True, "correct")]


def test_adversarial_answers_score_wrong_within_the_bound(grader, tmp_path):
    marker = tmp_path / "PWNED"
    hostile = [
        "9^{9^{9^{9}}}",                                          # a power tower
        "(10^{10})!",
        f"__import__('os').system('touch {marker}')",             # Python, never run
        f"\\text{{__import__('os').system('touch {marker}')}}",
        "{" * 500 + "1" + "}" * 500,                              # deep nesting
        "\\frac{" * 300,
    ]
    kills_before = grader.stats.timeouts
    start = time.perf_counter()
    results = grader.grade(hostile, ["10"] * len(hostile))
    elapsed = time.perf_counter() - start
    assert [ok for ok, _ in results] == [False] * len(hostile)
    assert {why for _, why in results} <= {"timeout", "parse_error", "mismatch"}
    assert not marker.exists()
    kills = grader.stats.timeouts - kills_before
    # ceil(n / workers) * timeout, plus a worker start-up for each kill beyond the first (the spare is warm)
    bound = math.ceil(len(hostile) / grader.num_workers) * TIMEOUT_S + max(0, kills - 1) * 2.0 + 2.0
    assert elapsed < bound, (elapsed, bound, results)


def test_pool_works_after_timeouts(grader):
    grader.grade(["9^{9^{9^{9}}}"], ["1"])
    assert grader.grade(["2"], ["2"]) == [(True, "correct")]


def test_killed_worker_loses_no_result(grader):
    n = 300
    answers = [str(i) for i in range(n)]
    killer = threading.Timer(0.3, lambda: os.kill(grader.worker_pids[0], 9))
    crashes = grader.stats.crashes
    killer.start()
    results = grader.grade(answers, answers)
    killer.join()
    assert results == [(True, "correct")] * n
    assert grader.stats.crashes == crashes + 1


@pytest.mark.skipif(not os.path.exists("/proc/self/limits"), reason="needs Linux /proc")
def test_workers_run_under_resource_limits(grader):
    grader.grade(["1"] * 4, ["1"] * 4)  # every worker has set its CPU limit for a task
    for pid in grader.worker_pids:
        limits = open(f"/proc/{pid}/limits").read()
        assert f"Max address space         {1024 << 20}" in limits
        cpu = next(line for line in limits.splitlines() if line.startswith("Max cpu time"))
        assert cpu.split()[3] != "unlimited"


def test_bad_inputs(grader):
    with pytest.raises(ValueError, match="2 answers but 1 references"):
        grader.grade(["1", "2"], ["1"])
    with pytest.raises(ValueError, match=r"references\[0\]"):
        grader.grade(["1"], [[]])
    with pytest.raises(TypeError, match=r"answers\[0\]"):
        grader.grade([1], ["1"])
    with pytest.raises(ValueError, match="timeout_s"):
        rewards.GradingPool(1, timeout_s=0)


def test_closed_pool_refuses_work():
    p = rewards.GradingPool(1, timeout_s=TIMEOUT_S)
    pids = p.worker_pids
    p.close()
    with pytest.raises(grading_pool.GradingPoolError, match="closed"):
        p.grade(["1"], ["1"])
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()
