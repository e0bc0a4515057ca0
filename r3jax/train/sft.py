"""Supervised fine-tuning (a warm start before RL): teacher-forced cross-entropy on response tokens only.

An example is a (prompt ids, response ids) pair; `pack` right-pads a list of them into one fixed-shape
`SFTBatch` (so a run compiles once per width), the loss is the mean negative log-likelihood of the response
tokens under the same `sequence_logprobs` the RL loss uses (temperature 1), and the optimizer is the RL one
(`loss.make_optimizer`: clipping + AdamW with warmup and cosine decay). `scripts/make_arith_base.py` uses it to
make the embedded default's base model.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from r3jax import model as rm
from r3jax.rl import loss


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SFTBatch:
    """tokens [B, T] int32 (prompt ⊕ response, right-padded); mask [B, T] real tokens; target [B, T] the
    response tokens the loss scores (the end-of-sequence token included)."""

    tokens: jax.Array
    mask: jax.Array
    target: jax.Array


def pack(examples: Sequence[tuple[Sequence[int], Sequence[int]]], width: int, pad_id: int) -> SFTBatch:
    """Right-pads (prompt, response) pairs to `width`; an example longer than `width` is an error naming it."""
    tokens = np.full((len(examples), width), pad_id, np.int32)
    mask = np.zeros((len(examples), width), bool)
    target = np.zeros((len(examples), width), bool)
    for i, (prompt, response) in enumerate(examples):
        n = len(prompt) + len(response)
        if n > width or not prompt or not response:
            raise ValueError(f"example {i}: {len(prompt)} prompt + {len(response)} response tokens do not fit width "
                             f"{width} (both parts must be non-empty)")
        tokens[i, :n] = list(prompt) + list(response)
        mask[i, :n] = True
        target[i, len(prompt):n] = True
    return SFTBatch(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(target))


def nll(model, batch: SFTBatch, chunk_size: int = 512) -> jax.Array:
    """Mean negative log-likelihood per response token."""
    logprobs, _ = loss.sequence_logprobs(model, batch.tokens, batch.mask, batch.target, chunk_size=chunk_size)
    count = jnp.maximum(batch.target.sum(), 1)
    return -(logprobs * batch.target).sum() / count


def make_step(graphdef, tx: optax.GradientTransformation, chunk_size: int = 512):
    """A jitted (params, opt_state, batch) -> (params, opt_state, loss); params and opt_state are donated."""

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(lambda p: nll(rm.merge_params(graphdef, p), batch, chunk_size))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1))


def fit(model, tx: optax.GradientTransformation, batches: Iterator[SFTBatch], steps: int, *,
        log_every: int = 50, log: Callable[[dict], None] = print):
    """Runs `steps` updates on `batches`; returns (model, history of {step, loss, seconds} rows).

    A logged loss is the mean over the updates since the previous log line. A non-finite loss stops the run
    with an error naming the step (a warm start that diverged is not worth saving)."""
    graphdef, params = rm.split_params(model)
    params = jax.tree.map(jnp.copy, params)  # the steps donate their params: the caller's model stays usable
    opt_state = tx.init(params)
    step_fns: dict[tuple, Callable] = {}
    history, window, start = [], [], time.perf_counter()
    for i in range(1, steps + 1):
        batch = next(batches)
        fn = step_fns.setdefault(batch.tokens.shape, make_step(graphdef, tx))
        params, opt_state, value = fn(params, opt_state, batch)
        window.append(value)
        if i % log_every == 0 or i == steps:
            mean = float(np.mean(jax.device_get(window)))
            if not np.isfinite(mean):
                raise FloatingPointError(f"the warm start's loss became {mean} by step {i}; lower the learning rate")
            history.append({"step": i, "loss": mean, "seconds": time.perf_counter() - start})
            log(history[-1])
            window = []
    return rm.merge_params(graphdef, params), history
