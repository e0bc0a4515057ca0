"""R3-SPEC §3: correct -> 1 + max(0, 1 - l / 32768), wrong -> 0."""

import numpy as np
import pytest

from r3jax.rewards import reward


def test_length_bonus():
    got = reward.r3_reward([True, True, True, True, False], [0, 16384, 32768, 40000, 10])
    np.testing.assert_allclose(got, [2.0, 1.5, 1.0, 1.0, 0.0])


def test_without_lengths_correct_is_one():
    np.testing.assert_array_equal(reward.r3_reward([True, False]), [1.0, 0.0])


def test_custom_max_length():
    np.testing.assert_allclose(reward.r3_reward(True, 100, max_length=400), 1.75)


def test_bad_inputs():
    with pytest.raises(ValueError, match="num_tokens"):
        reward.r3_reward([True], [-1])
    with pytest.raises(ValueError, match="max_length"):
        reward.r3_reward([True], [1], max_length=0)


def test_jax_arrays_give_the_same_rewards():
    import jax
    import jax.numpy as jnp

    correct, lengths = [True, True, False], [100, 40000, 5]
    got = jax.jit(lambda c, n: reward.r3_reward(c, n, xp=jnp))(jnp.asarray(correct), jnp.asarray(lengths))
    np.testing.assert_allclose(got, reward.r3_reward(correct, lengths), rtol=1e-6)
