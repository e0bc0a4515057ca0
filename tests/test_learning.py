"""The training loop learns: `python train.py` (R³ on the embedded default's base model) on four fixed
five-operation questions of its task raises the training accuracy well past where it starts.

This is the test that fails when the update points the wrong way: negated advantages, a flipped loss sign, a
detached gradient, a policy that never reaches the sampler (stale parameters) or rewards cut off from the
responses all leave the accuracy flat or falling. The base model answers such chains at once about half of the
time and is then often wrong (`scripts/make_arith_base.py`); RL moves it to writing the lines out, which it does
almost without error. Seeded, on one CPU device; the thresholds sit well inside the measured gap (see
ACCURACY_*), so thread timing and float reassociation cannot flip the result.
"""

import json
import os
import pathlib
import random
import subprocess
import sys

import numpy as np

from r3jax.data import arith

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 20
# measured with these settings: mean training accuracy of the first 4 steps 0.23, of the last 4 0.52; with the
# advantages negated (group_advantages returning -A): first 4 steps 0.17, last 4 0.01
ACCURACY_FLOOR, RISE = 0.4, 0.15
OVERRIDES = ["--config.prompts_per_step=4", f"--config.steps={STEPS}", "--config.temperature=1.0",
             "--config.rl.learning_rate=1e-4", "--config.rl.warmup_steps=2", "--config.eval_at_start=False",
             "--config.eval_every=0", "--config.data.eval_limit=1", "--config.eval.num_samples=1",
             "--config.checkpoint_every=0", "--config.compilation_cache="]


def questions(path: pathlib.Path, n: int = 4, seed: int = 7) -> pathlib.Path:
    """n five-operation chains that are neither training nor held-out questions of configs/arith."""
    taken = {json.loads(line)["problem"] for f in (REPO / "configs" / "arith").glob("*.jsonl")
             for line in f.read_text().splitlines()}
    rng, rows = random.Random(seed), []
    while len(rows) < n:
        chain = arith.random_chain(rng, 5)
        if chain.problem not in taken:
            rows.append(arith.row(chain))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_training_accuracy_rises_on_four_fixed_questions(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # one device: the loop under test, not the sharding (tested elsewhere), and no rendezvous on 2 cores
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    work = tmp_path / "run"
    data = questions(tmp_path / "four.jsonl")
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--workdir", str(work),
                           f"--config.data.train={data}", *OVERRIDES],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["reward/accuracy"] for r in rows if "reward/accuracy" in r]
    assert len(accuracy) == STEPS
    first, last = float(np.mean(accuracy[:4])), float(np.mean(accuracy[-4:]))
    assert last >= ACCURACY_FLOOR and last >= first + RISE, (first, last, accuracy)
