"""ISR (R3-SPEC §5): which questions get a reflection prompt, and the prompt's exact token layout."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import r1_tokenizer  # tests/ is on sys.path: pytest prepends the rootdir of a test file without __init__.py

from r3jax.data import prompts
from r3jax.rl import reflection, replay

T = 8  # buffer response tokens
PAD = 0
TOY = reflection.ReflectionTemplate(prefix=[1, 2], between=[3], suffix=[4, 5])
STATIC = ("template", "tau", "start_epoch", "max_prompts", "attempt_tokens", "width", "pad_id", "end_ids")
# One compile per static configuration; the epoch is always traced.
reflection_prompts = jax.jit(reflection.reflection_prompts, static_argnames=STATIC)
hard_questions = jax.jit(reflection.hard_questions, static_argnames=("tau", "start_epoch"))
insert = jax.jit(replay.insert)
ROWS = 32


def buffer_with(stats, num_questions=6, slots_wrong=2):
    """stats {q: (number of correct responses, [wrong responses as id lists])}, inserted in one step.

    The rows are padded to ROWS invalid ones, so every test shares one compiled `insert`."""
    qids, rows, lengths, correct = [], [], [], []
    for q, (n_correct, wrongs) in stats.items():
        qids += [q] * (n_correct + len(wrongs))
        rows += [[90] * T] * n_correct + [ids + [PAD] * (T - len(ids)) for ids in wrongs]
        lengths += [T] * n_correct + [len(ids) for ids in wrongs]
        correct += [True] * n_correct + [False] * len(wrongs)
    n = len(qids)
    pad = ROWS - n
    return insert(replay.init_buffer(num_questions, T, slots_wrong=slots_wrong), np.array(qids + [0] * pad),
                  np.array(rows + [[PAD] * T] * pad, np.int32).reshape(ROWS, T), np.array(lengths + [0] * pad),
                  np.array(correct + [False] * pad), np.arange(ROWS) < n, 0)


def toy_questions(qids):
    """Question q is the ids [100 + q, 100 + q], right-padded to Tq = 3."""
    tokens = np.array([[100 + q, 100 + q, PAD] for q in qids], np.int32)
    return tokens, tokens != PAD


def toy_prompts(buf, qids, epoch=1, key=0, **kw):
    kw = dict(template=TOY, max_prompts=len(qids), attempt_tokens=4, width=12, pad_id=PAD) | kw
    tokens, mask = toy_questions(qids)
    return reflection_prompts(buf, jnp.array(qids, jnp.int32), tokens, mask, jnp.int32(epoch),
                              jax.random.key(key), **kw)


def test_tau_threshold_is_strict():
    # q0: 1 / 5 = τ exactly (not hard); q1: 1 / 6 < τ; q2: 0 / 1; q3: 1 / 4 > τ.
    buf = buffer_with({0: (1, [[7]] * 4), 1: (1, [[7]] * 5), 2: (0, [[7]]), 3: (1, [[7]] * 3)})
    np.testing.assert_array_equal(hard_questions(buf, jnp.arange(4), 1, tau=0.2), [False, True, True, False])
    np.testing.assert_array_equal(hard_questions(buf, jnp.arange(4), 1, tau=0.25), [True, True, True, False])
    assert not hard_questions(buf, jnp.arange(4), 1, tau=0.0).any()


def test_epoch_gate_is_one_based():
    buf = buffer_with({0: (0, [[7]])})
    assert not hard_questions(buf, jnp.array([0]), 0, start_epoch=2)[0]  # first epoch: no history yet
    assert hard_questions(buf, jnp.array([0]), 1, start_epoch=2)[0]      # second epoch
    assert hard_questions(buf, jnp.array([0]), 0, start_epoch=1)[0]
    assert not toy_prompts(buf, [0], epoch=0).valid.any()
    assert toy_prompts(buf, [0], epoch=1).valid.all()


def test_needs_a_stored_failure():
    # q1 never attempted (accuracy 0 by convention); q2 has attempts but an empty wrong ring.
    buf = buffer_with({0: (0, [[7]])})
    buf = dataclasses.replace(buf, attempts=buf.attempts.at[2].set(9), corrects=buf.corrects.at[2].set(1))
    np.testing.assert_array_equal(hard_questions(buf, jnp.arange(3), 1), [True, False, False])


def test_lowest_accuracy_first_up_to_max():
    # accuracies q0 .1, q1 0, q2 .1, q3 0, q4 .5 (not hard); ties by batch position.
    buf = buffer_with({0: (1, [[7]] * 9), 1: (0, [[7]] * 2), 2: (1, [[7]] * 9), 3: (0, [[7]]), 4: (1, [[7]])})
    out = toy_prompts(buf, [0, 1, 2, 3, 4], max_prompts=3)
    np.testing.assert_array_equal(out.rows, [1, 3, 0])
    np.testing.assert_array_equal(out.qids, [1, 3, 0])
    assert out.valid.all()
    out = toy_prompts(buf, [4, 3, 2, 1, 0], max_prompts=5)  # batch positions change the tie order
    np.testing.assert_array_equal(out.qids[:4], [3, 1, 2, 0])
    np.testing.assert_array_equal(out.valid, [True] * 4 + [False])


def test_duplicates_once_and_unused_slots_masked():
    buf = buffer_with({2: (0, [[7]]), 1: (0, [[7, 8]]), 4: (1, [])})
    out = toy_prompts(buf, [2, 2, 4, 1], max_prompts=6)
    np.testing.assert_array_equal(out.valid, [True, True, False, False, False, False])
    np.testing.assert_array_equal(out.rows[:2], [0, 3])
    assert int(out.added) == 2
    # Filler slots: a real token for the sampler, in-range indices, no attempt.
    assert np.asarray(out.mask).any(axis=1).all()
    assert ((np.asarray(out.rows) >= 0) & (np.asarray(out.rows) < 4)).all()
    assert not np.isin(np.asarray(out.tokens)[2:], [7, 8]).any()


def test_exact_layout_left_padded_with_attempt_tail():
    # q0's question is 2 tokens, its attempt 6 tokens (cut to the last 4); q1's attempt 2 tokens (kept whole).
    buf = buffer_with({0: (0, [[201, 202, 203, 204, 205, 206]]), 1: (0, [[211, 212]])})
    out = toy_prompts(buf, [0, 1], width=13)
    np.testing.assert_array_equal(out.tokens, [
        [0, 0, 1, 2, 100, 100, 3, 203, 204, 205, 206, 4, 5],
        [0, 0, 0, 0, 1, 2, 101, 101, 3, 211, 212, 4, 5]])
    np.testing.assert_array_equal(out.mask, np.asarray(out.tokens) != PAD)


def test_question_padding_side_does_not_matter():
    buf = buffer_with({0: (0, [[201, 202]])})
    left = np.array([[PAD, 100, 101]], np.int32)
    args = dict(template=TOY, max_prompts=1, attempt_tokens=4, width=12, pad_id=PAD)
    out = reflection_prompts(buf, jnp.array([0]), left, left != PAD, 1, jax.random.key(0), **args)
    np.testing.assert_array_equal(out.tokens[0], [0, 0, 0, 1, 2, 100, 101, 3, 201, 202, 4, 5])


def test_attempt_tail_keeps_the_last_tokens_and_drops_the_end_token():
    tokens = jnp.array([[1, 2, 3, 4, 5, 6, 0, 0], [1, 2, 0, 0, 0, 0, 0, 0]])
    tail, mask = reflection.attempt_tail(tokens, jnp.array([6, 2]), 4)
    np.testing.assert_array_equal(tail, [[3, 4, 5, 6], [0, 0, 1, 2]])
    np.testing.assert_array_equal(mask, [[True] * 4, [False, False, True, True]])
    tail, mask = reflection.attempt_tail(tokens, jnp.array([6, 2]), 4, end_ids=(6,))
    np.testing.assert_array_equal(tail, [[2, 3, 4, 5], [0, 0, 1, 2]])


def test_random_choice_among_filled_wrong_slots():
    buf = buffer_with({0: (0, [[201], [202]])}, slots_wrong=3)  # the third slot stays empty
    seen = {int(toy_prompts(buf, [0], key=k).tokens[0, -3]) for k in range(16)}
    assert seen == {201, 202}


def test_traced_epoch_matches_a_python_epoch():
    buf = buffer_with({0: (0, [[201, 202, 203]]), 2: (1, [[205]] * 6)})
    tokens, mask = toy_questions([0, 1, 2])
    build = functools.partial(reflection.reflection_prompts, template=TOY, max_prompts=2, attempt_tokens=2,
                              width=10, pad_id=PAD)
    traced, concrete = jax.jit(build), jax.jit(build, static_argnums=4)  # epoch an array / a Python int
    for epoch in (0, 1):
        got = traced(buf, jnp.arange(3), tokens, mask, jnp.int32(epoch), jax.random.key(3))
        want = concrete(buf, jnp.arange(3), tokens, mask, epoch, jax.random.key(3))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
        assert int(got.added) == epoch * 2


def test_width_too_small_raises():
    buf = buffer_with({0: (0, [[7]])})
    assert reflection.required_width(TOY, 3, 4) == 12
    with pytest.raises(ValueError, match="width 11 is too small.*12 tokens"):
        toy_prompts(buf, [0], width=11)


@pytest.mark.parametrize("bad, match", [(dict(tau=1.5), "tau"), (dict(max_prompts=-1), "max_prompts"),
                                        (dict(attempt_tokens=0), "attempt_tokens"), (dict(start_epoch=0), "start")])
def test_static_arguments_are_checked(bad, match):
    with pytest.raises(ValueError, match=match):
        toy_prompts(buffer_with({}), [0], **bad)


def test_zero_prompts_gives_empty_arrays():
    out = toy_prompts(buffer_with({0: (0, [[7]])}), [0], max_prompts=0)
    assert out.tokens.shape == out.mask.shape == (0, 12)
    assert out.qids.shape == out.rows.shape == out.valid.shape == (0,)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return prompts.load_tokenizer(r1_tokenizer.session_r1_distill_tokenizer(tmp_path_factory))


@pytest.mark.parametrize("attempt_tokens", [64, 5])
def test_r1_prompt_decodes_to_the_rendered_text(tokenizer, attempt_tokens):
    problem, attempt = "What is $1+1$?", "So $1+1=3$ and the answer is \\boxed{3}."
    template = reflection.make_template(tokenizer)
    attempt_ids = prompts.encode(tokenizer, attempt)
    eos = tokenizer.eos_token_id
    buf = replay.insert(replay.init_buffer(3, 64), [1], np.array([attempt_ids + [eos]]), [len(attempt_ids) + 1],
                        [False], [True], step=0)
    q_ids = reflection.question_ids(tokenizer, problem)
    tq = len(q_ids) + 3
    question = np.full((1, tq), eos, np.int32)
    question[0, 3:] = q_ids  # left-padded
    width = reflection.required_width(template, tq, attempt_tokens)
    out = reflection_prompts(buf, jnp.array([1]), question, question != eos, 1, jax.random.key(0),
                             template=template, max_prompts=1, attempt_tokens=attempt_tokens, width=width,
                             pad_id=eos, end_ids=(eos,))
    decoded = tokenizer.decode(np.asarray(out.tokens[0])[np.asarray(out.mask[0])].tolist())
    shown = tokenizer.decode(attempt_ids[-attempt_tokens:])
    assert decoded == prompts.render(tokenizer, reflection.reflection_text(prompts.question_text(problem), shown))
    assert decoded == prompts.render(tokenizer, prompts.question_text(problem) + "\n\n" + reflection.ATTEMPT_HEADER
                                     + shown + "\n\n" + reflection.DEFAULT_REFLECTION_INSTRUCTION)
    assert decoded.startswith("<｜begin▁of▁sentence｜><｜User｜>")
    assert decoded.endswith("<｜Assistant｜><think>\n")
    assert int(out.qids[0]) == 1 and bool(out.valid[0])
