"""SERR (R3-SPEC §6) on hand-computed groups: entropy features, dominance counts, ranking rewards, scope."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from r3jax.rl import serr

# The worked group: 4 wrong, truncated responses, T = 10, p = 0.2, r_max = 0.5.
#
#   resp  L   k = max(1, floor(0.2 L))  H_t (real tokens)                       E_peak            E_glob
#   A     5   1                         .25 0 2 .25 0                           2                 2.5 / 5  = .5
#   B     10  2                         .5 1.75 .5 .75 .5 .5 1.25 .5 .75 .5    (1.75+1.25)/2=1.5  7.5 / 10 = .75
#   C     4   1                         1 1 1 1                                 1                 4 / 4    = 1
#   D     9   1                         1.5 1.5 0 1.5 3 1.5 1.5 1.5 1.5         3                 13.5 / 9 = 1.5
#
# i ≻ j iff E_peak_i > E_peak_j and E_glob_i < E_glob_j:
#   A ≻ B (2 > 1.5, .5 < .75), A ≻ C (2 > 1, .5 < 1), B ≻ C (1.5 > 1, .75 < 1);
#   D has the highest E_peak (nobody beats it) and the highest E_glob (it beats nobody).
#   S = [2, 1, 0, 0]: A at position 0, B at 1, C and D tie at 2 and 3.
# rewards, n = 4: A .5·(1 - 0/3) = .5, B .5·(1 - 1/3) = 1/3, C = D = .5·(1 - 2.5/3) = 1/12.
WORKED = [[.25, 0, 2, .25, 0],
          [.5, 1.75, .5, .75, .5, .5, 1.25, .5, .75, .5],
          [1, 1, 1, 1],
          [1.5, 1.5, 0, 1.5, 3, 1.5, 1.5, 1.5, 1.5]]
WORKED_PEAK = [2, 1.5, 1, 3]
WORKED_GLOB = [.5, .75, 1, 1.5]
WORKED_S = [2, 1, 0, 0]
WORKED_REWARDS = [.5, 1 / 3, 1 / 12, 1 / 12]

# Op-by-op dispatch compiles every primitive for every new shape; one jit per shape is several times faster.
# Only test_jit_matches_eager runs the functions op by op.
serr_rewards = jax.jit(serr.serr_rewards, static_argnames=("p", "r_max", "scope"))
entropy_features = jax.jit(serr.entropy_features, static_argnames="p")
dominance_counts = jax.jit(serr.dominance_counts)
rank_rewards = jax.jit(serr.rank_rewards)


def padded(rows, t=10, fill=0.0):
    """[N, T] entropies and mask from ragged rows of real-token entropies."""
    ent = np.full((len(rows), t), fill, np.float32)
    mask = np.zeros((len(rows), t), bool)
    for i, row in enumerate(rows):
        ent[i, :len(row)], mask[i, :len(row)] = row, True
    return ent, mask


def one_group(rows, correct=None, truncated=None, valid=None, t=10, fill=0.0, **kwargs):
    """serr_rewards on a single group (P = 1); returns numpy [G] rewards and scored."""
    ent, mask = padded(rows, t, fill)
    g = len(rows)
    correct = np.zeros(g, bool) if correct is None else np.asarray(correct, bool)
    truncated = np.ones(g, bool) if truncated is None else np.asarray(truncated, bool)
    valid = None if valid is None else np.asarray(valid, bool)[None]
    rewards, scored = serr_rewards(ent[None], mask[None], correct[None], truncated[None], valid, **kwargs)
    return np.asarray(rewards)[0], np.asarray(scored)[0]


def test_worked_group_entropy_features():
    e_peak, e_glob = entropy_features(*map(jnp.asarray, padded(WORKED)), p=0.2)
    np.testing.assert_allclose(np.asarray(e_peak), WORKED_PEAK, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(e_glob), WORKED_GLOB, rtol=1e-6)


def test_worked_group_dominance_counts():
    s = dominance_counts(jnp.asarray(WORKED_PEAK), jnp.asarray(WORKED_GLOB), jnp.ones(4, bool))
    np.testing.assert_array_equal(np.asarray(s), WORKED_S)


def test_worked_group_rewards_end_to_end():
    rewards, scored = one_group(WORKED)
    np.testing.assert_allclose(rewards, WORKED_REWARDS, rtol=1e-6)
    np.testing.assert_array_equal(scored, [True] * 4)


def test_dominance_needs_both_inequalities_strict():
    # 0 vs 1: equal E_peak; 2 vs 1: equal E_glob; 2 vs 0: higher peak but higher glob. Nobody dominates.
    s = dominance_counts(jnp.asarray([1.0, 1.0, 2.0]), jnp.asarray([.5, 1.0, 1.0]), jnp.ones(3, bool))
    np.testing.assert_array_equal(np.asarray(s), [0, 0, 0])


def test_dominance_ignores_out_of_scope_on_both_sides():
    # Worked features with B out of scope: A ≻ C only (A ≻ B no longer counts), B itself scores 0.
    s = dominance_counts(jnp.asarray(WORKED_PEAK), jnp.asarray(WORKED_GLOB), jnp.asarray([1, 0, 1, 1], bool))
    np.testing.assert_array_equal(np.asarray(s), [1, 0, 0, 0])


def test_ties_share_the_mean_of_their_positions():
    # positions: 0 | 1, 2 tied | 3 -> .5, .5·(1 - 1.5/3) = .25 twice, 0
    rewards = rank_rewards(jnp.asarray([3, 1, 1, 0]), jnp.ones(4, bool), r_max=0.5)
    np.testing.assert_allclose(np.asarray(rewards), [.5, .25, .25, 0], rtol=1e-6)


def test_identical_responses_all_get_half_r_max():
    # The degenerate all-equal group: S = 0 for all, one tie over positions 0..2, mean position 1 of 2.
    rewards, scored = one_group([[1, 2, 3]] * 3, r_max=0.5)
    np.testing.assert_allclose(rewards, [.25] * 3, rtol=1e-6)
    assert scored.all()


def sorted_rank_rewards(s, in_scope, r_max):
    """The definition, literally: sort by S descending, reward each position, average over ties."""
    idx = np.flatnonzero(in_scope)
    out = np.zeros(len(s))
    if len(idx) < 2:
        return out
    order = idx[np.argsort(-s[idx], kind="stable")]
    position_reward = r_max * (1 - np.arange(len(idx)) / (len(idx) - 1))
    for i in idx:
        out[i] = position_reward[s[order] == s[i]].mean()
    return out


def test_rank_rewards_match_the_sort_definition():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 4, size=(200, 7))
    in_scope = rng.random((200, 7)) < 0.7
    got = np.asarray(rank_rewards(jnp.asarray(s), jnp.asarray(in_scope), r_max=0.5))
    want = np.stack([sorted_rank_rewards(si, mi, 0.5) for si, mi in zip(s, in_scope, strict=True)])
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert (got >= 0).all()


def test_a_lone_in_scope_response_is_scored_with_zero():
    rewards, scored = one_group(WORKED, truncated=[False, False, True, False])
    np.testing.assert_array_equal(rewards, [0, 0, 0, 0])
    np.testing.assert_array_equal(scored, [False, False, True, False])


def test_no_response_in_scope_scores_nothing():
    rewards, scored = one_group(WORKED, truncated=[False] * 4)
    np.testing.assert_array_equal(rewards, [0, 0, 0, 0])
    assert not scored.any()


def test_scope_truncated_leaves_wrong_finished_responses_at_zero():
    # A and B finished wrong; C (peak 1, glob 1) and D (peak 3, glob 1.5) are incomparable: S = 0, 0.
    rewards, scored = one_group(WORKED, truncated=[False, False, True, True], scope="truncated")
    np.testing.assert_allclose(rewards, [0, 0, .25, .25], rtol=1e-6)
    np.testing.assert_array_equal(scored, [False, False, True, True])


def test_scope_failed_ranks_every_wrong_response():
    rewards, scored = one_group(WORKED, truncated=[False, False, True, True], scope="failed")
    np.testing.assert_allclose(rewards, WORKED_REWARDS, rtol=1e-6)
    assert scored.all()


@pytest.mark.parametrize("scope", serr.SCOPES)
@pytest.mark.parametrize("correct_truncated", [False, True])
def test_never_fires_in_a_group_with_a_correct_response(scope, correct_truncated):
    truncated = [True, True, True, correct_truncated]
    rewards, scored = one_group(WORKED, correct=[False, False, False, True], truncated=truncated, scope=scope)
    np.testing.assert_array_equal(rewards, [0, 0, 0, 0])
    assert not scored.any()


def test_padding_tokens_beyond_the_mask_change_nothing():
    # Padding above every real entropy would take over E_peak and move E_glob if it leaked in.
    rewards, scored = one_group(WORKED, t=16, fill=9.0)
    np.testing.assert_allclose(rewards, WORKED_REWARDS, rtol=1e-6)
    assert scored.all()
    e_peak, e_glob = entropy_features(*map(jnp.asarray, padded(WORKED, t=16, fill=np.nan)), p=0.2)
    np.testing.assert_allclose(np.asarray(e_peak), WORKED_PEAK, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(e_glob), WORKED_GLOB, rtol=1e-6)


def test_padded_slots_change_nothing():
    # Slot 1 (L = 9, k = 1: peak 3.5, glob 3.5 / 9 < .5) would dominate all four, and slot 3 is correct,
    # which would stop SERR: both are padding.
    rows = [WORKED[0], [3.5, 0, 0, 0, 0, 0, 0, 0, 0], WORKED[1], [1, 1], WORKED[2], WORKED[3]]
    valid = [True, False, True, False, True, True]
    rewards, scored = one_group(rows, correct=[0, 0, 0, 1, 0, 0], valid=valid)
    np.testing.assert_allclose(rewards[np.asarray(valid)], WORKED_REWARDS, rtol=1e-6)
    np.testing.assert_array_equal(rewards[~np.asarray(valid)], [0, 0])
    np.testing.assert_array_equal(scored, valid)


def test_an_empty_response_has_zero_features_and_is_never_ranked():
    e_peak, e_glob = entropy_features(*map(jnp.asarray, padded([[], [2.0]], t=4, fill=7.0)), p=0.2)
    np.testing.assert_array_equal(np.asarray(e_peak), [0, 2])
    np.testing.assert_array_equal(np.asarray(e_glob), [0, 2])
    rewards, scored = one_group([[], WORKED[0], WORKED[1]])
    np.testing.assert_array_equal(scored, [False, True, True])
    np.testing.assert_allclose(rewards, [0, .5, 0], rtol=1e-6)


@pytest.mark.parametrize(("p", "length", "k"), [
    (0.2, 1, 1), (0.2, 4, 1), (0.2, 5, 1), (0.2, 9, 1), (0.2, 10, 2), (0.2, 14, 2), (0.2, 15, 3),
    (0.53, 100, 53), (0.21, 300, 63), (0.71, 5700, 4047),  # floor(p · L) in float32 gives 52, 62, 4046
    (0.3, 10, 3), (0.7, 32760, 22932), (np.float32(0.53), 100, 53), (1.0, 7, 7), (1.0, 1, 1),
    (0.01, 99, 1), (0.01, 100, 1), (0.01, 200, 2),
])
def test_peak_counts_are_exact_at_floor_boundaries(p, length, k):
    assert int(serr.peak_counts(jnp.asarray(length), p)) == k


@pytest.mark.parametrize(("length", "k"), [(1, 1), (4, 1), (5, 1), (9, 1), (10, 2)])
def test_e_peak_averages_exactly_k_tokens(length, k):
    # Entropies length, length-1, ..., 1: the k largest average to length - (k - 1) / 2.
    rows = [list(range(length, 0, -1))]
    e_peak, _ = entropy_features(*map(jnp.asarray, padded(rows, t=12, fill=50.0)), p=0.2)
    np.testing.assert_allclose(np.asarray(e_peak), [length - (k - 1) / 2], rtol=1e-6)


def batch_of_groups():
    """Three groups of G = 4, T = 10: the worked group; D C B A with B correct (no SERR); B D A C with D
    finished and A padded, leaving B (1.5, .75) ≻ C (1, 1) in scope: n = 2, rewards .5 and 0."""
    ent, mask = padded(WORKED)
    ent = np.stack([ent, ent[::-1], ent[[1, 3, 0, 2]]])  # [P, G, T]
    mask = np.stack([mask, mask[::-1], mask[[1, 3, 0, 2]]])
    correct = np.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]], bool)
    truncated = np.array([[1, 1, 1, 1], [1, 0, 1, 1], [1, 0, 1, 1]], bool)
    valid = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 1]], bool)
    return ent, mask, correct, truncated, valid


def test_jit_matches_eager():
    args = batch_of_groups()
    fn = functools.partial(serr.serr_rewards, p=0.2, r_max=0.5, scope="truncated")
    (rewards, scored), (eager_rewards, eager_scored) = jax.jit(fn)(*args), fn(*args)
    np.testing.assert_allclose(np.asarray(rewards), np.asarray(eager_rewards), rtol=1e-6)  # fusion may round apart
    np.testing.assert_array_equal(np.asarray(scored), np.asarray(eager_scored))


def test_a_batch_of_groups_equals_each_group_alone():
    args = batch_of_groups()
    rewards, scored = serr_rewards(*args)
    for g in range(args[0].shape[0]):
        alone = serr_rewards(*(a[g:g + 1] for a in args))
        np.testing.assert_array_equal(np.asarray(rewards)[g], np.asarray(alone[0])[0])
        np.testing.assert_array_equal(np.asarray(scored)[g], np.asarray(alone[1])[0])
    vmapped = jax.jit(jax.vmap(lambda *group: serr.serr_rewards(*(x[None] for x in group))))(*args)
    np.testing.assert_allclose(np.asarray(vmapped[0])[:, 0], np.asarray(rewards), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(vmapped[1])[:, 0], np.asarray(scored))
    np.testing.assert_allclose(np.asarray(rewards), [WORKED_REWARDS, [0, 0, 0, 0], [.5, 0, 0, 0]], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(scored), [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1]])


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"p": 0.0}, "p"), ({"p": 1.5}, "p"), ({"p": -0.2}, "p"), ({"p": True}, "p"), ({"p": "0.2"}, "p"),
    ({"r_max": -0.1}, "r_max"), ({"r_max": float("nan")}, "r_max"), ({"r_max": float("inf")}, "r_max"),
    ({"scope": "all"}, "scope"), ({"scope": None}, "scope"),
])
def test_bad_config_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        serr.SERRConfig(**kwargs)
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        serr.serr_rewards(*batch_of_groups(), **kwargs)


def test_mismatched_shapes_raise():
    ent, mask, correct, truncated, valid = batch_of_groups()
    with pytest.raises(ValueError, match=r"\[P, G, T\]"):
        serr.serr_rewards(ent, mask, correct[:, :3], truncated, valid)
