"""Decode step time at a filled length against the cache budget: does a step cost what is filled?

Usage: python bench/decode_step.py [--rounds 5] [--cases small medium]
Each case prefills a batch of prompts of `filled` tokens, then runs STEPS decode steps (one jitted loop of the
sampler's own step) on caches allocated for a short and a long budget. A step's time is read inside one call:
after each step the loop stamps the host clock (an ordered `jax.debug.callback` that reads the step's logits,
so it fires once the step is computed), and the step time is the median gap between consecutive stamps after
the first WARM steps. What the call does outside the loop (prefill, allocating and zeroing the cache, drawing
the random numbers, faulting fresh pages in), which does grow with the budget, is left out and reported apart
as `outside_loop_ms`. (A difference of two loop lengths in separate calls, the previous method, was dominated
by those per-call costs' noise on this VM.) `ratio` = long / short step time: 1 when attention reads only the
filled slots, about budget / short budget when it reads the whole allocation. The budgets alternate round by
round; a stamp costs the same in both.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import emit, main_over_cases  # noqa: E402
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
FILLED, STEPS, WARM, BUDGETS = 64, 64, 8, (128, 4096)  # filled 64 -> 128 slots: inside the first 256-slot block
_stamps: list[float] = []


def _stamp(_):
    _stamps.append(time.perf_counter())


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _steps(graphdef, cfg, steps, params, tokens, mask, key):
    """Prefill, then `steps` decode steps, each followed by a host stamp; returns the final logits."""
    model = nnx.merge(graphdef, params)
    prompts = sampler._prefill(model, tokens, mask)
    state = sampler._init_state(model, cfg, tokens.shape[0], 1, prompts, key)  # one row group: one device
    layers = model.unstack_layers()
    step = functools.partial(sampler._decode_step, model, cfg, layers, prompts)

    def body(_, s):
        s = step(s)
        jax.debug.callback(_stamp, s.logits[0, 0], ordered=True)
        return s

    return jax.lax.fori_loop(0, steps, body, state).logits


def timed(fn) -> tuple[float, float, float]:
    """(wall seconds of one call, its median step gap after WARM steps, seconds from call start to the last
    stamp minus the loop's stamped span: the time outside the loop)."""
    _stamps.clear()
    start = time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    if len(_stamps) != STEPS:
        raise RuntimeError(f"expected {STEPS} step stamps, got {len(_stamps)}")
    gaps = np.diff(_stamps[WARM:])
    return wall, float(np.median(gaps)), wall - (_stamps[-1] - _stamps[0]) * STEPS / (STEPS - 1)


def run(name: str, case: dict, rounds: int):
    arch = {k: v for k, v in case.items() if k != "batch"}
    config = rm.ModelConfig(vocab_size=VOCAB, tie_word_embeddings=False, **arch)
    graphdef, params = rm.split_params(rm.init_model(config, seed=0))
    b = case["batch"]
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, VOCAB, (b, FILLED)), jnp.int32)
    mask = jnp.ones((b, FILLED), bool)
    fns = {n: (lambda cfg: lambda: _steps(graphdef, cfg, STEPS, params, tokens, mask,
                                          jax.random.key(0)).block_until_ready())(
               sampler.SamplingConfig(max_new_tokens=n)) for n in BUDGETS}
    for fn in fns.values():
        fn()  # compile
    runs = {n: [] for n in BUDGETS}
    for _ in range(rounds):
        for n, fn in fns.items():
            runs[n].append(timed(fn))
    step = {n: statistics.median(r[1] for r in runs[n]) for n in BUDGETS}
    short, long = BUDGETS
    emit({"bench": "decode_step", "case": name, "batch": b, "filled": FILLED, "steps": STEPS, "rounds": rounds,
          **arch, f"step_ms_budget_{short}": round(step[short] * 1e3, 3),
          f"step_ms_budget_{long}": round(step[long] * 1e3, 3),
          "ratio": round(step[long] / step[short], 3), "target": "<= 1.3",
          "step_ms_per_round": {n: [round(r[1] * 1e3, 3) for r in runs[n]] for n in BUDGETS},
          "call_ms": {n: round(statistics.median(r[0] for r in runs[n]) * 1e3, 1) for n in BUDGETS},
          "outside_loop_ms": {n: round(statistics.median(r[2] for r in runs[n]) * 1e3, 1) for n in BUDGETS}})


if __name__ == "__main__":
    main_over_cases(CASES, run, default_rounds=5)
