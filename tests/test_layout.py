"""The train step's layout: response widths and replay rows bucketed on the host (hand-computed buckets)."""

import jax.numpy as jnp
import numpy as np
import pytest

from r3jax.rl import algorithm, layout, replay
from r3jax.rl import batch as rl_batch


@pytest.mark.parametrize("longest, minimum, want", [(0, 64, 64), (1, 64, 64), (64, 64, 64), (65, 64, 128),
                                                    (300, 64, 512), (700, 64, 512 + 100), (5, 0, 612)])
def test_width_is_a_power_of_two_from_the_minimum_capped_at_the_budget(longest, minimum, want):
    assert layout.width_bucket(longest, 612, minimum) == want


@pytest.mark.parametrize("needed, want", [(0, 0), (1, 8), (8, 8), (9, 16), (16, 16), (17, 32), (32, 32)])
def test_replay_rows_are_a_quarter_a_half_or_all_of_the_slots_split_into_the_multiple(needed, want):
    # 32 on-policy rows, micro-batches x devices = 8, P·k = 32 slots: 0, 8, 16 or 32 rows
    assert layout.replay_bucket(needed, 32, 32, 8) == want


def test_replay_rows_fill_up_the_on_policy_rows_to_the_multiple():
    assert layout.replay_bucket(0, 30, 20, 4) == 2       # 30 + 2 splits into 4
    assert layout.replay_bucket(3, 30, 20, 4) == 6       # a quarter of 20 is 5, then 30 + 6
    assert layout.replay_bucket(9, 30, 20, 4) == 10      # a half
    assert layout.replay_bucket(11, 30, 20, 4) == 20     # all: P·(G + k) splits by the config's check
    with pytest.raises(ValueError, match="do not fit"):
        layout.replay_bucket(21, 30, 20, 4)


def batch(lengths, correct):
    """P = 4 groups of G = 2 responses of T = 16 columns with these lengths and verdicts."""
    lengths, correct = np.asarray(lengths), np.asarray(correct, bool)
    p, g = lengths.shape
    mask = np.arange(16) < lengths[..., None]
    z = jnp.zeros((p, g, 16))
    return rl_batch.RolloutBatch(qids=jnp.arange(p, dtype=jnp.int32), prompt_tokens=jnp.ones((p, 3), jnp.int32),
                                 prompt_mask=jnp.ones((p, 3), bool), tokens=jnp.asarray(mask, jnp.int32),
                                 mask=jnp.asarray(mask), logprobs=z, entropies=z, lengths=jnp.asarray(lengths),
                                 truncated=jnp.zeros((p, g), bool), correct=jnp.asarray(correct),
                                 rewards=jnp.asarray(correct, jnp.float32), group_valid=jnp.ones((p,), bool),
                                 is_reflection=jnp.zeros((p,), bool))


def test_choose_covers_the_longest_response_and_every_replayed_one():
    cfg = algorithm.algorithm_config("r3", max_response_tokens=16, bucket_min_width=2, num_micro_batches=2)
    buf = replay.init_buffer(4, 16)
    mixed = batch([[3, 2], [1, 3], [2, 2], [3, 3]], [[True, False]] * 4)
    assert layout.choose(cfg, buf, mixed) == layout.Layout(width=4, replay_rows=0)  # 3 -> 4; nothing collapsed
    # question 1 has a stored correct answer of 5 tokens and its group is all wrong: one replayed row, width 8
    buf = replay.insert(buf, [1], jnp.ones((1, 16), jnp.int32), [5], [True], [True], step=0)
    verdicts = [[True, False], [False, False], [True, True], [True, False]]
    collapsed = batch([[3, 2], [1, 3], [2, 2], [3, 3]], verdicts)
    # 5 -> 8 columns; 1 replayed row, rounded up to a quarter of P·k = 8 slots: 8 + 2 rows split in 2; the 2
    # replay rows apart, so the 8 on-policy rows train in micro-batches of whole groups
    assert layout.choose(cfg, buf, collapsed) == layout.Layout(width=8, replay_rows=2, replay_apart=True)
    off = algorithm.algorithm_config("r3", max_response_tokens=16, bucket_min_width=0, bucket_replay=False)
    assert layout.choose(off, buf, collapsed) == layout.full(off, collapsed) == layout.Layout(16, 8)
    grpo = algorithm.algorithm_config("grpo", max_response_tokens=16, bucket_min_width=2)
    assert layout.choose(grpo, None, collapsed) == layout.Layout(width=4, replay_rows=0)
