"""Per-step diagnostics (R3-SPEC §9): a flat dict of `/`-namespaced scalars, all under stop_gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from r3jax.rl import masked


def group_outcomes(correct, valid, group_valid):
    """[P] bool each: solve-all, solve-none and mixed groups (on-policy responses only)."""
    n = valid.sum(axis=1)
    n_correct = (correct & valid).sum(axis=1)
    live = group_valid & (n > 0)
    return live & (n_correct == n), live & (n_correct == 0), live & (n_correct > 0) & (n_correct < n)


def rollout_metrics(batch, valid, scored, zero_before, zero_after, replay_appended):
    """Everything about this step's rollouts and what R³ did to them."""
    groups = jnp.maximum(batch.group_valid.sum(), 1)
    solve_all, solve_none, mixed = group_outcomes(batch.correct, valid, batch.group_valid)
    token_mask = batch.mask & valid[..., None]
    lengths = jnp.where(valid, batch.lengths, 0)
    reflection = valid & batch.is_reflection[:, None]
    out = {
        "reward/mean": masked.masked_mean(batch.rewards, valid),
        "reward/accuracy": masked.masked_mean(batch.correct.astype(jnp.float32), valid),
        "groups/solve_all_frac": solve_all.sum() / groups,
        "groups/solve_none_frac": solve_none.sum() / groups,
        "groups/mixed_frac": mixed.sum() / groups,
        "r3/zero_adv_frac_before": zero_before.sum() / groups,
        "r3/zero_adv_frac_after": zero_after.sum() / groups,
        "r3/ccr_appended": replay_appended.sum().astype(jnp.float32),
        "r3/ccr_groups": (replay_appended > 0).sum().astype(jnp.float32),
        "r3/isr_prompts": (batch.group_valid & batch.is_reflection).sum().astype(jnp.float32),
        "r3/isr_accuracy": masked.masked_mean(batch.correct.astype(jnp.float32), reflection),
        "r3/serr_scored": scored.sum().astype(jnp.float32),
        "rollout/entropy_mean": masked.masked_mean(batch.entropies, token_mask),
        "rollout/length_mean": masked.masked_mean(lengths.astype(jnp.float32), valid),
        "rollout/length_max": lengths.max().astype(jnp.float32),
        "rollout/truncated_frac": masked.masked_mean(batch.truncated.astype(jnp.float32), valid),
    }
    return jax.lax.stop_gradient(out)

