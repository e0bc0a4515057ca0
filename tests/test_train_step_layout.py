"""The train step's layouts (`r3jax/rl/layout.py`): every cut of the padded loss, the same step.

Bucketed columns and replay rows, rows that share a prompt, empty reflection slots left out, and the plain
questions' rows trained apart at their own prompt width: each against the padded (or one-segment) step, in
params, metrics and buffer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train_step import TP, G, P, T, V, make_batch, setup

from r3jax.model import sharding
from r3jax.rl import algorithm, layout, replay, train_step


def short_batch(correct, longest, truncated):
    """`make_batch` with every response cut to at most `longest` of the T tokens."""
    b = make_batch(correct, truncated=truncated)
    lengths = jnp.minimum(b.lengths, longest)
    mask = jnp.arange(T) < lengths[..., None]
    return dataclasses.replace(b, lengths=lengths, mask=mask, tokens=b.tokens * mask, logprobs=b.logprobs * mask,
                               entropies=b.entropies * mask)


def with_three_stored(state):
    """Two correct answers of question 0 (2 and 4 tokens) and one wrong of question 1 (3 tokens) in the buffer."""
    rng = np.random.RandomState(5)
    stored = replay.insert(state.buffer, jnp.array([0, 0, 1]), jnp.asarray(rng.randint(1, V, (3, T)), jnp.int32),
                           jnp.array([2, 4, 3]), jnp.array([True, True, False]), jnp.ones((3,), bool), 0)
    return dataclasses.replace(state, buffer=stored)


def assert_same_step(got, got_metrics, want, want_metrics):
    """Same params (1e-6), metrics and buffer (exactly: full-width rows, whatever the layout)."""
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)
    assert got_metrics.keys() == want_metrics.keys()
    for k in want_metrics:
        np.testing.assert_allclose(got_metrics[k], want_metrics[k], atol=1e-6, rtol=1e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(got.buffer), jax.tree.leaves(want.buffer), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name, stored", [("r3", True), ("r3", False), ("grpo", False)],
                         ids=["r3_replaying", "r3_nothing_stored", "grpo"])
def test_the_bucketed_layout_trains_like_the_padded_one(name, stored):
    """Responses of at most 3 of T = 6 tokens; groups 0 and 3 all wrong, 1 all correct, 2 mixed; stored: two
    correct answers of question 0 (2 and 4 tokens), one wrong of question 1 (3 tokens). R³ replays 3 responses,
    so its step runs on W = 4 columns and R = 4 replay rows (not P·k = 8); with nothing stored, on no replay
    rows; GRPO's on 4 columns. Same params, metrics and buffer as the padded step."""
    truncated = np.zeros((P, G), bool)
    truncated[3] = True  # SERR ranks group 3 on its entropies, read in W columns
    batch = short_batch([[False, False], [True, True], [True, False], [False, False]], 3, truncated)
    cfg, tx, graphdef, state = setup(name, sgd=True, bucket_min_width=2)
    if stored:
        state = with_three_stored(state)
    chosen = layout.choose(cfg, state.buffer, batch)
    assert chosen == layout.Layout(width=4, replay_rows=4 if stored else 0, replay_apart=stored)
    step = train_step.make_train_step(graphdef, cfg, tx, state, batch)
    padded, padded_m = step(jax.tree.map(jnp.copy, state), batch)
    bucketed, bucketed_m = step(state, batch, chosen)
    if name == "r3":
        assert float(padded_m["r3/ccr_appended"]) == (3.0 if stored else 0.0)
        assert float(padded_m["r3/serr_scored"]) == G
    assert_same_step(bucketed, bucketed_m, padded, padded_m)


@pytest.mark.parametrize("name, micro, beta", [("r3", 1, 0.0), ("r3", 2, 0.04), ("grpo", 1, 0.0)])
def test_rows_sharing_their_prompt_train_like_rows_that_each_run_it(name, micro, beta):
    """`rl.share_prompts`: each micro-batch runs each of its prompts once (a group's G rows, and the replay
    rows of the same question, read it), in the policy's pass and the reference's (beta > 0). R³ here replays
    3 stored responses into groups 0 and 1, so replay rows share prompts with on-policy rows; GRPO's rows are
    whole groups, which attention reads group by group. Same params, metrics and buffer as with share_prompts
    off."""
    batch = make_batch([[False, False], [True, True], [True, False], [False, False]])
    steps = {}
    for share in (True, False):
        cfg, tx, graphdef, state = setup(name, sgd=True, num_micro_batches=micro, share_prompts=share, beta=beta)
        if name == "r3":
            state = with_three_stored(state)
        # the replay rows among the on-policy ones (in a segment of their own: `test_replay_rows_train_apart...`)
        chosen = dataclasses.replace(layout.choose(cfg, state.buffer, batch), replay_apart=False)
        shared = train_step.shared_prompts(cfg, train_step.segments(cfg, batch, chosen)[0])
        assert (shared is not None) == share
        if share:  # GRPO's rows are whole groups in order: read by group; R³'s replay rows break the order
            assert shared[2] == (G if name == "grpo" else 0)
        steps[share] = train_step.make_train_step(graphdef, cfg, tx, state, batch)(state, batch, chosen)
    (shared, shared_m), (own, own_m) = steps[True], steps[False]
    if name == "r3":
        assert float(own_m["r3/ccr_appended"]) == 3.0
    assert_same_step(shared, shared_m, own, own_m)


def slot_batch():
    """`make_batch` whose last group is a reflection slot ISR left empty (invalid, no response) and whose
    prompts hold at most 2 real tokens of TP = 4 (left-padded)."""
    b = make_batch([[True, False], [False, False], [True, True], [False, False]])
    empty = jnp.arange(P) == P - 1
    lengths = jnp.where(empty[:, None], 0, b.lengths)
    mask = jnp.arange(T) < lengths[..., None]
    return dataclasses.replace(b, prompt_mask=b.prompt_mask.at[:, :2].set(False), lengths=lengths, mask=mask,
                               tokens=b.tokens * mask, logprobs=b.logprobs * mask, entropies=b.entropies * mask,
                               correct=b.correct & ~empty[:, None], rewards=jnp.where(empty[:, None], 0.0, b.rewards),
                               group_valid=~empty, is_reflection=empty)


@pytest.mark.parametrize("name", ["r3", "grpo"])
def test_empty_reflection_slots_and_prompt_padding_leave_the_loss_unchanged(name):
    """The layout leaves out the trailing empty reflection group and the prompts' padding columns: 3 groups of
    rows, 2 prompt columns. Same params, metrics and buffer as the padded step."""
    batch = slot_batch()
    cfg, tx, graphdef, state = setup(name, sgd=True, bucket_min_width=2)
    chosen = layout.choose(cfg, state.buffer, batch)
    assert (chosen.groups, chosen.prompt_width) == (P - 1, 2)
    step = train_step.make_train_step(graphdef, cfg, tx, state, batch)
    padded, padded_m = step(jax.tree.map(jnp.copy, state), batch)
    cut, cut_m = step(state, batch, chosen)
    assert_same_step(cut, cut_m, padded, padded_m)


def test_empty_reflection_slots_stay_when_their_rows_would_not_split():
    cfg = algorithm.algorithm_config("grpo", max_response_tokens=T, num_micro_batches=4)  # 3 groups: 6 rows
    assert layout.choose(cfg, None, slot_batch()).groups is None
    off = algorithm.algorithm_config("r3", max_response_tokens=T, bucket_min_width=0, bucket_replay=False)
    assert layout.choose(off, replay.init_buffer(P, T), slot_batch()) == layout.full(off, slot_batch())


def reflection_batch():
    """`make_batch` whose last two groups are reflection prompts of all TP = 4 columns (reflecting on questions
    0 and 1) after two plain questions of 2 real tokens each; groups 0 and 3 all wrong, 1 all correct."""
    b = make_batch([[False, False], [True, True], [True, False], [False, False]])
    reflection = jnp.arange(P) >= 2
    return dataclasses.replace(b, qids=jnp.array([0, 1, 0, 1], jnp.int32), is_reflection=reflection,
                               prompt_mask=b.prompt_mask.at[:, :2].set(reflection[:, None]))


@pytest.mark.parametrize("name, micro, beta, share", [("r3", 2, 0.04, True), ("r3", 1, 0.0, False),
                                                      ("grpo", 1, 0.0, True)])
def test_plain_rows_train_at_their_own_prompt_width_like_all_rows_together(name, micro, beta, share):
    """The plain questions' rows train in a segment of their own at their 2 prompt columns, the reflection and
    replay rows at all 4: same params, metrics and buffer as all rows in one segment at 4 columns."""
    batch = reflection_batch()
    cfg, tx, graphdef, state = setup(name, sgd=True, num_micro_batches=micro, beta=beta, share_prompts=share,
                                     bucket_min_width=1)
    if name == "r3":
        state = with_three_stored(state)
    chosen = layout.choose(cfg, state.buffer, batch)
    assert (chosen.narrow_groups, chosen.narrow_prompt_width, chosen.prompt_width) == (2, 2, None)
    chosen = dataclasses.replace(chosen, replay_apart=False)  # replay rows apart: the next test
    segs = train_step.segments(cfg, batch, chosen)
    assert [(s.rows, s.prompt_width) for s in segs] == [(2 * G, 2), (2 * G + chosen.replay_rows, TP)]
    step = train_step.make_train_step(graphdef, cfg, tx, state, batch)
    together, together_m = step(jax.tree.map(jnp.copy, state), batch, dataclasses.replace(chosen, narrow_groups=0))
    apart, apart_m = step(state, batch, chosen)
    if name == "r3":
        assert float(apart_m["r3/ccr_appended"]) == 3.0
    assert_same_step(apart, apart_m, together, together_m)


@pytest.mark.parametrize("name, micro, beta, reflection", [("r3", 1, 0.0, False), ("r3", 2, 0.04, False),
                                                           ("r3", 1, 0.0, True), ("r3", 2, 0.04, True)])
def test_replay_rows_train_apart_like_rows_that_join_the_on_policy_ones(name, micro, beta, reflection):
    """CCR's replay rows in a segment of their own, after the on-policy rows, which then read their prompts group
    by group: same params, metrics and buffer as the replay rows in the on-policy rows' last segment. Plain
    questions only (one on-policy segment), and with reflection groups (narrow plain rows, the reflection
    groups' rows, the replay rows)."""
    batch = reflection_batch() if reflection else short_batch(
        [[False, False], [True, True], [True, False], [False, False]], 3, np.zeros((P, G), bool))
    cfg, tx, graphdef, state = setup(name, sgd=True, num_micro_batches=micro, beta=beta, bucket_min_width=1)
    state = with_three_stored(state)
    chosen = layout.choose(cfg, state.buffer, batch)
    assert chosen.replay_apart and chosen.replay_rows == 4
    segs = train_step.segments(cfg, batch, chosen)
    on_policy = [(2 * G, 2), (2 * G, TP)] if reflection else [(P * G, TP)]
    assert [(s.rows, s.prompt_width) for s in segs] == on_policy + [(4, TP)]
    assert [s.group_rows for s in segs] == [G] * len(on_policy) + [0]
    joined = dataclasses.replace(chosen, replay_apart=False)
    assert train_step.segments(cfg, batch, joined)[-1].group_rows == 0  # a replay row among them: row by row
    step = train_step.make_train_step(graphdef, cfg, tx, state, batch)
    together, together_m = step(jax.tree.map(jnp.copy, state), batch, joined)
    apart, apart_m = step(state, batch, chosen)
    assert float(apart_m["r3/ccr_appended"]) == 3.0
    assert_same_step(apart, apart_m, together, together_m)


def test_replay_rows_stay_with_the_on_policy_rows_where_apart_gains_nothing_or_would_not_split():
    """Without shared prompts no row reads its prompt by group, so the replay rows stay; with micro-batches of 3
    of the 8 + 4 rows (4 micro-batches), the on-policy rows would not split into whole micro-batches; on 8 batch
    devices each holds one row of a group of 2. On one device, and on 2 (whole groups each), apart."""
    batch = short_batch([[False, False], [True, True], [True, False], [False, False]], 3, np.zeros((P, G), bool))
    mesh = lambda n: sharding.make_mesh(data=n, fsdp=1, tensor=1, devices=jax.devices()[:n])  # noqa: E731
    stored = with_three_stored(setup("r3")[3]).buffer
    for kw, devices in ((dict(share_prompts=False), 1), (dict(num_micro_batches=4), 1), ({}, 8)):
        cfg = algorithm.algorithm_config("r3", max_response_tokens=T, bucket_min_width=1, **kw)
        chosen = layout.choose(cfg, stored, batch, mesh(devices))
        assert chosen.replay_rows == (4 if devices == 1 else 8) and not chosen.replay_apart, (kw, devices)
    cfg = algorithm.algorithm_config("r3", max_response_tokens=T, bucket_min_width=1)
    assert layout.choose(cfg, stored, batch).replay_apart
    assert layout.choose(cfg, stored, batch, mesh(2)).replay_apart


@pytest.mark.parametrize("name", ["grpo", "r3"])
def test_on_a_mesh_that_splits_the_rows_whole_groups_per_device_share_their_prompt(name):
    """Rows split over 2 batch devices, 2 groups of 2 rows on each: the on-policy rows read their prompts group
    by group (R³'s replay rows in a segment of their own, row by row, without sharing). Same params, metrics and
    buffer as with share_prompts off."""
    from r3jax.rl import batch as rl_batch

    mesh = sharding.make_mesh(data=2, fsdp=1, tensor=1, devices=jax.devices()[:2])
    batch = short_batch([[False, False], [True, True], [True, False], [False, False]], 3, np.zeros((P, G), bool))
    steps = {}
    for share in (True, False):
        cfg, tx, graphdef, state = setup(name, mesh, sgd=True, bucket_min_width=1, share_prompts=share)
        if name == "r3":
            state = with_three_stored(state)
        chosen = layout.choose(cfg, state.buffer, batch, mesh)
        on_policy = train_step.segments(cfg, batch, chosen)[0]
        assert (train_step.shared_prompts(cfg, on_policy, 2) is not None) == share
        placed = jax.device_put(batch, rl_batch.batch_shardings(batch, mesh))
        steps[share] = train_step.make_train_step(graphdef, cfg, tx, state, placed, mesh)(state, placed, chosen)
    (shared, shared_m), (own, own_m) = steps[True], steps[False]
    assert_same_step(shared, shared_m, own, own_m)


def test_a_narrow_segment_is_left_out_when_its_rows_would_not_split():
    """Four micro-batches of the 8 + 4 rows hold 3 rows each: the 8 reflection and replay rows would not split
    into 3 micro-batches."""
    cfg = algorithm.algorithm_config("r3", max_response_tokens=T, num_micro_batches=4, bucket_min_width=1)
    chosen = layout.choose(cfg, with_three_stored(setup("r3")[3]).buffer, reflection_batch())
    assert chosen.replay_rows == 4 and chosen.narrow_groups == 0
    bad = dataclasses.replace(chosen, narrow_groups=2, narrow_prompt_width=2)
    with pytest.raises(ValueError, match="8 loss rows from row 4 is not divisible into its 3 micro-batches"):
        train_step._check_shapes(cfg, setup("r3")[3], reflection_batch(), bad)
