"""The explicit KV cache: prefill then decode equals one full forward; causality."""

import numpy as np

from r3jax import model as rm


def test_prefill_then_decode_equals_full_forward():
    config = rm.tiny()
    model = rm.init_model(config, seed=3)
    rng = np.random.RandomState(0)
    n, m = 6, 4
    prompt = rng.randint(0, config.vocab_size, (3, n))
    prompt_mask = np.ones((3, n), bool)
    prompt_mask[0, :2] = False  # left-padded, ragged prompts
    prompt_mask[2, :5] = False
    new = rng.randint(0, config.vocab_size, (3, m))

    cache = rm.init_cache(config, batch=3, max_length=n + m + 2)
    hidden, cache = model.hidden_states(prompt, prompt_mask, cache=cache)
    stepped = [np.asarray(model.logits(hidden))]
    for i in range(m):
        hidden, cache = model.hidden_states(new[:, i:i + 1], np.ones((3, 1), bool), cache=cache)
        stepped.append(np.asarray(model.logits(hidden)))
    stepped = np.concatenate(stepped, axis=1)

    full_mask = np.concatenate([prompt_mask, np.ones((3, m), bool)], 1)
    full = np.asarray(model(np.concatenate([prompt, new], 1), attention_mask=full_mask))
    np.testing.assert_allclose(stepped[full_mask], full[full_mask], atol=1e-5)
    assert int(cache.index) == n + m


def test_a_later_token_never_changes_an_earlier_output():
    config = rm.tiny_tied()
    model = rm.init_model(config, seed=4)
    tokens = np.random.RandomState(1).randint(0, config.vocab_size, (2, 9))
    changed = tokens.copy()
    changed[:, 5:] = (changed[:, 5:] + 7) % config.vocab_size
    a, b = np.asarray(model(tokens)), np.asarray(model(changed))
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    assert np.abs(a[:, 5:] - b[:, 5:]).max() > 1e-3
