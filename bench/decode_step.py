"""Decode step time at a filled length against the cache budget: does a step cost what is filled?

Usage: python bench/decode_step.py [--rounds 5] [--cases small medium]
Each case prefills a batch of prompts of `filled` tokens, then runs decode steps (one jitted loop of the
sampler's own step) on caches allocated for a short and a long budget. A step's time is the difference
between a loop of 1 + STEPS steps and a loop of 1 step, so the per-call costs (prefill, allocating and
zeroing the cache, drawing the random numbers), which do grow with the budget, are left out and reported
apart. `ratio` = long / short step time: 1 when attention reads only the filled slots, about budget / short
budget when it reads the whole allocation. All four programs alternate round by round.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import alternate, emit, main_over_cases  # noqa: E402
from flax import nnx  # noqa: E402

from r3jax import model as rm  # noqa: E402
from r3jax.sampling import sampler  # noqa: E402

VOCAB = 2048
CASES = {
    "small": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, batch=32),
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, batch=32),
}
FILLED, STEPS, BUDGETS = 64, 16, (128, 4096)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _steps(graphdef, cfg, steps, params, tokens, mask, key):
    """Prefill, then `steps` decode steps; returns the final logits (so nothing is elided)."""
    model = nnx.merge(graphdef, params)
    prompts = sampler._prefill(model, tokens, mask)
    state = sampler._init_state(model, cfg, tokens.shape[0], prompts, key)
    layers = model.unstack_layers()
    step = functools.partial(sampler._decode_step, model, cfg, layers, prompts)
    return jax.lax.fori_loop(0, steps, lambda _, s: step(s), state).logits


def run(name: str, case: dict, rounds: int):
    arch = {k: v for k, v in case.items() if k != "batch"}
    config = rm.ModelConfig(vocab_size=VOCAB, tie_word_embeddings=False, **arch)
    graphdef, params = rm.split_params(rm.init_model(config, seed=0))
    b = case["batch"]
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, VOCAB, (b, FILLED)), jnp.int32)
    mask = jnp.ones((b, FILLED), bool)
    cfgs = {n: sampler.SamplingConfig(max_new_tokens=n) for n in BUDGETS}

    def timed(cfg, steps):
        return lambda: _steps(graphdef, cfg, steps, params, tokens, mask, jax.random.key(0)).block_until_ready()

    fns = {(n, k): timed(cfgs[n], k) for n in BUDGETS for k in (1, 1 + STEPS)}
    for fn in fns.values():
        fn()  # compile
    times = {key: t["median_s"] for key, t in alternate(fns, rounds).items()}
    per_step = {n: (times[n, 1 + STEPS] - times[n, 1]) / STEPS for n in BUDGETS}
    short, long = BUDGETS
    emit({"bench": "decode_step", "case": name, "batch": b, "filled": FILLED, "steps": STEPS, **arch,
          f"step_ms_budget_{short}": round(per_step[short] * 1e3, 3),
          f"step_ms_budget_{long}": round(per_step[long] * 1e3, 3),
          "ratio": round(per_step[long] / per_step[short], 3), "target": "<= 1.3",
          f"per_call_ms_budget_{short}": round(times[short, 1] * 1e3, 1),
          f"per_call_ms_budget_{long}": round(times[long, 1] * 1e3, 1)})


if __name__ == "__main__":
    main_over_cases(CASES, run, default_rounds=5)
