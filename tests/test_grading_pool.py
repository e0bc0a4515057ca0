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
    n = 5000  # ~2 s of uncached grading here: the kill at 0.3 s lands mid-batch even on a fast machine
    answers = [f"{i}.75" for i in range(n)]
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


def test_a_round_of_timeouts_per_worker_stays_within_the_bound():
    """6 hostile answers, 2 workers, 1.5 s each: every round kills both workers, the warm spares refill
    the slots at once, so the batch takes about 3 rounds x 1.5 s."""
    with rewards.GradingPool(2, timeout_s=1.5) as p:
        start = time.perf_counter()
        results = p.grade(["9^{9^{9^{9}}}"] * 6, ["1"] * 6)
        elapsed = time.perf_counter() - start
        assert [ok for ok, _ in results] == [False] * 6
        assert elapsed < 3 * 1.5 + 2.0, elapsed
        assert p.grade(["3"], ["3"]) == [(True, "correct")]


def test_an_interrupted_batch_leaves_the_pool_usable(grader):
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    # Answers no earlier test graded (the pool caches verdicts): ~3 s of grading here, so the alarm at 0.3 s
    # lands mid-batch (400 cached-free integers once took 0.18 s, and the alarm came after the batch).
    answers = [f"{i}.25" for i in range(6000)]
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            grader.grade(answers, answers)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert grader.grade(["1", "2", "3"], ["1", "2", "4"]) == [(True, "correct"), (True, "correct"),
                                                               (False, "mismatch")]


FORK_SCRIPT = """
import os, sys
from r3jax import rewards
from r3jax.rewards import pool as grading_pool
with rewards.GradingPool(1, timeout_s=2.0, spares=0) as p:
    pid = os.fork()
    if pid == 0:  # the child: refuse to grade; close() must leave the parent's workers and folder alone
        code = 1
        try:
            p.grade(["1"], ["1"])
        except grading_pool.GradingPoolError:
            code = 0
        p.close()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert p.grade(["5"], ["5"]) == [(True, "correct")]
print("ok")
"""


def test_a_forked_child_cannot_use_or_close_the_parents_pool():
    """Run in a fresh interpreter: forking this test process, which has JAX's threads, could deadlock."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_close_waits_for_a_batch_in_another_thread():
    p = rewards.GradingPool(1, timeout_s=TIMEOUT_S, spares=0)
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("r", p.grade([str(i) for i in range(100)],
                                                                        [str(i) for i in range(100)])))
    worker.start()
    time.sleep(0.2)
    pids = p.worker_pids
    p.close()
    worker.join()
    assert out["r"] == [(True, "correct")] * 100
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()


def test_references_are_checked_up_front():
    with pytest.raises(ValueError, match=r"answers\[1\]"):
        rewards.grade_batch(["<think></think> none", "x"], ["1", None])
    with pytest.raises(ValueError, match=r"answers\[0\]"):
        rewards.grade_batch(["x"], [{"a": 1}])


def test_slow_answers_time_out_inside_the_worker_without_a_kill():
    """The worker's own deadline (0.8 of the limit, fractions of a second) answers `timeout` itself, so no
    worker is killed and replaced: 16 slow answers on 2 workers take about 8 x 0.8 s, not a respawn each."""
    # sympy work in Python that a signal interrupts within ~30 ms: no single long C call (a big-integer power
    # such as 2^{2^{2^{30}}} overshot the 0.8 s deadline by 0.2 s here, and was rightly killed by the pool)
    slow = ["(10^{100})!", "(x+1)^{10^{4}}", "(x+2)^{5000}", "(y-1)^{8000}"] * 4
    with rewards.GradingPool(2, timeout_s=TIMEOUT_S) as p:
        start = time.perf_counter()
        results = p.grade(slow, ["1"] * len(slow))
        elapsed = time.perf_counter() - start
        # a fast machine (or sympy's caches, for a repeat) can finish one in time: then it is a plain mismatch
        assert all(r in [(False, "timeout"), (False, "mismatch")] for r in results)
        assert sum(r == (False, "timeout") for r in results) >= len(slow) // 2
        assert p.stats.timeouts == 0 and p.stats.crashes == 0
        assert elapsed < 8 * TIMEOUT_S + 2.0, elapsed
