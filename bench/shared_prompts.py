"""A static batch's G samples reading their prompt from one shared copy, against every row holding its own.

Usage: python bench/shared_prompts.py [--rounds 5] [--cases grpo long_prompt short_prompt]
`generate(..., share_prompts=True)` (what the training loop and eval.py ask for) keeps each prompt's keys and
values once (`cache.Prefix`) and scores a group's queries against them in one product; `share_prompts=False`
(generate's default) copies the prompt into every row's cache. Both do the same work and give the same
rollout up to float rounding (`same_tokens`: a draw whose number lands within ~1e-6 of a token's CDF boundary
can flip, and that row then goes its own way); they alternate round by round in one process. Random weights,
temperature 1, no end token: every row generates `new` tokens. One JSON line per case: seconds per call for
each, and `speedup` = copied / shared.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import alternate, emit, main_over_cases  # noqa: E402

from r3jax import model as rm  # noqa: E402
from r3jax.sampling import generate  # noqa: E402

VOCAB = 2048
CASES = {  # grpo: bench/grpo_step.py's sampler call; the others: a long prompt and a short one
    "grpo": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, prompts=8, samples=8, prompt=128, new=64),
    "long_prompt": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, prompts=4, samples=8, prompt=512, new=128),
    "short_prompt": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, prompts=32, samples=8, prompt=32, new=256),
}
SHAPE_KEYS = ("prompts", "samples", "prompt", "new")


def run(name: str, case: dict, rounds: int):
    arch = {k: v for k, v in case.items() if k not in SHAPE_KEYS}
    config = rm.ModelConfig(vocab_size=VOCAB, tie_word_embeddings=False, **arch)
    params = rm.split_params(rm.init_model(config, seed=0))
    tokens = np.random.RandomState(0).randint(0, VOCAB, (case["prompts"], case["prompt"]))
    mask = np.ones_like(tokens, bool)

    def call(share: bool):
        return lambda: jax.block_until_ready(generate(params, tokens, mask, jax.random.key(1),
                                                      max_new_tokens=case["new"], num_samples=case["samples"],
                                                      share_prompts=share).tokens)

    fns = {"shared": call(True), "copied": call(False)}
    first = {k: np.asarray(fn()) for k, fn in fns.items()}  # compiles each
    times = alternate(fns, rounds)
    emit({"bench": "shared_prompts", "case": name, **case, "rounds": rounds,
          "same_tokens": bool((first["shared"] == first["copied"]).all()),
          **{f"{k}_s": round(t["median_s"], 4) for k, t in times.items()},
          **{f"{k}_spread_s": [round(t["min_s"], 4), round(t["max_s"], 4)] for k, t in times.items()},
          "speedup": round(times["copied"]["median_s"] / times["shared"]["median_s"], 3)})


if __name__ == "__main__":
    main_over_cases(CASES, run, default_rounds=5)
