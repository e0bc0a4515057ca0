"""Eq. 1 (GRPO) and Eq. 3 (R³ mixed groups) on hand-worked examples."""

import numpy as np

from r3jax.rl import advantages


def test_eq1_on_a_hand_example():
    # rewards 2, 0, 0, 0: mean 0.5, population std sqrt(0.75)
    got = advantages.group_advantages(np.array([[2.0, 0, 0, 0]]), np.ones((1, 4), bool), np.array([False]))
    std = np.sqrt(0.75)
    np.testing.assert_allclose(got, [[1.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6),
                                      -0.5 / (std + 1e-6)]], rtol=1e-6)


def test_eq3_on_a_mixed_group():
    # 3 wrong on-policy (0) + 1 replayed correct (1.5) + 1 empty replay slot; alpha 2, lambda 0.1
    rewards = np.array([[0.0, 0, 0, 1.5, 9.0]])
    valid = np.array([[True, True, True, True, False]])
    got = advantages.group_advantages(rewards, valid, np.array([True]), alpha=2.0, lam=0.1)
    mean, std = 0.375, np.sqrt((3 * 0.375**2 + 1.125**2) / 4)
    expected = [(r - mean) / (2.0 * std + 0.1) for r in (0, 0, 0, 1.5)] + [0.0]
    np.testing.assert_allclose(got, [expected], rtol=1e-6)


def test_all_equal_group_is_zero_not_nan():
    for mixed in (False, True):
        got = advantages.group_advantages(np.full((1, 4), 1.7), np.ones((1, 4), bool), np.array([mixed]))
        assert np.all(np.asarray(got) == 0.0)
    got = advantages.group_advantages(np.zeros((1, 4)), np.zeros((1, 4), bool), np.array([False]))
    assert np.all(np.asarray(got) == 0.0)


def test_zero_advantage_groups():
    adv = np.array([[0.0, 0.0], [1.0, -1.0], [0.0, 0.0]])
    valid = np.ones((3, 2), bool)
    got = advantages.zero_advantage_groups(adv, valid, np.array([True, True, False]))
    np.testing.assert_array_equal(got, [True, False, False])


def test_equal_rewards_that_float32_cannot_hold_give_exact_zeros():
    for g in (7, 8, 16):
        for mixed in (False, True):
            got = advantages.group_advantages(np.full((1, g), 1.9, np.float32), np.ones((1, g), bool),
                                              np.array([mixed]), lam=0.0)
            assert np.all(np.asarray(got) == 0.0), (g, mixed)


def test_eq1_keeps_precision_for_rewards_a_few_ulps_apart():
    """All-correct group whose lengths differ by a token: R³ rewards near 2 differ by 1/32768."""
    lengths = np.array([100, 101, 101, 103, 100, 102, 101, 100])
    r64 = 1.0 + (1.0 - lengths / 32768.0)
    got = np.asarray(advantages.group_advantages(r64.astype(np.float32)[None], np.ones((1, 8), bool),
                                                 np.array([False]), eps=0.0))[0]
    want = (r64 - r64.mean()) / r64.std()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert abs(got.sum()) < 1e-4
