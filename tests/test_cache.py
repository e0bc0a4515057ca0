"""The explicit KV cache: prefill then decode equals one full forward; causality."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import formula

from r3jax import model as rm
from r3jax.model import attention
from r3jax.model import cache as kv_cache


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


@pytest.mark.parametrize("head", [None, 13, 3], ids=["stacked", "per_layer", "per_layer_head_3"])
@pytest.mark.parametrize("t, bound, block", [(1, 9, 4), (1, 13, 4), (3, 11, 4), (3, 11, 16), (1, 2, 4)])
def test_blocked_cached_attention_equals_full_attention(t, bound, block, head):
    """Blocks of 4 over 13 slots: the last block is moved back to end at 13 and overlaps the one before; a
    block of 16 holds the whole cache. Stacked [L, B, K, S, H]; or per layer (keys [.., H, S]), as one part or
    as a head of 3 slots (read whole) and a tail of 10 (in blocks)."""
    rng = np.random.RandomState(t)
    b, n, k, s, h = 2, 4, 2, 13, 8
    q = jnp.asarray(rng.randn(b, t, n, h), jnp.float32)
    cache = jnp.asarray(rng.randn(2, 3, b, k, s, h), jnp.float32)  # (k, v) x [L=3, B, K, S, H]
    kv = (cache[0], cache[1])
    if head:  # per layer, keys slots last
        keys = cache[0].swapaxes(-1, -2)
        kv = (tuple((x[..., :head], x[..., head:])[:1 if head == s else 2] for x in keys),
              tuple((x[..., :head, :], x[..., head:, :])[:1 if head == s else 2] for x in cache[1]))
    mask = rng.rand(b, t, s) < 0.7
    mask[:, :, bound:] = False  # nothing at or past the bound is visible
    mask[:, :, 0] = True
    full = formula(q, cache[0, 1], cache[1, 1], jnp.asarray(mask))
    blocked = attention.attend_cached(q, kv, 1, jnp.asarray(mask), jnp.int32(bound), block=block)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(full), atol=1e-6)
    # Reading blocks that hold nothing visible changes no bit.
    further = attention.attend_cached(q, kv, 1, jnp.asarray(mask), jnp.int32(s), block=block)
    np.testing.assert_array_equal(np.asarray(further), np.asarray(blocked))


def test_rows_with_their_own_write_slot_equal_rows_decoded_alone():
    config = rm.tiny()
    model = rm.init_model(config, seed=5)
    rng = np.random.RandomState(2)
    prompt = rng.randint(0, config.vocab_size, (2, 5))
    new = rng.randint(0, config.vocab_size, (2, 1))
    alone = []
    for row in range(2):  # row 1 is one token further along than row 0
        cache = rm.init_cache(config, batch=1, max_length=9)
        _, cache = model.hidden_states(prompt[row:row + 1, :4 + row], cache=cache)
        hidden, _ = model.hidden_states(new[row:row + 1], cache=cache)
        alone.append(np.asarray(hidden))
    cache = rm.init_cache(config, batch=2, max_length=9)
    _, cache = model.hidden_states(prompt, np.array([[1, 1, 1, 1, 0], [1] * 5], bool), cache=cache)
    cache = cache.__class__(k=cache.k, v=cache.v, mask=cache.mask, index=jnp.array([4, 5], jnp.int32))
    hidden, cache = model.hidden_states(new, cache=cache)
    np.testing.assert_allclose(np.asarray(hidden), np.concatenate(alone), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.mask)[:, :6], [[1, 1, 1, 1, 1, 0], [1] * 6])


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per_layer"])
def test_rows_reading_a_shared_prefix_equal_rows_holding_their_own_copy(per_layer):
    """Two ragged, left-padded prompts, 3 rows each: decoding 3 tokens over a cache whose `Prefix` holds each
    prompt once (and whose own slots hold only the new tokens) gives the hidden states and positions of rows
    whose caches each hold a copy of their prompt."""
    config = rm.tiny()
    model = rm.init_model(config, seed=6)
    rng = np.random.RandomState(3)
    q, g, n, m = 2, 3, 5, 3
    prompt = rng.randint(0, config.vocab_size, (q, n))
    prompt_mask = np.ones((q, n), bool)
    prompt_mask[1, :2] = False
    new = rng.randint(0, config.vocab_size, (q * g, m))

    _, once = model.hidden_states(prompt, prompt_mask, cache=rm.init_cache(config, batch=q, max_length=n))
    copies = rm.init_cache(config, batch=q * g, max_length=n + m)
    _, copies = model.hidden_states(np.repeat(prompt, g, 0), np.repeat(prompt_mask, g, 0), cache=copies)
    shared = rm.init_cache(config, batch=q * g, max_length=m, per_layer=2 if per_layer else 0)
    shared = dataclasses.replace(shared, prefix=kv_cache.as_prefix(once.k, once.v, once.mask, shared))
    layers = model.unstack_layers() if per_layer else None
    for i in range(m):
        want, copies = model.hidden_states(new[:, i:i + 1], cache=copies)
        got, shared = model.hidden_states(new[:, i:i + 1], cache=shared, layers=layers)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert int(shared.index) == m and shared.max_length == m
