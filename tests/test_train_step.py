"""The whole R³ step: sharded = single device, stable shardings, one compilation, and collapse repaired."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from r3jax.model import config, qwen2, sharding
from r3jax.rl import algorithm, loss, replay, train_step
from r3jax.rl import batch as rl_batch

P, G, TP, T, V = 4, 2, 4, 6, 64


def tiny(mesh=None):
    return qwen2.init_model(config.tiny(vocab_size=V, hidden_size=32, intermediate_size=64), seed=0, mesh=mesh)


def make_batch(correct, *, truncated=None, seed=0):
    """P groups of G responses with given correctness; lengths 3..6, entropies random."""
    rng = np.random.RandomState(seed)
    lengths = rng.randint(3, T + 1, (P, G))
    mask = np.arange(T) < lengths[..., None]
    correct = np.asarray(correct, bool)
    truncated = lengths == T if truncated is None else np.asarray(truncated, bool)
    prompt_mask = np.ones((P, TP), bool)
    prompt_mask[0, :2] = False  # one left-padded prompt
    return rl_batch.RolloutBatch(
        qids=jnp.arange(P, dtype=jnp.int32), prompt_tokens=jnp.asarray(rng.randint(0, V, (P, TP)), jnp.int32),
        prompt_mask=jnp.asarray(prompt_mask), tokens=jnp.asarray(rng.randint(0, V, (P, G, T)) * mask, jnp.int32),
        mask=jnp.asarray(mask), logprobs=jnp.asarray(-rng.rand(P, G, T) * mask, jnp.float32),
        entropies=jnp.asarray(rng.rand(P, G, T) * 3 * mask, jnp.float32), lengths=jnp.asarray(lengths, jnp.int32),
        truncated=jnp.asarray(truncated), correct=jnp.asarray(correct),
        rewards=jnp.asarray(np.where(correct, 1.5, 0.0), jnp.float32), group_valid=jnp.ones((P,), bool),
        is_reflection=jnp.zeros((P,), bool))


def setup(name, mesh=None, sgd=False, **overrides):
    overrides = {"num_micro_batches": 2, **overrides}
    cfg = algorithm.algorithm_config(name, max_response_tokens=T, learning_rate=1e-2, weight_decay=0.0,
                                     chunk_size=4, **overrides)
    tx = loss.make_optimizer(cfg.learning_rate, warmup_steps=0, weight_decay=cfg.weight_decay)
    if sgd:  # Adam's first step is about lr * sign(g): it blows fp32 noise in tiny gradients up to lr
        tx = optax.sgd(cfg.learning_rate)
    graphdef, params = qwen2.split_params(tiny(mesh))
    state = train_step.init_train_state(params, cfg, tx, num_questions=8, seed=0, mesh=mesh)
    return cfg, tx, graphdef, state


MIXED = [[True, False], [False, False], [True, True], [False, True]]


def test_sharded_step_equals_single_device_and_keeps_shardings():
    batch = make_batch(MIXED)
    cfg, tx, graphdef, state = setup("r3", sgd=True)
    step = train_step.make_train_step(graphdef, cfg, tx, state, batch)
    single, single_metrics = step(state, batch)

    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    cfg, tx, graphdef, state = setup("r3", mesh, sgd=True)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step = train_step.make_train_step(graphdef, cfg, tx, state, batch, mesh)
    placed = jax.device_put(batch, rl_batch.batch_shardings(batch, mesh))
    sharded, sharded_metrics = step(state, placed)

    for a, b in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(single.params), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    for k in single_metrics:
        np.testing.assert_allclose(sharded_metrics[k], single_metrics[k], atol=1e-5, rtol=1e-4, err_msg=k)
    for got, want in zip(jax.tree.leaves(jax.tree.map(lambda x: x.sharding, sharded)), jax.tree.leaves(shardings),
                         strict=True):
        assert got == want
    assert any(not s.is_fully_replicated for s in jax.tree.leaves(shardings))  # really split


@pytest.fixture(scope="module")
def r3_run():
    """One compiled R³ step on a batch with every kind of group: (step fn, state after, metrics)."""
    cfg, tx, graphdef, state = setup("r3")
    batch = make_batch(MIXED)
    step = train_step.make_train_step(graphdef, cfg, tx, state, batch)
    new, metrics = step(state, batch)
    return step, new, metrics


def test_no_recompilation_on_later_calls(r3_run):
    step, state, _ = r3_run
    state = jax.tree.map(jnp.copy, state)  # the step donates its input; keep the fixture's
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration"
        else None)
    for seed in (1, 2):
        state, _ = step(state, make_batch(MIXED, seed=seed))
    assert compiles == []
    assert int(state.step) == 3


def _changed(before, after):
    return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after),
                                                              strict=True))


def test_collapsed_batch_grpo_learns_nothing_r3_does():
    """Every group all wrong or all right: GRPO's advantages are all 0; R³ replays stored answers into them."""
    collapsed = [[False, False], [True, True], [False, False], [True, True]]
    batch = make_batch(collapsed, truncated=np.zeros((P, G), bool))

    cfg, tx, graphdef, state = setup("grpo")
    before = jax.tree.map(jnp.copy, state.params)  # the step donates the state
    new, m = train_step.make_train_step(graphdef, cfg, tx, state, batch)(state, batch)
    assert _changed(before, new.params) == 0.0
    assert float(m["r3/zero_adv_frac_after"]) == 1.0

    cfg, tx, graphdef, state = setup("r3")
    rng = np.random.RandomState(3)
    stored = replay.insert(state.buffer, jnp.arange(P), jnp.asarray(rng.randint(0, V, (P, T)), jnp.int32),
                           jnp.full((P,), 4), jnp.array([True, False, True, False]), jnp.ones((P,), bool), 0)
    state = dataclasses.replace(state, buffer=stored)
    before = jax.tree.map(jnp.copy, state.params)
    new, m = train_step.make_train_step(graphdef, cfg, tx, state, batch)(state, batch)
    assert _changed(before, new.params) > 0.0
    assert float(m["r3/zero_adv_frac_before"]) == 1.0
    assert float(m["r3/zero_adv_frac_after"]) == 0.0
    assert float(m["r3/ccr_appended"]) == 4.0  # one stored response of the opposite kind for each group


def test_ranking_alone_repairs_truncated_failures():
    batch = make_batch([[False, False]] * P, truncated=np.ones((P, G), bool))
    cfg, tx, graphdef, state = setup("r3", r3=dict(replay=False, reflection=False))
    new, m = train_step.make_train_step(graphdef, cfg, tx, state, batch)(state, batch)
    assert float(m["r3/serr_scored"]) == P * G
    assert float(m["r3/zero_adv_frac_after"]) < 1.0


def test_buffer_and_counters_are_updated(r3_run):
    _, new, _ = r3_run
    np.testing.assert_array_equal(new.buffer.attempts[:P], [G] * P)
    np.testing.assert_array_equal(new.buffer.corrects[:P], np.sum(MIXED, axis=1))
    np.testing.assert_array_equal(new.buffer.correct.filled[2], [True, True])


def test_metrics(r3_run):
    _, _, m = r3_run
    assert float(m["groups/solve_all_frac"]) == 0.25
    assert float(m["groups/solve_none_frac"]) == 0.25
    assert float(m["groups/mixed_frac"]) == 0.5
    assert float(m["reward/accuracy"]) == 0.5
    for key in ("policy/clipfrac", "policy/kl", "policy/grad_norm", "policy/logprob_mismatch", "rollout/entropy_mean",
                "rollout/truncated_frac", "r3/isr_prompts", "r3/isr_accuracy"):
        assert np.isfinite(float(m[key])), key
    assert float(m["policy/logprob_mismatch"]) > 0  # the fake sampler log-probs differ from the model's


@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_baselines_build_no_buffer(name):
    cfg, tx, graphdef, state = setup(name)
    assert state.buffer is None and state.ref_params is None
    assert cfg.algorithm == name


def test_reflection_answers_are_replayed_into_the_plain_question(r3_run):
    """A correct answer from a reflection group (stored under its question's id) repairs that question's
    all-wrong plain group at the next step: cross-context replay."""
    step, state, _ = r3_run
    state = jax.tree.map(jnp.copy, state)
    first = make_batch([[False, False], [False, False], [True, True], [False, False]])
    first = dataclasses.replace(first, qids=jnp.array([5, 6, 7, 7], jnp.int32),  # group 2 reflects on question 7
                                is_reflection=jnp.array([False, False, True, False]))
    state, m = step(state, first)
    assert float(m["r3/isr_prompts"]) == 1.0 and float(m["r3/isr_accuracy"]) == 1.0
    second = dataclasses.replace(make_batch([[False, False]] * P, truncated=np.zeros((P, G), bool), seed=4),
                                 qids=jnp.array([7, 5, 6, 4], jnp.int32))
    _, m = step(state, second)
    assert float(m["r3/ccr_groups"]) == 1.0  # only question 7 has a stored correct answer
    assert float(m["r3/ccr_appended"]) == 2.0


def test_invalid_groups_change_nothing():
    """Two real groups plus two unused slots train exactly like the two real groups alone."""
    full = make_batch([[True, False], [False, True], [True, True], [False, False]])
    masked_out = dataclasses.replace(full, group_valid=jnp.array([True, True, False, False]))
    two = jax.tree.map(lambda x: x[:2], full)
    results = []
    for b in (masked_out, two):
        cfg, tx, graphdef, state = setup("grpo")
        results.append(train_step.make_train_step(graphdef, cfg, tx, state, b)(state, b)[1])
    for key in ("policy/loss", "policy/grad_norm", "policy/entropy", "policy/tokens"):
        np.testing.assert_allclose(results[0][key], results[1][key], rtol=1e-5, err_msg=key)


def test_buffer_rows_round_up_to_the_mesh_and_shapes_are_checked():
    mesh = sharding.make_mesh(data=2, fsdp=4)
    cfg, tx, graphdef, _ = setup("r3")
    state = train_step.init_train_state(qwen2.split_params(tiny())[1], cfg, tx, num_questions=5, mesh=mesh)
    assert state.buffer.num_questions == 8
    assert not state.buffer.correct.tokens.sharding.is_fully_replicated
    wide = make_batch(MIXED)
    wide = dataclasses.replace(wide, tokens=jnp.pad(wide.tokens, ((0, 0), (0, 0), (0, 2))))
    with pytest.raises(ValueError, match="T = 8 response tokens but the buffer stores 6"):
        jax.eval_shape(lambda s, b: train_step.train_step(graphdef, cfg, tx, s, b), state, wide)
    with pytest.raises(ValueError, match=r"P \* \(G \+ k\) = 4 \* \(2 \+ 2\) = 16 rows"):
        bad = dataclasses.replace(cfg, num_micro_batches=3)
        jax.eval_shape(lambda s, b: train_step.train_step(graphdef, bad, tx, s, b), state, make_batch(MIXED))


@pytest.mark.parametrize("overrides", [dict(old_logprobs="sampler"), dict(beta=0.04)], ids=["sampler_old", "kl"])
def test_other_objective_settings_train(overrides):
    cfg, tx, graphdef, state = setup("r3", **overrides)
    batch = make_batch(MIXED)
    new, m = train_step.make_train_step(graphdef, cfg, tx, state, batch)(state, batch)
    assert all(np.isfinite(float(v)) for v in m.values())
    if "beta" in overrides:
        assert new.ref_params is not None
        assert abs(float(m["policy/kl"])) < 1e-6  # step 0: the policy is still its reference
    else:
        assert float(m["policy/ratio_mean"]) != 1.0  # sampler log-probs differ from the trainer's


def test_right_padded_prompts_train_like_left_padded_ones():
    """A hand-built batch with right-padded prompts: the step left-aligns them (same update, same metrics)."""
    left = make_batch(MIXED)
    order = np.argsort(~np.asarray(left.prompt_mask), axis=1, kind="stable")  # real tokens first
    right = dataclasses.replace(left, prompt_tokens=jnp.take_along_axis(left.prompt_tokens, order, axis=1),
                                prompt_mask=jnp.take_along_axis(left.prompt_mask, order, axis=1))
    assert not bool(right.prompt_mask[0, -1])
    outs = []
    for b in (left, right):
        cfg, tx, graphdef, state = setup("grpo", sgd=True)
        outs.append(train_step.make_train_step(graphdef, cfg, tx, state, b)(state, b))
    assert _changed(outs[0][0].params, outs[1][0].params) == 0.0
    for key in ("policy/loss", "policy/grad_norm", "policy/logprob_mismatch"):
        assert float(outs[0][1][key]) == float(outs[1][1][key]), key


def test_non_finite_loss_skips_the_update():
    batch = make_batch(MIXED)  # a NaN sampler log-prob on a response token of a mixed group: the loss is NaN
    batch = dataclasses.replace(batch, logprobs=batch.logprobs.at[0, 0, 0].set(jnp.nan))
    cfg, tx, graphdef, state = setup("grpo", old_logprobs="sampler")
    before = jax.tree.map(jnp.copy, (state.params, state.opt_state))
    new, m = train_step.make_train_step(graphdef, cfg, tx, state, batch)(state, batch)
    assert float(m["policy/skipped"]) == 1.0 and not np.isfinite(float(m["policy/loss"]))
    assert _changed(before[0], new.params) == 0.0
    assert _changed(before[1], new.opt_state) == 0.0
    assert int(new.step) == 1
    good = make_batch(MIXED)
    _, m = train_step.make_train_step(graphdef, cfg, tx, new, good)(new, good)
    assert float(m["policy/skipped"]) == 0.0


def test_replayed_rewards_get_the_same_overlong_shaping():
    """R³ with DAPO's overlong penalty on: a replayed response of the budget's length is penalised like an
    on-policy one of that length."""
    cfg, tx, graphdef, state = setup("r3", overlong_buffer=2)
    stored = replay.insert(state.buffer, jnp.arange(P), jnp.ones((P, T), jnp.int32), jnp.full((P,), T),
                           jnp.ones((P,), bool), jnp.ones((P,), bool), 0)
    batch = make_batch([[False, False]] * P, truncated=np.zeros((P, G), bool))
    valid = jnp.ones((P, G), bool)
    groups = train_step.replayed_groups(cfg, stored, batch, batch.rewards, valid, jax.random.key(0))
    replayed = np.asarray(groups.rewards[:, G:])[np.asarray(groups.valid[:, G:])]
    expected = 1.0 + (1.0 - T / cfg.max_length_reward) - 1.0  # correct, length T: full overlong penalty -1
    np.testing.assert_allclose(replayed, expected, rtol=1e-6)


def test_the_sharded_step_compiles_without_involuntary_rematerialization(capfd):
    """The embedding lookup reads a table gathered along fsdp (`emb_lookup_vd`): looking rows up in the train
    layout (D split over fsdp) made XLA replicate the activations to reshard them (its warning says so)."""
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    cfg, tx, graphdef, state = setup("r3", mesh)
    batch = make_batch(MIXED)
    placed = jax.device_put(batch, rl_batch.batch_shardings(batch, mesh))
    capfd.readouterr()
    train_step.make_train_step(graphdef, cfg, tx, state, placed, mesh).lower(state, placed).compile()
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
