"""The R³ reward (R3-SPEC §3): correct answers earn 1 plus a bonus for being short, wrong ones 0."""

from __future__ import annotations

import numpy as np

L_MAX = 32768


def r3_reward(correct, num_tokens=None, max_length: int = L_MAX, xp=np):
    """`1 + max(0, 1 - l / L_max)` for a correct response of l tokens, 0 for a wrong one.

    Works on scalars and arrays. `xp` is the array module: numpy (default, float64, inputs checked)
    or `jax.numpy` (float32, traceable: the train step calls it on replayed responses). Without
    `num_tokens` the length bonus is left out and a correct response earns exactly 1.
    """
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    correct = xp.asarray(correct).astype(bool)
    if num_tokens is None:
        return xp.where(correct, 1.0, 0.0)
    length = xp.asarray(num_tokens).astype(xp.float64 if xp is np else xp.float32)
    if xp is np and np.any(length < 0):
        raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
    return xp.where(correct, 1.0 + xp.maximum(0.0, 1.0 - length / max_length), 0.0)
