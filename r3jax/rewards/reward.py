"""The R³ reward (R3-SPEC §3): correct answers earn 1 plus a bonus for being short, wrong ones 0."""

from __future__ import annotations

import numpy as np

L_MAX = 32768


def r3_reward(correct, num_tokens=None, max_length: int = L_MAX):
    """`1 + max(0, 1 - l / L_max)` for a correct response of l tokens, 0 for a wrong one.

    Works on scalars and arrays (numpy or jax). Without `num_tokens` the length bonus is left out
    and a correct response earns exactly 1.
    """
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    correct = np.asarray(correct, bool)
    if num_tokens is None:
        return np.where(correct, 1.0, 0.0)
    length = np.asarray(num_tokens, np.float64)
    if np.any(length < 0):
        raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
    return np.where(correct, 1.0 + np.maximum(0.0, 1.0 - length / max_length), 0.0)
