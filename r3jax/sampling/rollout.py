"""What the sampler returns, and the post-loop helpers that make it clean."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
    """G sampled responses per prompt, prompt-major: row b answers prompt b // G.

    tokens     [B, T] int32   generated tokens; pad_id after a response's end
    logprobs   [B, T] float32 log-prob of each token under softmax(logits / temperature),
                              before top-k/top-p (R3-SPEC §6); 0 where mask is False
    entropies  [B, T] float32 entropy of that same distribution; 0 where mask is False
    mask       [B, T] bool    True for the response's tokens, its end token included
    lengths    [B]    int32   response tokens, the end token included
    truncated  [B]    bool    hit max_new_tokens without an end token
    """

    tokens: jax.Array
    logprobs: jax.Array
    entropies: jax.Array
    mask: jax.Array
    lengths: jax.Array
    truncated: jax.Array

    @property
    def num_responses(self) -> int:
        return self.tokens.shape[0]


def response_mask(lengths_b: jax.Array, max_new_tokens: int) -> jax.Array:
    """[B, T] True for the first lengths[b] positions."""
    return jnp.arange(max_new_tokens)[None, :] < lengths_b[:, None]


def mask_after_end(values_bt: jax.Array, mask_bt: jax.Array, fill) -> jax.Array:
    """Replaces everything outside the response with `fill`."""
    return jnp.where(mask_bt, values_bt, jnp.asarray(fill, values_bt.dtype))
