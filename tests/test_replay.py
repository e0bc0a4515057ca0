"""The sample buffer (rings, counters, sharding) and Cross-Context Replay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from r3jax.model import sharding
from r3jax.rl import replay


def responses(*ids, t=4):
    """Rows of tokens [n, t] whose first token names the response, and their lengths."""
    return np.array([[i] * t for i in ids], np.int32), np.array([t] * len(ids), np.int32)


def test_insert_fills_rings_and_counts():
    buf = replay.init_buffer(3, 4)
    tokens, lengths = responses(10, 11, 12, 13)
    buf = replay.insert(buf, [1, 1, 2, 1], tokens, lengths, [True, False, False, True], [True] * 4, step=5)
    np.testing.assert_array_equal(buf.attempts, [0, 3, 1])
    np.testing.assert_array_equal(buf.corrects, [0, 2, 0])
    np.testing.assert_array_equal(buf.correct.tokens[1, :, 0], [10, 13])
    np.testing.assert_array_equal(buf.wrong.tokens[1, :, 0], [11, 0])
    np.testing.assert_array_equal(buf.wrong.filled, [[False, False], [True, False], [True, False]])
    np.testing.assert_array_equal(buf.correct.step[1], [5, 5])


def test_ring_keeps_the_most_recent():
    buf = replay.init_buffer(2, 4)
    tokens, lengths = responses(1, 2, 3)
    buf = replay.insert(buf, [0, 0, 0], tokens, lengths, [True] * 3, [True] * 3, step=0)  # 3 into 2 slots
    assert sorted(np.asarray(buf.correct.tokens[0, :, 0]).tolist()) == [2, 3]
    tokens, lengths = responses(4)
    buf = replay.insert(buf, [0], tokens, lengths, [True], [True], step=1)  # overwrites the oldest (2)
    assert sorted(np.asarray(buf.correct.tokens[0, :, 0]).tolist()) == [3, 4]
    assert int(buf.attempts[0]) == 4


def test_invalid_rows_change_nothing():
    buf = replay.init_buffer(2, 4)
    tokens, lengths = responses(7, 8)
    after = replay.insert(buf, [0, 5], tokens, lengths, [True, True], [False, True], step=0)  # 5: out of range
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(buf), strict=True):
        np.testing.assert_array_equal(a, b)


def test_lengths_and_tokens_are_cut_to_the_buffer():
    buf = replay.init_buffer(1, 3)
    buf = replay.insert(buf, [0], np.arange(5)[None], [5], [False], [True], step=0)
    np.testing.assert_array_equal(buf.wrong.tokens[0, 0], [0, 1, 2])
    assert int(buf.wrong.lengths[0, 0]) == 3


def test_retrieve_picks_filled_slots_without_replacement():
    buf = replay.init_buffer(2, 4, slots_correct=3)
    tokens, lengths = responses(1, 2)
    buf = replay.insert(buf, [0, 0], tokens, lengths, [True, True], [True, True], step=0)
    seen = set()
    for seed in range(8):
        tok, ln, ok = replay.retrieve(buf.correct, jnp.array([0, 1]), jnp.array([True, True]), 2,
                                      jax.random.key(seed))
        np.testing.assert_array_equal(ok, [[True, True], [False, False]])  # question 1 has nothing stored
        assert sorted(np.asarray(tok[0, :, 0]).tolist()) == [1, 2]
        seen.add(tuple(np.asarray(tok[0, :, 0]).tolist()))
        np.testing.assert_array_equal(ln[1], [0, 0])
    assert len(seen) == 2  # both orders occur: the choice is random


def test_ccr_appends_k_opposite_when_available_fewer_when_not_never_for_mixed():
    buf = replay.init_buffer(4, 4, slots_correct=3, slots_wrong=3)
    tokens, lengths = responses(1, 2, 3, 4, 5, 6)
    # q0: 3 stored correct; q1: 1 stored correct; q2: 2 stored wrong; q3: both kinds
    buf = replay.insert(buf, [0, 0, 0, 1, 2, 2], tokens, lengths, [True] * 4 + [False] * 2, [True] * 6, step=0)
    tokens, lengths = responses(7, 8)
    buf = replay.insert(buf, [3, 3], tokens, lengths, [True, False], [True, True], step=0)
    correct = np.array([[False, False], [False, False], [True, True], [True, False]])
    out = replay.cross_context_replay(buf, jnp.arange(4), correct, np.ones((4, 2), bool), np.ones(4, bool), 2,
                                      jax.random.key(0))
    np.testing.assert_array_equal(out.appended, [2, 1, 2, 0])
    np.testing.assert_array_equal(out.correct[:2], [[True, True], [True, True]])
    np.testing.assert_array_equal(out.correct[2], [False, False])
    assert set(np.asarray(out.tokens[0, :, 0]).tolist()) <= {1, 2, 3}
    np.testing.assert_array_equal(out.tokens[2, :, 0] * 0 + np.sort(out.tokens[2, :, 0]), [5, 6])
    np.testing.assert_array_equal(out.lengths[1], [4, 0])


def test_ccr_skips_invalid_groups():
    buf = replay.init_buffer(1, 4)
    tokens, lengths = responses(1)
    buf = replay.insert(buf, [0], tokens, lengths, [True], [True], step=0)
    out = replay.cross_context_replay(buf, jnp.array([0]), np.zeros((1, 2), bool), np.ones((1, 2), bool),
                                      np.array([False]), 2, jax.random.key(0))
    assert int(out.appended[0]) == 0


def test_buffer_is_sharded_along_questions():
    mesh = sharding.make_mesh(data=2, fsdp=4)
    buf = replay.init_buffer(16, 4)
    placed = jax.device_put(buf, replay.buffer_shardings(buf, mesh))
    assert placed.correct.tokens.addressable_shards[0].data.shape == (2, 2, 4)
    assert placed.attempts.addressable_shards[0].data.shape == (2,)
    tokens, lengths = responses(9, 9)
    out = jax.jit(replay.insert, static_argnames=())(placed, jnp.array([3, 12]), tokens, lengths,
                                                      jnp.array([True, False]), jnp.array([True, True]), 0)
    ref = replay.insert(buf, jnp.array([3, 12]), tokens, lengths, jnp.array([True, False]), jnp.array([True, True]), 0)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="slots_wrong"):
        replay.init_buffer(2, 4, slots_wrong=0)


def test_insert_refuses_a_negative_step():
    tokens, lengths = responses(1)
    with pytest.raises(ValueError, match=r"\(>= 0\), got -1"):
        replay.insert(replay.init_buffer(2, 4), [0], tokens, lengths, [True], [True], step=-1)


def test_replay_needs_counts_what_ccr_fills_and_bounds_its_lengths():
    """Group 0 all wrong (2 stored correct, k = 2: both), group 1 all correct (1 stored wrong), group 2 mixed
    (its stored answers stay), group 3 all wrong with nothing stored: 3 responses, the longest stored one 5."""
    buf = replay.init_buffer(4, 6)
    tokens = np.ones((5, 6), np.int32)
    buf = replay.insert(buf, [0, 0, 1, 2, 2], tokens, [2, 5, 3, 6, 6], [True, True, False, True, False], [True] * 5,
                        step=0)
    correct = jnp.array([[False, False], [True, True], [True, False], [False, False]])
    valid, group_valid = jnp.ones((4, 2), bool), jnp.ones((4,), bool)
    count, longest = replay.replay_needs(buf, jnp.arange(4), correct, valid, group_valid, k=2)
    assert (int(count), int(longest)) == (3, 5)
    for seed in range(4):
        rep = replay.cross_context_replay(buf, jnp.arange(4), correct, valid, group_valid, 2, jax.random.key(seed))
        assert int(rep.valid.sum()) == 3 and int(rep.lengths.max()) <= 5
