"""A memory-safe output head for training: per-token log-prob of the target and entropy.

At V = 151,936 and 9K tokens a full [B, T, V] fp32 logits tensor is 5 GB per sequence. Here the
sequence is cut into chunks of C tokens; one `lax.scan` step projects a chunk to logits, reduces
them to two numbers per token, and is rematerialised, so the backward pass recomputes each chunk's
logits instead of storing them. Peak extra memory is one [B, C, V] block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A finite "minus infinity" for excluded ids: probability 0, and 0 * logit stays 0 in entropies.
MASKED_LOGIT = float(jnp.finfo(jnp.float32).min)


def mask_vocab(logits_v: jax.Array, valid_vocab: int | None) -> jax.Array:
    """Excludes ids >= valid_vocab (padded embedding rows: the 1.5B model has 151936 for 151665 ids)."""
    if valid_vocab is None or valid_vocab >= logits_v.shape[-1]:
        return logits_v
    return jnp.where(jnp.arange(logits_v.shape[-1]) < valid_vocab, logits_v, MASKED_LOGIT)


def logprobs_and_entropy_from_logits(logits_btv: jax.Array, targets_bt: jax.Array):
    """log softmax(logits)[target] and the entropy -sum p log p, in fp32 (the reference formula)."""
    logits = logits_btv.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets_bt[..., None], axis=-1)[..., 0]
    probs = jax.nn.softmax(logits, axis=-1)
    return target_logit - logz, logz - jnp.sum(probs * logits, axis=-1)


def token_logprobs_and_entropy(hidden_btd: jax.Array, targets_bt: jax.Array, head_vd, *,
                               chunk_size: int = 512, temperature: float = 1.0,
                               valid_vocab: int | None = None):
    """Returns (logprobs [B, T], entropy [B, T]) in fp32 under softmax(hidden @ head_vd.T / temperature).

    hidden_btd: final-normed hidden states (e.g. `model.hidden_states(...)[0]`); targets_bt: the
    token whose log-prob is wanted at each position; head_vd: `model.head_weight()` [V, D], or the
    model itself.
    valid_vocab: when set, logits of ids >= valid_vocab are excluded (padded embedding rows).
    Gradients flow to hidden and head through both outputs.
    """
    if hasattr(head_vd, "head_weight"):
        head_vd = head_vd.head_weight()
    b, t, d = hidden_btd.shape
    c = max(1, min(chunk_size, t))
    pad = (-t) % c
    hidden = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets_bt, ((0, 0), (0, pad)))
    n = (t + pad) // c
    # [n, B, C, ...]: scan over chunks of the sequence.
    hidden_nbcd = hidden.reshape(b, n, c, d).swapaxes(0, 1)
    targets_nbc = targets.reshape(b, n, c).swapaxes(0, 1)

    @jax.checkpoint
    def chunk(h_bcd, y_bc):
        logits = jnp.einsum("bcd,vd->bcv", h_bcd, head_vd, preferred_element_type=jnp.float32)
        logits = mask_vocab(logits / temperature, valid_vocab)
        return logprobs_and_entropy_from_logits(logits, y_bc)

    _, (logp_nbc, ent_nbc) = jax.lax.scan(lambda carry, xs: (carry, chunk(*xs)), None,
                                          (hidden_nbcd, targets_nbc))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * c)[:, :t]  # noqa: E731
    return unchunk(logp_nbc), unchunk(ent_nbc)
