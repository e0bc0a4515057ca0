"""What the train step consumes: graded rollouts grouped by prompt, and the sequences the loss reads."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from r3jax.model import sharding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """P groups of G graded responses (plain questions, then reflection prompts), fixed shapes.

    qids: the question index each group is graded against and stored under (for a reflection group,
    its original question). prompt_tokens/prompt_mask: the prompt the group was sampled from,
    left-padded. tokens/mask/logprobs/entropies: the sampler's `Rollout` reshaped to [P, G, T].
    correct/rewards: the grader's verdicts and R³ rewards (R3-SPEC §3). group_valid: groups that
    exist (unused reflection slots are False). is_reflection: ISR groups (for metrics).
    """

    qids: jax.Array           # [P] int32
    prompt_tokens: jax.Array  # [P, Tp] int32
    prompt_mask: jax.Array    # [P, Tp] bool
    tokens: jax.Array         # [P, G, T] int32
    mask: jax.Array           # [P, G, T] bool
    logprobs: jax.Array       # [P, G, T] float32 sampler log-probs
    entropies: jax.Array      # [P, G, T] float32 sampler entropies
    lengths: jax.Array        # [P, G] int32
    truncated: jax.Array      # [P, G] bool
    correct: jax.Array        # [P, G] bool
    rewards: jax.Array        # [P, G] float32
    group_valid: jax.Array    # [P] bool
    is_reflection: jax.Array  # [P] bool


def from_rollout(rollout, num_samples: int, *, qids, prompt_tokens, prompt_mask, correct, rewards,
                 group_valid=None, is_reflection=None) -> RolloutBatch:
    """Groups a prompt-major `Rollout` of B = P * G rows (what `generate` returns) into a RolloutBatch."""
    p = np.shape(prompt_tokens)[0]
    if rollout.tokens.shape[0] != p * num_samples:
        raise ValueError(f"rollout has {rollout.tokens.shape[0]} rows, expected P * G = {p} * {num_samples}")
    group = lambda x: jnp.reshape(jnp.asarray(x), (p, num_samples, *jnp.shape(x)[1:]))  # noqa: E731
    prompt_tokens, prompt_mask = left_align(prompt_tokens, prompt_mask)
    return RolloutBatch(
        qids=jnp.asarray(qids, jnp.int32), prompt_tokens=prompt_tokens,
        prompt_mask=prompt_mask, tokens=group(rollout.tokens), mask=group(rollout.mask),
        logprobs=group(rollout.logprobs), entropies=group(rollout.entropies), lengths=group(rollout.lengths),
        truncated=group(rollout.truncated), correct=group(jnp.asarray(correct, bool)),
        rewards=group(jnp.asarray(rewards, jnp.float32)),
        group_valid=jnp.ones((p,), bool) if group_valid is None else jnp.asarray(group_valid, bool),
        is_reflection=jnp.zeros((p,), bool) if is_reflection is None else jnp.asarray(is_reflection, bool))


def narrow(batch: RolloutBatch, width: int) -> RolloutBatch:
    """The batch with only its first `width` response columns (of T): what a step whose responses all end
    within `width` tokens needs (`layout.py`)."""
    cut = lambda x: x[:, :, :width]  # noqa: E731
    return dataclasses.replace(batch, tokens=cut(batch.tokens), mask=cut(batch.mask), logprobs=cut(batch.logprobs),
                               entropies=cut(batch.entropies))


def left_align(tokens, mask):
    """Moves every row's real tokens to its right end, in order ([P, Tp] each).

    The sampler accepts any padding, but a training row is [prompt | response]: the response's first
    token must follow the prompt's last real token, so prompts are left-padded here."""
    tokens, mask = jnp.asarray(tokens, jnp.int32), jnp.asarray(mask).astype(bool)
    order = jnp.argsort(mask, axis=1, stable=True)  # padding first, then the real tokens in order
    return jnp.take_along_axis(tokens, order, axis=1), jnp.take_along_axis(mask, order, axis=1)


def batch_shardings(batch: RolloutBatch, mesh) -> RolloutBatch:
    """Groups split along P over the batch axes of the mesh (`group_*` in the sharding table)."""
    names = {1: "group_p", 2: "group_pg", 3: "group_pgt"}
    return jax.tree.map(lambda x: sharding.named(mesh, names[x.ndim], x.shape), batch)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sequences:
    """B = P * M training rows [prompt (left-padded) | response (right-padded)] of length S = Tp + T."""

    tokens: jax.Array            # [B, S]
    attention: jax.Array         # [B, S] real tokens
    response: jax.Array          # [B, S] response tokens (the loss's mask)
    on_policy: jax.Array         # [B, S] response tokens of on-policy rows (not replayed)
    advantages: jax.Array        # [B]
    sampler_logprobs: jax.Array  # [B, S] the sampler's log-probs on on-policy tokens, 0 elsewhere
    ref_logprobs: jax.Array      # [B, S] (zeros when beta = 0)
    prompt_ids: jax.Array        # [B] the row's group: rows with the same id have the same prompt columns


def to_sequences(prompt_tokens, prompt_mask, tokens, mask):
    """[B, Tp] prompts and [B, T] responses -> ([B, S] tokens, attention mask, response mask)."""
    seq = jnp.concatenate([prompt_tokens, tokens], axis=-1)
    attention = jnp.concatenate([prompt_mask, mask], axis=-1)
    response = jnp.concatenate([jnp.zeros_like(prompt_mask), mask], axis=-1)
    return seq, attention, response


def response_positions(x_bt, prompt_width: int):
    """[B, T] per-response-token values -> [B, Tp + T] aligned with `to_sequences` (0 over prompts)."""
    return jnp.pad(x_bt, ((0, 0), (prompt_width, 0)))
