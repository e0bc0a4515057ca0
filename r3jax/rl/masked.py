"""Masked reductions, written once: every mean over response tokens or groups goes through these."""

from __future__ import annotations

import jax.numpy as jnp


def masked_sum(x, mask, axis=None):
    return jnp.sum(jnp.where(mask, x, 0), axis=axis)


def masked_count(mask, axis=None):
    return jnp.sum(mask.astype(jnp.float32), axis=axis)


def masked_mean(x, mask, axis=None):
    """Mean of x where mask; 0 (not NaN) where nothing is masked in."""
    return masked_sum(x, mask, axis) / jnp.maximum(masked_count(mask, axis), 1.0)


def masked_var(x, mask, axis=None):
    """Population variance (ddof 0) of x where mask; 0 where fewer than one element is masked in."""
    mean = masked_mean(x, mask, axis)
    centered = x - (mean if axis is None else jnp.expand_dims(mean, axis))
    return masked_mean(centered * centered, mask, axis)


def masked_std(x, mask, axis=None):
    return jnp.sqrt(masked_var(x, mask, axis))


def masked_max(x, mask, axis=None, empty=0.0):
    out = jnp.max(jnp.where(mask, x, -jnp.inf), axis=axis)
    return jnp.where(jnp.isfinite(out), out, empty)
