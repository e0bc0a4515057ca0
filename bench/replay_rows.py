"""R³'s train step with CCR's replay rows in a segment of their own, against the rows joining the on-policy ones.

Usage: python bench/replay_rows.py [--rounds 8] [--cases replay4 replay8 replay16]
One jitted `train_step` on one rollout batch at `bench/grpo_step.py`'s shape (the 128-wide, 4-layer model, 8
prompts of 128 tokens × 8 responses of 64), with `collapsed` groups all wrong and their questions holding
stored correct answers, so CCR appends one replay row per slot it fills. `layout.choose` puts the replay rows
apart (`Layout.replay_apart`): the 64 on-policy rows are then whole groups and read their prompts group by group;
joined, one replay row makes the whole micro-batch read them row by row. Both layouts run from the same state,
alternating round by round in one process. One JSON line per case: seconds per step for each, `speedup` =
joined / apart, and `same_loss` (the two steps' losses agree to 1e-5).
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import alternate, emit, main_over_cases  # noqa: E402

from r3jax import model as rm  # noqa: E402
from r3jax.rl import algorithm, layout, loss, replay, train_step  # noqa: E402
from r3jax.rl import batch as rl_batch  # noqa: E402

MODEL = dict(vocab_size=264, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
SHAPE = dict(prompts=8, samples=8, prompt=128, new=64)
CASES = {f"replay{2 * c}": dict(collapsed=c) for c in (2, 4, 8)}  # CCR fills k = 2 slots of each collapsed group


def rollouts(collapsed: int, prompts: int, samples: int, prompt: int, new: int, vocab: int, seed: int = 0):
    """A graded batch: random prompts and responses (20 to `new` tokens), half of the answers correct, except in
    the first `collapsed` groups, where all are wrong."""
    rng = np.random.RandomState(seed)
    lengths = rng.randint(min(20, new), new + 1, (prompts, samples))
    mask = np.arange(new) < lengths[..., None]
    correct = rng.rand(prompts, samples) < 0.5
    correct[:collapsed] = False
    shape = (prompts, samples, new)
    return rl_batch.RolloutBatch(
        qids=jnp.arange(prompts, dtype=jnp.int32),
        prompt_tokens=jnp.asarray(rng.randint(0, vocab, (prompts, prompt)), jnp.int32),
        prompt_mask=jnp.ones((prompts, prompt), bool),
        tokens=jnp.asarray(rng.randint(0, vocab, shape) * mask, jnp.int32),
        mask=jnp.asarray(mask), logprobs=jnp.asarray(-rng.rand(*shape) * mask, jnp.float32),
        entropies=jnp.asarray(rng.rand(*shape) * mask, jnp.float32), lengths=jnp.asarray(lengths, jnp.int32),
        truncated=jnp.zeros((prompts, samples), bool), correct=jnp.asarray(correct),
        rewards=jnp.asarray(np.where(correct, 1.0, 0.0), jnp.float32), group_valid=jnp.ones((prompts,), bool),
        is_reflection=jnp.zeros((prompts,), bool))


def with_stored_answers(state, collapsed: int, per_question: int, new: int, vocab: int, seed: int = 1):
    """The state with `per_question` correct answers of 2/3 `new` tokens stored for each of the first
    `collapsed` questions."""
    rng = np.random.RandomState(seed)
    n = collapsed * per_question
    stored = replay.insert(state.buffer, jnp.repeat(jnp.arange(collapsed), per_question),
                           jnp.asarray(rng.randint(1, vocab, (n, new)), jnp.int32), jnp.full((n,), 2 * new // 3),
                           jnp.ones((n,), bool), jnp.ones((n,), bool), 0)
    return dataclasses.replace(state, buffer=stored)


def layouts(cfg, state, batch) -> dict:
    """{"apart": what `layout.choose` picks, "joined": the same with the replay rows in the on-policy segment}."""
    chosen = layout.choose(cfg, state.buffer, batch)
    if not chosen.replay_apart:
        raise RuntimeError(f"layout.choose did not put the replay rows apart: {chosen}")
    return {"apart": chosen, "joined": dataclasses.replace(chosen, replay_apart=False)}


def run(name: str, case: dict, rounds: int, model: dict = MODEL, shape: dict = SHAPE):
    cfg = algorithm.algorithm_config("r3", max_response_tokens=shape["new"])
    graphdef, params = rm.split_params(rm.init_model(rm.ModelConfig(tie_word_embeddings=False, **model), seed=0))
    tx = loss.make_optimizer(1e-6, warmup_steps=0, weight_decay=0.0)
    state = train_step.init_train_state(params, cfg, tx, num_questions=shape["prompts"], seed=0)
    state = with_stored_answers(state, case["collapsed"], 4, shape["new"], model["vocab_size"])
    batch = rollouts(case["collapsed"], vocab=model["vocab_size"], **shape)
    step = train_step.make_train_step(graphdef, cfg, tx, state, batch)
    chosen = layouts(cfg, state, batch)

    def call(which: str):
        def once():
            fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))  # the step donates its state
            return jax.block_until_ready(step(fresh, batch, chosen[which]))
        return once

    fns = {k: call(k) for k in chosen}
    first = {k: fn()[1] for k, fn in fns.items()}  # compiles each
    times = alternate(fns, rounds)
    record = {"bench": "replay_rows", "case": name, **case, **shape, "rounds": rounds,
              "replay_rows": chosen["apart"].replay_rows,
              "ccr_appended": float(first["apart"]["r3/ccr_appended"]),
              "segments": {k: [[s.rows, s.micro_batches, s.group_rows] for s in train_step.segments(cfg, batch, v)]
                           for k, v in chosen.items()},
              "same_loss": bool(np.allclose(first["apart"]["policy/loss"], first["joined"]["policy/loss"],
                                            rtol=1e-5, atol=1e-6)),
              **{f"{k}_s": round(t["median_s"], 4) for k, t in times.items()},
              **{f"{k}_spread_s": [round(t["min_s"], 4), round(t["max_s"], 4)] for k, t in times.items()},
              "speedup": round(times["joined"]["median_s"] / times["apart"]["median_s"], 3)}
    emit(record)
    return record


if __name__ == "__main__":
    main_over_cases(CASES, run, default_rounds=8)
