"""Long-tailed rollouts: slots refilled as rows end, against one static batch and transformers `generate`.

Usage: python bench/long_tail.py [--rounds 3] [--cases small medium] [--transformers]
256 rollouts (32 prompts x 8 samples) at temperature 1 with a budget of 1,024 tokens. A random model's
next-token distribution is close to uniform, so END_TOKENS of the vocabulary as end tokens end a row with
probability ~1/200 per step: lengths are geometric (mean ~200, the longest of 256 near the cap), the shape
RL rollouts have. The same key gives r3jax the same rollouts whatever its slot count (tested in
tests/test_sampler.py), so its configurations time the same work.

Reported per configuration: wall seconds (median over alternating rounds), generated tokens, decode steps,
and slot utilisation = generated tokens / (slots x steps). `static` is today's schedule: every row in one
batch, stepping until the last row ends. With --transformers, transformers `generate` runs the same static
batch once after the rounds (its `generate` stops a row at an end token but keeps computing it; one call
took 737 s for the small case here, so it is not repeated).
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import alternate, emit, main_over_cases  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from r3jax import model as rm  # noqa: E402
from r3jax.sampling import sampler  # noqa: E402

VOCAB, PROMPT, PROMPTS, SAMPLES, BUDGET = 2048, 32, 32, 8, 1024
END_TOKENS = tuple(range(100, 110))  # 10 of 2,048 ids: ~1/205 per step
WITH_TRANSFORMERS = False
CASES = {
    "small": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, slots=(16, 32, 64)),
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, slots=(32, 64)),
}


def run(name: str, case: dict, rounds: int):
    arch = {k: v for k, v in case.items() if k != "slots"}
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=False, **arch)).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        model, _ = rm.load_pretrained(folder)
    params = rm.split_params(model)
    prompts = np.random.RandomState(0).randint(200, VOCAB, (PROMPTS, PROMPT))
    mask = np.ones_like(prompts, bool)
    rows = PROMPTS * SAMPLES
    stats = {}

    def ours(slots):
        def call():
            out, cost = sampler.decode(params, prompts, mask, jax.random.key(1), max_new_tokens=BUDGET,
                                        num_samples=SAMPLES, eos_ids=END_TOKENS, slots=slots)
            lengths = np.asarray(out.lengths)
            stats[slots or rows] = dict(tokens=int(lengths.sum()), steps=int(cost["steps"]),
                                        slot_steps=int(cost["slot_steps"]), max_length=int(lengths.max()),
                                        mean_length=round(float(lengths.mean()), 1))
        return call

    def theirs():
        with torch.no_grad():
            out = hf.generate(torch.tensor(np.repeat(prompts, SAMPLES, 0)),
                              attention_mask=torch.tensor(np.repeat(mask, SAMPLES, 0).astype(np.int64)),
                              do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=BUDGET,
                              eos_token_id=list(END_TOKENS), pad_token_id=0)
        stats["transformers_steps"] = out.shape[1] - PROMPT

    fns = {f"slots_{s}": ours(s) for s in case["slots"]}
    fns["static"] = ours(None)
    for fn in fns.values():
        fn()  # compile
    times = {k: t["median_s"] for k, t in alternate(fns, rounds).items()}
    if WITH_TRANSFORMERS:
        times.update({k: t["median_s"] for k, t in alternate({"transformers": theirs}, 1).items()})
    record = {"bench": "long_tail", "case": name, "rollouts": rows, "budget": BUDGET, "prompt": PROMPT, **arch}
    for s in (*case["slots"], rows):
        key = "static" if s == rows else f"slots_{s}"
        st = stats[s]
        record[key] = dict(slots=s, wall_s=round(times[key], 2), **st,
                           utilisation=round(st["tokens"] / st["slot_steps"], 3),
                           tokens_per_s=round(st["tokens"] / times[key], 1))
    best = min(case["slots"], key=lambda s: times[f"slots_{s}"])
    record.update(best_slots=best, speedup_vs_static=round(times["static"] / times[f"slots_{best}"], 2),
                  target="utilisation >= 0.85", torch_threads=torch.get_num_threads())
    if WITH_TRANSFORMERS:
        record["transformers"] = dict(wall_s=round(times["transformers"], 2), steps=stats["transformers_steps"])
        record["speedup_vs_transformers"] = round(times["transformers"] / times[f"slots_{best}"], 2)
    emit(record)


if __name__ == "__main__":
    WITH_TRANSFORMERS = "--transformers" in sys.argv
    if WITH_TRANSFORMERS:
        sys.argv.remove("--transformers")
    main_over_cases(CASES, run, default_rounds=3)
