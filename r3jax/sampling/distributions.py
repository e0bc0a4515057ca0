"""The next-token distribution: temperature, vocabulary masking, top-k, top-p, and what R³ records.

R3-SPEC.md §6 decides which distribution a token's log-prob and entropy describe: the one the
token is sampled from, softmax(logits / temperature), *before* top-k/top-p truncation. Truncation
only decides which tokens may be drawn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from r3jax.model.head import logprobs_and_entropy_from_logits

_FLOOR = jnp.finfo(jnp.float32).min  # finite "minus infinity": 0 * floor stays 0 in entropies


def scale(logits_bv: jax.Array, temperature: float, valid_vocab: int | None) -> jax.Array:
    """fp32 logits / temperature, with ids >= valid_vocab (padded embedding rows) excluded.

    Temperature 0 (greedy) reports the model's own distribution, softmax(logits)."""
    logits = logits_bv.astype(jnp.float32)
    if temperature > 0:
        logits = logits / temperature
    if valid_vocab is not None and valid_vocab < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < valid_vocab, logits, _FLOOR)
    return logits


def top_k_filter(logits_bv: jax.Array, k: int) -> jax.Array:
    """Keeps the k largest logits per row (ties with the k-th are kept); k = 0 keeps all."""
    if k <= 0 or k >= logits_bv.shape[-1]:
        return logits_bv
    kth = jax.lax.top_k(logits_bv, k)[0][..., -1:]
    return jnp.where(logits_bv >= kth, logits_bv, _FLOOR)


def top_p_filter(logits_bv: jax.Array, p: float) -> jax.Array:
    """Keeps the smallest set of most likely tokens whose probability mass reaches p (the nucleus).

    A token is kept when the mass of the tokens strictly more likely than it is below p, so the most
    likely token is always kept; p = 1 keeps all."""
    if p >= 1.0:
        return logits_bv
    sorted_desc = -jnp.sort(-logits_bv, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = mass_before < p
    # The smallest kept logit is the threshold; ties with it stay in.
    threshold = jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits_bv >= threshold, logits_bv, _FLOOR)


def draw(key: jax.Array, logits_bv: jax.Array) -> jax.Array:
    """One token per row from softmax(logits), by inverting the CDF with a single uniform per row.

    Exact like the Gumbel-max trick, but needs B random numbers per step instead of B x V (at
    V = 151,936 the random bits cost more than the rest of a small model's decode step). The CDF
    comes from an associative scan, so its rounding error grows like log V, not V. Tokens of
    probability 0 occupy empty CDF intervals and can never be drawn.
    """
    probs = jax.nn.softmax(logits_bv, axis=-1)
    cdf = jnp.cumsum(probs, axis=-1)
    u = jax.random.uniform(key, logits_bv.shape[:-1] + (1,), jnp.float32) * cdf[..., -1:]
    tokens = jnp.sum(cdf <= u, axis=-1)
    # u can round up to the total; fall back to the mode rather than draw past the last token.
    tokens = jnp.minimum(tokens, logits_bv.shape[-1] - 1)
    chosen = jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]
    return jnp.where(chosen > 0, tokens, jnp.argmax(logits_bv, axis=-1))


def sample(key: jax.Array, logits_bv: jax.Array, *, temperature: float, top_k: int, top_p: float,
           valid_vocab: int | None):
    """Draws one token per row. Returns (tokens [B], logprobs [B], entropies [B]).

    logprobs and entropies are those of softmax(logits / temperature) before top-k/top-p (the
    model's own softmax(logits) when temperature is 0, which decodes greedily)."""
    scaled = scale(logits_bv, temperature, valid_vocab)
    if temperature == 0:
        tokens = jnp.argmax(scaled, axis=-1)
    else:
        tokens = draw(key, top_p_filter(top_k_filter(scaled, top_k), top_p))
    tokens = tokens.astype(jnp.int32)
    logprobs, entropies = logprobs_and_entropy_from_logits(scaled, tokens)
    return tokens, logprobs, entropies
