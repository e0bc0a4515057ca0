"""The next-token distribution: temperature, vocabulary masking, top-k, top-p, and what R³ records.

R3-SPEC.md §6 decides which distribution a token's log-prob and entropy describe: the one the
token is sampled from, softmax(logits / temperature), *before* top-k/top-p truncation. Truncation
only decides which tokens may be drawn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from r3jax.model.head import MASKED_LOGIT as _FLOOR
from r3jax.model.head import logprobs_and_entropy_from_logits, mask_vocab


def scale(logits_bv: jax.Array, temperature: float, valid_vocab: int | None) -> jax.Array:
    """fp32 logits / temperature, with ids >= valid_vocab (padded embedding rows) excluded.

    Temperature 0 (greedy) reports the model's own distribution, softmax(logits)."""
    logits = logits_bv.astype(jnp.float32)
    if temperature > 0:
        logits = logits / temperature
    return mask_vocab(logits, valid_vocab)


def top_k_filter(logits_bv: jax.Array, k: int) -> jax.Array:
    """Keeps the k largest logits per row (ties with the k-th are kept); k = 0 keeps all."""
    if k <= 0 or k >= logits_bv.shape[-1]:
        return logits_bv
    kth = jax.lax.top_k(logits_bv, k)[0][..., -1:]
    return jnp.where(logits_bv >= kth, logits_bv, _FLOOR)


def top_p_filter(logits_bv: jax.Array, p: float) -> jax.Array:
    """Keeps the smallest set of most likely tokens whose probability mass reaches p (the nucleus).

    The nucleus is {tokens with prob >= tau}, tau the largest probability whose upper set still
    holds mass p (ties with tau stay in; the most likely token always does; p = 1 keeps all).
    tau is found without sorting: non-negative fp32 values order like their int32 bit patterns, so a
    31-step bisection over bit patterns lands exactly on one of the row's probabilities. A sort of
    B x V per decode step costs ~25x more on a CPU (1.8 s at B = 32, V = 151,936).
    """
    if p >= 1.0:
        return logits_bv
    probs = jax.nn.softmax(logits_bv, axis=-1).reshape(-1, logits_bv.shape[-1])  # [B, V]
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)

    def bisect(_, bounds):
        lo, hi = bounds  # invariant: mass(lo) >= p > mass(hi), mass(tau) = sum of probs >= tau
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(jnp.where(bits >= mid[:, None], probs, 0.0), axis=-1) >= p
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    bounds = (jnp.zeros(bits.shape[:1], jnp.int32), jnp.max(bits, axis=-1) + 1)
    tau, _ = jax.lax.fori_loop(0, 31, bisect, bounds)
    keep = (bits >= tau[:, None]).reshape(logits_bv.shape)
    return jnp.where(keep, logits_bv, _FLOOR)


def draw(key: jax.Array, logits_bv: jax.Array, block: int = 256) -> jax.Array:
    """One token per row from softmax(logits); see `draw_uniform`."""
    return draw_uniform(jax.random.uniform(key, logits_bv.shape[:1], jnp.float32), logits_bv, block)


def draw_uniform(uniform_b: jax.Array, logits_bv: jax.Array, block: int = 256) -> jax.Array:
    """One token per row from softmax(logits), by inverting the CDF at one uniform [0, 1) number per row.

    Exact like the Gumbel-max trick, but needs B random numbers per step instead of B x V (at
    V = 151,936 the random bits cost more than the rest of a small model's decode step). The CDF
    is inverted in two levels: the block of `block` ids holding u (a CDF over V / block block
    sums), then the id inside it (a CDF over one block). A CDF over all V ids costs far more on CPU
    (XLA lowers a cumulative sum to a windowed reduction) and its rounding grows with V. Tokens of
    probability 0 occupy empty CDF intervals and can never be drawn.
    """
    b, v = logits_bv.shape
    probs = jax.nn.softmax(logits_bv, axis=-1)
    nb = -(-v // block)
    blocks = jnp.pad(probs, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)    # [B, nb, C]
    block_sums = blocks.sum(-1)                                                        # [B, nb]
    block_cdf = jnp.cumsum(block_sums, axis=-1)
    u = uniform_b[:, None] * block_cdf[:, -1:]
    # u may round up to the total: then the last block with any mass
    last_nonempty = nb - 1 - jnp.argmax((block_sums > 0)[:, ::-1], axis=-1)
    chosen = jnp.minimum(jnp.sum(block_cdf <= u, axis=-1), last_nonempty)             # [B]
    before = jnp.take_along_axis(block_cdf - block_sums, chosen[:, None], axis=-1)    # mass before the block
    inner = jnp.take_along_axis(blocks, chosen[:, None, None], axis=1)[:, 0]          # [B, C]
    offset = jnp.minimum(jnp.sum(jnp.cumsum(inner, axis=-1) <= u - before, axis=-1), block - 1)
    # rounding can land on a zero-probability id at the block's end: take the block's mode instead
    offset = jnp.where(jnp.take_along_axis(inner, offset[:, None], axis=-1)[:, 0] > 0, offset,
                       jnp.argmax(inner, axis=-1))
    return chosen * block + offset


def sample(key: jax.Array | None, logits_bv: jax.Array, *, temperature: float, top_k: int, top_p: float,
           valid_vocab: int | None, uniform: jax.Array | None = None):
    """Draws one token per row. Returns (tokens [B], logprobs [B], entropies [B]).

    The randomness is `key`, or `uniform` [B] numbers in [0, 1) drawn ahead (the sampler draws every
    step's at once: per-step random-bit generation is a loop of its own on CPU).

    logprobs and entropies are those of softmax(logits / temperature) before top-k/top-p (the
    model's own softmax(logits) when temperature is 0, which decodes greedily)."""
    scaled = scale(logits_bv, temperature, valid_vocab)
    if temperature == 0:
        tokens = jnp.argmax(scaled, axis=-1)
    else:
        if uniform is None:
            uniform = jax.random.uniform(key, logits_bv.shape[:1], jnp.float32)
        tokens = draw_uniform(uniform, top_p_filter(top_k_filter(scaled, top_k), top_p))
    tokens = tokens.astype(jnp.int32)
    logprobs, entropies = logprobs_and_entropy_from_logits(scaled, tokens)
    return tokens, logprobs, entropies
