"""DAPO: dynamic sampling keeps groups with reward variance in fixed shapes; overlong shaping."""

import numpy as np

from r3jax.rl import advantages, dapo


def test_select_groups_keeps_mixed_accuracy_groups_in_order():
    correct = np.array([[True, True], [False, True], [False, False], [True, False], [True, True]])
    valid = np.ones_like(correct, bool)
    index, keep = dapo.select_groups(correct, valid, 3)
    np.testing.assert_array_equal(index[:2], [1, 3])
    np.testing.assert_array_equal(keep, [True, True, False])


def test_filter_groups_masks_the_fillers():
    import jax.numpy as jnp
    from test_train_step import make_batch

    batch = make_batch([[True, True], [False, True], [False, False], [True, False]])
    picked = dapo.filter_groups(batch, 3)
    np.testing.assert_array_equal(picked.qids, [1, 3, 0])
    np.testing.assert_array_equal(picked.group_valid, [True, True, False])
    np.testing.assert_array_equal(picked.tokens[0], batch.tokens[1])
    assert isinstance(picked.qids, jnp.ndarray)


def test_padded_slots_do_not_create_variance():
    rewards = np.array([[1.0, 5.0]])
    assert not bool(advantages.has_spread(rewards, np.array([[True, False]]))[0])


def test_overlong_penalty():
    got = dapo.overlong_penalty(np.array([100, 768, 896, 1024, 2000]), 1024, 256)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0, -1.0])
    np.testing.assert_array_equal(dapo.overlong_penalty(np.array([5000]), 1024, 0), [0.0])
