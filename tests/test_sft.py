"""The warm start's loss (`r3jax.train.sft`): response-only cross-entropy, checked against full logits."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from r3jax import model as rm
from r3jax.rl.loss import make_optimizer
from r3jax.train import sft


@pytest.fixture(scope="module")
def model():
    return rm.init_model(rm.tiny(vocab_size=64), seed=0)


def examples():
    rng = np.random.default_rng(0)
    return [(rng.integers(3, 64, rng.integers(1, 6)).tolist(), rng.integers(3, 64, rng.integers(1, 6)).tolist())
            for _ in range(6)]


def test_pack_marks_responses_only():
    batch = sft.pack([([5, 6, 7], [8, 9])], 8, pad_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert batch.mask.tolist() == [[True] * 5 + [False] * 3]
    assert batch.target.tolist() == [[False] * 3 + [True] * 2 + [False] * 3]


@pytest.mark.parametrize("pair", [([1] * 6, [2] * 3), ([], [2]), ([1], [])])
def test_pack_refuses_what_does_not_fit(pair):
    with pytest.raises(ValueError, match="example 1"):
        sft.pack([([1], [2]), pair], 8, pad_id=0)


def test_nll_is_response_cross_entropy_of_the_full_logits(model):
    exs = examples()
    batch = sft.pack(exs, 12, pad_id=0)
    logp = jax.nn.log_softmax(model(batch.tokens, batch.mask), axis=-1)
    total, count = 0.0, 0
    for b, (prompt, response) in enumerate(exs):
        for j, token in enumerate(response):
            s = len(prompt) + j
            total -= float(logp[b, s - 1, token])
            count += 1
    np.testing.assert_allclose(float(sft.nll(model, batch, chunk_size=5)), total / count, rtol=1e-5)


def test_padding_does_not_change_the_loss(model):
    exs = examples()
    a, b = sft.pack(exs, 12, pad_id=0), sft.pack(exs, 20, pad_id=0)
    np.testing.assert_allclose(float(sft.nll(model, a)), float(sft.nll(model, b)), rtol=1e-6)


def test_fit_learns_a_repeated_batch(model):
    batch = sft.pack(examples(), 12, pad_id=0)
    before = float(sft.nll(model, batch))
    logged = []
    trained, history = sft.fit(model, make_optimizer(1e-2, warmup_steps=0), itertools.repeat(batch), 30,
                               log_every=10, log=logged.append)
    assert [r["step"] for r in history] == [10, 20, 30] and logged == history
    assert float(sft.nll(trained, batch)) < 0.5 * before


def test_fit_stops_on_a_non_finite_loss(model):
    batch = sft.pack(examples(), 12, pad_id=0)
    with pytest.raises(FloatingPointError, match="step 2"):
        sft.fit(model, make_optimizer(jnp.inf, warmup_steps=0), itertools.repeat(batch), 2, log_every=1,
                log=lambda r: None)
