"""The chunked log-prob/entropy head equals the naive full-logits computation, without its memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from r3jax.model import head


def naive(hidden, targets, w, temperature=1.0):
    logits = np.einsum("btd,vd->btv", np.float64(hidden), np.float64(w)) / temperature
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    logp_all = logits - logz[..., None]
    logp = np.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    return logp, -(np.exp(logp_all) * logp_all).sum(-1)


@pytest.fixture
def inputs():
    rng = np.random.RandomState(0)
    return (rng.randn(2, 13, 16).astype(np.float32), rng.randint(0, 50, (2, 13)),
            rng.randn(50, 16).astype(np.float32))


@pytest.mark.parametrize("chunk, temperature", [(4, 1.0), (13, 0.7), (64, 1.3)])
def test_chunked_equals_naive(inputs, chunk, temperature):
    hidden, targets, w = inputs
    logp, ent = head.token_logprobs_and_entropy(hidden, targets, w, chunk_size=chunk, temperature=temperature)
    ref_logp, ref_ent = naive(hidden, targets, w, temperature)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5)


def test_chunked_gradients_equal_full_logits_gradients(inputs):
    hidden, targets, w = inputs

    def chunked(h, w):
        logp, ent = head.token_logprobs_and_entropy(h, targets, w, chunk_size=4)
        return logp.sum() + 0.1 * ent.sum()

    def full(h, w):
        logp, ent = head.logprobs_and_entropy_from_logits(jnp.einsum("btd,vd->btv", h, w), targets)
        return logp.sum() + 0.1 * ent.sum()

    for a, b in zip(jax.grad(chunked, (0, 1))(hidden, w), jax.grad(full, (0, 1))(hidden, w), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_valid_vocab_excludes_padded_rows(inputs):
    hidden, targets, w = inputs
    targets = targets % 40
    logp, ent = head.token_logprobs_and_entropy(hidden, targets, w, chunk_size=5, valid_vocab=40)
    ref_logp, ref_ent = naive(hidden, targets, w[:40])
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5)


def test_backward_never_materialises_full_logits():
    b, t, d, v, c = 2, 2048, 32, 4096, 64
    hidden = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)
    w = jax.ShapeDtypeStruct((v, d), jnp.float32)

    def loss(h, w, y):
        return head.token_logprobs_and_entropy(h, y, w, chunk_size=c)[0].sum()

    compiled = jax.jit(jax.grad(loss, (0, 1))).lower(hidden, w, targets).compile()
    chunk_block_bytes = b * c * v * 4
    # A few [B, C, V] blocks live at once (logits, probabilities, their cotangent); never [B, T, V].
    assert compiled.memory_analysis().temp_size_in_bytes < 4 * chunk_block_bytes <= b * t * v * 4 / 8


def test_model_head_gives_the_models_own_logprobs():
    from r3jax import model as rm

    model = rm.init_model(rm.tiny_tied(), seed=2)
    tokens = np.random.RandomState(3).randint(0, 256, (2, 7))
    hidden, _ = model.hidden_states(tokens)
    logp, ent = head.token_logprobs_and_entropy(hidden[:, :-1], tokens[:, 1:], model, chunk_size=4)
    ref_logp, ref_ent = head.logprobs_and_entropy_from_logits(model(tokens)[:, :-1], tokens[:, 1:])
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5)
