"""Group-relative advantages: GRPO's Eq. 1 and R³'s Eq. 3 for groups that CCR mixed."""

from __future__ import annotations

import jax.numpy as jnp

from r3jax.rl import masked


def group_advantages(rewards, valid, mixed, *, alpha: float = 1.0, lam: float = 1e-6, eps: float = 1e-6):
    """Advantage of every response from the rewards of its group (population std, ddof 0).

    rewards, valid: [P, M] (M = G on-policy + k replay slots; `valid` marks filled slots).
    mixed: [P] bool, the group received replayed responses (CCR).
      mixed groups:  A_i = (R_i - mean(G_mix)) / (alpha * std(G_mix) + lam)     (Eq. 3 of R³)
      other groups:  A_i = (R_i - mean(G)) / (std(G) + eps)                      (Eq. 1, GRPO)
    A group whose rewards are all equal gets 0 everywhere (never NaN); invalid slots get 0.

    Rewards are first centred on one valid member of their group: R³ rewards of correct answers sit
    near 2 and differ by a few ulps when lengths differ by a token, and float32's mean of such values
    loses those ulps (advantages off by ~0.3%, not summing to 0); the differences to one member are
    exact (Sterbenz), so mean and std are taken of small numbers. Advantages do not change otherwise.
    """
    first = jnp.argmax(valid, axis=1)                                     # [P] a valid member (or slot 0)
    rewards = rewards - jnp.take_along_axis(rewards, first[:, None], axis=1)
    mean = masked.masked_mean(rewards, valid, axis=1)                     # [P]
    std = masked.masked_std(rewards, valid, axis=1)                       # [P]
    scale = jnp.where(mixed, alpha * std + lam, std + eps)
    # Equal rewards can miss their float32 mean by an ulp, which std + 1e-6 would blow up to ~0.1:
    # a group without spread gets exactly 0 (also when lam = 0 would make the scale 0).
    spread = has_spread(rewards, valid)
    scale = jnp.where(spread, scale, 1.0)
    return jnp.where(valid & spread[:, None], (rewards - mean[:, None]) / scale[:, None], 0.0)


def has_spread(rewards, valid):
    """[P] bool: the group's valid rewards are not all equal (max - min > 0)."""
    return masked.masked_max(rewards, valid, axis=1) + masked.masked_max(-rewards, valid, axis=1) > 0


def zero_advantage_groups(advantages, valid, group_valid):
    """[P] bool: valid groups in which every response's advantage is 0 (nothing to learn)."""
    nonzero = jnp.any(valid & (jnp.abs(advantages) > 0), axis=1)
    return group_valid & ~nonzero
