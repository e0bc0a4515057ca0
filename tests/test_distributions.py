"""Top-k, top-p and greedy on fixed logits against numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from r3jax.sampling import distributions

LOGITS = np.log(np.array([[0.05, 0.4, 0.1, 0.3, 0.15],
                          [0.02, 0.02, 0.9, 0.03, 0.03]], np.float32))


def kept(filtered):
    return np.asarray(filtered) > np.finfo(np.float32).min / 2


def nucleus_reference(probs, p):
    """The smallest set of most likely tokens whose mass reaches p."""
    order = np.argsort(-probs)
    keep = np.zeros_like(probs, bool)
    mass = 0.0
    for i in order:
        keep[i] = True
        mass += probs[i]
        if mass >= p:
            break
    return keep


@pytest.mark.parametrize("p", [0.3, 0.4, 0.5, 0.7, 0.71, 0.85, 0.95, 0.999])
def test_top_p_keeps_exactly_the_smallest_nucleus(p):
    got = kept(distributions.top_p_filter(jnp.asarray(LOGITS), p))
    ref = np.stack([nucleus_reference(np.exp(row.astype(np.float64)), p) for row in LOGITS])
    np.testing.assert_array_equal(got, ref)


def test_top_k_keeps_the_k_largest():
    got = kept(distributions.top_k_filter(jnp.asarray(LOGITS), 2))
    np.testing.assert_array_equal(got, [[0, 1, 0, 1, 0], [0, 0, 1, 1, 1]])  # ties with the 2nd are kept


def test_logprob_and_entropy_ignore_truncation():
    tokens, logp, ent = distributions.sample(jax.random.key(0), jnp.asarray(LOGITS), temperature=1.0, top_k=1,
                                             top_p=0.5, valid_vocab=None)
    probs = np.exp(LOGITS.astype(np.float64))
    np.testing.assert_array_equal(np.asarray(tokens), [1, 2])
    np.testing.assert_allclose(np.asarray(logp), np.log(probs[[0, 1], [1, 2]]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent), -(probs * np.log(probs)).sum(-1), atol=1e-6)


def test_draws_follow_the_truncated_distribution():
    logits = jnp.tile(jnp.asarray(LOGITS[:1]), (4000, 1))
    tokens, _, _ = distributions.sample(jax.random.key(1), logits, temperature=1.0, top_k=0, top_p=0.7,
                                        valid_vocab=None)
    freq = np.bincount(np.asarray(tokens), minlength=5) / 4000
    np.testing.assert_allclose(freq, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0], atol=0.03)


def test_inverse_cdf_never_draws_excluded_tokens_at_either_end():
    logits = np.full((2000, 6), np.finfo(np.float32).min, np.float32)
    logits[:, 1:4] = [0.0, 1.0, 0.5]  # ids 0, 4 and 5 are excluded
    tokens = np.asarray(distributions.draw(jax.random.key(2), jnp.asarray(logits)))
    assert set(np.unique(tokens)) == {1, 2, 3}
    probs = np.exp([0.0, 1.0, 0.5]) / np.exp([0.0, 1.0, 0.5]).sum()
    np.testing.assert_allclose(np.bincount(tokens, minlength=6)[1:4] / 2000, probs, atol=0.035)


def test_top_p_keeps_ties_with_the_threshold():
    logits = jnp.log(jnp.asarray([[0.4, 0.2, 0.2, 0.2], [0.1, 0.6, 0.1, 0.2]]))
    np.testing.assert_array_equal(kept(distributions.top_p_filter(logits, 0.5)), [[1, 1, 1, 1], [0, 1, 0, 0]])


def test_two_level_draw_crosses_blocks_and_the_ragged_last_block():
    """Mass in the first, a middle and the partial last block of a 1000-id vocabulary (blocks of 256)."""
    ids, weights = np.array([3, 255, 256, 600, 999]), np.array([0.1, 0.2, 0.3, 0.15, 0.25])
    logits = np.full((8000, 1000), np.finfo(np.float32).min, np.float32)
    logits[:, ids] = np.log(weights)
    tokens = np.asarray(distributions.draw(jax.random.key(3), jnp.asarray(logits)))
    assert set(np.unique(tokens)) <= set(ids.tolist())
    np.testing.assert_allclose(np.bincount(tokens, minlength=1000)[ids] / 8000, weights, atol=0.02)
