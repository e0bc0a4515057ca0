"""bench/decode_step.py times the sampler's own prefill, loop state and decode step, which it calls directly
(private functions whose signatures change with the sampler): its loop runs, stamps every step, and the cache
budget it compares changes no greedy logit."""

import importlib.util
import sys
from pathlib import Path

import jax
import numpy as np

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
