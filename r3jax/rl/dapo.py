"""DAPO's two batch-level parts, in fixed shapes: dynamic sampling and overlong reward shaping."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def mixed_outcomes(correct, valid):
    """[P] bool: the group has both correct and wrong valid responses (0 < accuracy < 1): DAPO's filter."""
    n_correct = (correct & valid).sum(axis=1)
    return (n_correct > 0) & (n_correct < valid.sum(axis=1))


def select_groups(correct, valid, num_groups: int):
    """Dynamic sampling with fixed shapes: from P' >= num_groups over-sampled groups, the first
    `num_groups` whose accuracy is strictly between 0 and 1, in order; if fewer qualify, the rest
    of the rows are filled with other groups and marked unused.

    correct, valid: [P', G]. Returns (index [num_groups] int32 into P', keep [num_groups] bool).
    """
    if num_groups > correct.shape[0]:
        raise ValueError(f"cannot select {num_groups} groups from {correct.shape[0]} sampled ones")
    useful = mixed_outcomes(jnp.asarray(correct, bool), jnp.asarray(valid, bool))
    order = jnp.argsort(~useful, stable=True)[:num_groups]        # useful groups first, each in order
    return order.astype(jnp.int32), useful[order]


def filter_groups(batch, num_groups: int):
    """A RolloutBatch of `num_groups` groups picked by `select_groups` from an over-sampled one; the
    groups that had to fill the shape get group_valid False (the train step then ignores them)."""
    valid = batch.group_valid[:, None] & (batch.lengths > 0)
    index, keep = select_groups(batch.correct, valid, num_groups)
    picked = jax.tree.map(lambda x: x[index], batch)
    return dataclasses.replace(picked, group_valid=picked.group_valid & keep)


def overlong_penalty(lengths, max_tokens: int, buffer: int):
    """DAPO's soft overlong punishment: 0 up to max_tokens - buffer tokens, then falling linearly to -1 at
    max_tokens (and -1 beyond). buffer 0 turns it off."""
    if buffer <= 0:
        return jnp.zeros(jnp.shape(lengths), jnp.float32)
    start = max_tokens - buffer
    over = jnp.asarray(lengths, jnp.float32) - start
    return jnp.clip(-over / buffer, -1.0, 0.0)
