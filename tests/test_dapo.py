"""DAPO: dynamic sampling keeps groups with reward variance in fixed shapes; overlong shaping."""

import numpy as np

from r3jax.rl import dapo


def test_select_groups_prefers_varied_groups_in_order():
    rewards = np.array([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [2.0, 0.0], [0.5, 0.5]])
    valid = np.ones_like(rewards, bool)
    index, keep = dapo.select_groups(rewards, valid, 3)
    np.testing.assert_array_equal(index[:2], [1, 3])
    np.testing.assert_array_equal(keep, [True, True, False])


def test_padded_slots_do_not_create_variance():
    rewards = np.array([[1.0, 5.0]])
    assert not bool(dapo.has_variance(rewards, np.array([[True, False]]))[0])


def test_overlong_penalty():
    got = dapo.overlong_penalty(np.array([100, 768, 896, 1024, 2000]), 1024, 256)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0, -1.0])
    np.testing.assert_array_equal(dapo.overlong_penalty(np.array([5000]), 1024, 0), [0.0])
