"""DAPO's two batch-level parts, in fixed shapes: dynamic sampling and overlong reward shaping."""

from __future__ import annotations

import jax.numpy as jnp

from r3jax.rl import masked


def has_variance(rewards, valid):
    """[P] bool: the group's valid rewards are not all equal (its GRPO advantages are not all 0)."""
    spread = masked.masked_max(rewards, valid, axis=1) + masked.masked_max(-rewards, valid, axis=1)
    return spread > 0


def select_groups(rewards, valid, num_groups: int):
    """Dynamic sampling with fixed shapes: from P' >= num_groups over-sampled groups, the first
    `num_groups` that have reward variance, in order; if fewer have, the rest of the rows are filled
    with other groups and marked unused.

    rewards, valid: [P', G]. Returns (index [num_groups] int32 into P', keep [num_groups] bool).
    """
    if num_groups > rewards.shape[0]:
        raise ValueError(f"cannot select {num_groups} groups from {rewards.shape[0]} sampled ones")
    varied = has_variance(rewards, valid)
    order = jnp.argsort(~varied, stable=True)[:num_groups]        # varied groups first, each in order
    return order.astype(jnp.int32), varied[order]


def overlong_penalty(lengths, max_tokens: int, buffer: int):
    """DAPO's soft overlong punishment: 0 up to max_tokens - buffer tokens, then falling linearly to -1 at
    max_tokens (and -1 beyond). buffer 0 turns it off."""
    if buffer <= 0:
        return jnp.zeros(jnp.shape(lengths), jnp.float32)
    start = max_tokens - buffer
    over = jnp.asarray(lengths, jnp.float32) - start
    return jnp.clip(-over / buffer, -1.0, 0.0)
