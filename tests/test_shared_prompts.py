"""Rows that share a prompt run it once: same hidden states, log-probs and gradients as rows that each run it."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from r3jax.model import config, qwen2
from r3jax.rl import layout, loss

V, Q, TP, B, W = 96, 3, 7, 6, 5
ROW_PROMPT = np.array([2, 0, 2, 1, 0, 2])  # not in order, repeated, every prompt used


def model(remat="none"):
    cfg = config.tiny(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    return qwen2.init_model(cfg, seed=3, remat=remat)


def prompts_and_rows(seed=0):
    """Q left-padded prompts (one with no padding, one with 3 pads) and B right-padded responses."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, V, (Q, TP))
    prompt_mask = np.ones((Q, TP), bool)
    prompt_mask[0, :3] = False
    prompt_mask[2, :1] = False
    rows = rng.integers(0, V, (B, W))
    lengths = np.array([5, 1, 3, 0, 4, 2])  # one empty response
    mask = np.arange(W) < lengths[:, None]
    return prompt, prompt_mask, rows * mask, mask


def joined(prompt, prompt_mask, rows, mask):
    """The rows as `sequence_logprobs` takes them: [prompt | response] each."""
    tokens = np.concatenate([prompt[ROW_PROMPT], rows], axis=1)
    attention = np.concatenate([prompt_mask[ROW_PROMPT], mask], axis=1)
    response = np.concatenate([np.zeros((B, TP), bool), mask], axis=1)
    return tokens, attention, response


def test_shared_prefix_hidden_states_equal_the_joined_rows():
    m = model()
    prompt, prompt_mask, rows, mask = prompts_and_rows()
    prefix_h, row_h = m.shared_prefix_hidden_states(prompt, prompt_mask, ROW_PROMPT, rows, mask)
    tokens, attention, _ = joined(prompt, prompt_mask, rows, mask)
    full, _ = m.hidden_states(tokens, attention)
    assert prefix_h.shape == (Q, TP, 32) and row_h.shape == (B, W, 32)
    # every real row position sees its prompt's tokens (what a padded position returns differs by path, and never
    # reaches a real one)
    row_real = np.asarray(mask, bool)
    np.testing.assert_allclose(np.asarray(row_h)[row_real], np.asarray(full[:, TP:])[row_real], atol=2e-6)
    real = prompt_mask[ROW_PROMPT]
    np.testing.assert_allclose(np.asarray(prefix_h)[ROW_PROMPT][real], np.asarray(full[:, :TP])[real], atol=2e-6)


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_shared_prompt_logprobs_and_gradients_equal_sequence_logprobs(remat):
    m = model(remat)
    prompt, prompt_mask, rows, mask = prompts_and_rows(1)
    tokens, attention, response = joined(prompt, prompt_mask, rows, mask)
    graphdef, params = nnx.split(m)
    weights = jnp.asarray(np.random.default_rng(2).normal(size=(B, TP + W)), jnp.float32)

    def objective(shared, params):
        mdl = nnx.merge(graphdef, params)
        kw = dict(temperature=0.7, chunk_size=4, valid_vocab=V - 5)
        if shared:
            logp, ent = loss.shared_prompt_logprobs(mdl, tokens, attention, response, ROW_PROMPT, prompt_width=TP,
                                                    num_prompts=Q, **kw)
        else:
            logp, ent = loss.sequence_logprobs(mdl, tokens, attention, response, **kw)
        return jnp.sum(weights * (logp + 0.1 * ent)), (logp, ent)

    grad = jax.value_and_grad(objective, argnums=1, has_aux=True)
    (value, (logp, ent)), grads = grad(True, params)
    (ref_value, (ref_logp, ref_ent)), ref_grads = grad(False, params)
    np.testing.assert_allclose(logp, ref_logp, atol=2e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=2e-5)
    assert np.all(np.asarray(logp)[~response] == 0) and np.all(np.asarray(ent)[~response] == 0)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_prompt_ids_need_not_be_small_or_contiguous():
    """Ids only say which rows share a prompt: any integers, as long as at most num_prompts distinct ones."""
    m = model()
    prompt, prompt_mask, rows, mask = prompts_and_rows(4)
    tokens, attention, response = joined(prompt, prompt_mask, rows, mask)
    ref, _ = loss.sequence_logprobs(m, tokens, attention, response)
    got, _ = loss.shared_prompt_logprobs(m, tokens, attention, response, ROW_PROMPT * 1000 - 7, prompt_width=TP,
                                         num_prompts=Q)
    np.testing.assert_allclose(got, ref, atol=2e-5)
    spare, _ = loss.shared_prompt_logprobs(m, tokens, attention, response, ROW_PROMPT, prompt_width=TP, num_prompts=B)
    np.testing.assert_allclose(spare, ref, atol=2e-5)  # spare table rows repeat row 0's prompt, unused


def test_bad_inputs_are_named():
    m = model()
    prompt, prompt_mask, rows, mask = prompts_and_rows()
    with pytest.raises(ValueError, match="row_prefix must be"):
        m.shared_prefix_hidden_states(prompt, prompt_mask, ROW_PROMPT[:3], rows, mask)
    with pytest.raises(ValueError, match="prefix tokens must be"):
        m.shared_prefix_hidden_states(prompt, prompt_mask[:, 1:], ROW_PROMPT, rows, mask)
    tokens, attention, response = joined(prompt, prompt_mask, rows, mask)
    with pytest.raises(ValueError, match="prompt_width"):
        loss.shared_prompt_logprobs(m, tokens, attention, response, ROW_PROMPT, prompt_width=TP + W, num_prompts=Q)


@pytest.mark.parametrize("groups, g, replay_rows, micro", [
    (4, 2, 0, 1), (4, 2, 0, 2), (4, 2, 4, 2), (8, 8, 0, 1), (10, 8, 16, 4), (3, 4, 4, 4), (4, 1, 0, 1), (6, 4, 2, 13)])
def test_the_prompt_bound_holds_for_every_replay_pick(groups, g, replay_rows, micro):
    """`layout.shared_prompts` bounds the distinct prompts of every micro-batch whatever groups the replay
    rows come from, and is tight for some pick (or 0 when some micro-batch could need a prompt per row)."""
    rows = groups * g + replay_rows
    if rows % micro:
        pytest.skip("rows do not split")
    bound = layout.shared_prompts(groups, g, replay_rows, micro)
    n = rows // micro
    worst = 0
    picks = itertools.product(range(groups + 2), repeat=replay_rows) if replay_rows <= 4 else [
        tuple(range(groups, groups + replay_rows))]  # replays of groups with no on-policy row: all distinct
    for pick in picks:
        ids = np.concatenate([np.repeat(np.arange(groups), g), np.asarray(pick, int)])
        worst = max(worst, max(len(set(ids[j * n:(j + 1) * n])) for j in range(micro)))
    assert bound == (worst if worst < n else 0)


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_rows_in_prompt_order_read_their_prompt_by_group_as_by_row(remat):
    """group_size: the rows are Q groups of G in prompt order (the train step's on-policy rows); each group meets
    its prompt once per head (`attend_shared_prefix`). Same log-probs, entropies and gradients as the same rows
    read through per-row prompt ids, and as every row running its own prompt."""
    m = model(remat)
    g = B // Q
    order = np.repeat(np.arange(Q), g)
    prompt, prompt_mask, rows, mask = prompts_and_rows(5)
    tokens = np.concatenate([prompt[order], rows], axis=1)
    attention = np.concatenate([prompt_mask[order], mask], axis=1)
    response = np.concatenate([np.zeros((B, TP), bool), mask], axis=1)
    graphdef, params = nnx.split(m)
    weights = jnp.asarray(np.random.default_rng(6).normal(size=(B, TP + W)), jnp.float32)

    def objective(how, params):
        mdl = nnx.merge(graphdef, params)
        if how == "own":
            logp, ent = loss.sequence_logprobs(mdl, tokens, attention, response)
        else:
            logp, ent = loss.shared_prompt_logprobs(mdl, tokens, attention, response, order, prompt_width=TP,
                                                    num_prompts=Q, group_size=g if how == "groups" else 0)
        return jnp.sum(weights * (logp + 0.1 * ent)), (logp, ent)

    grad = jax.jit(jax.value_and_grad(objective, argnums=1, has_aux=True), static_argnums=0)
    (value, (logp, ent)), grads = grad("groups", params)
    for how in ("ids", "own"):
        (ref_value, (ref_logp, ref_ent)), ref_grads = grad(how, params)
        np.testing.assert_allclose(logp, ref_logp, atol=2e-5, err_msg=how)
        np.testing.assert_allclose(ent, ref_ent, atol=2e-5, err_msg=how)
        np.testing.assert_allclose(value, ref_value, rtol=1e-5, err_msg=how)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4, err_msg=f"{how} {jax.tree_util.keystr(path)}")


def test_groups_must_cover_the_rows():
    m = model()
    prompt, prompt_mask, rows, mask = prompts_and_rows()
    tokens, attention, response = joined(prompt, prompt_mask, rows, mask)
    with pytest.raises(ValueError, match="group_size 4 x num_prompts 3 must be the 6 rows"):
        loss.shared_prompt_logprobs(m, tokens, attention, response, ROW_PROMPT, prompt_width=TP, num_prompts=Q,
                                    group_size=4)


@pytest.mark.parametrize("groups, g, replay_rows, micro, narrow, apart", [
    (4, 2, 0, 1, 0, False), (4, 2, 0, 2, 0, False), (4, 2, 0, 4, 0, False), (4, 2, 0, 8, 0, False),
    (4, 2, 4, 2, 0, False), (8, 8, 0, 1, 6, False), (10, 8, 0, 2, 8, False), (10, 8, 16, 2, 8, False),
    (3, 4, 0, 3, 2, False), (4, 1, 0, 1, 0, False), (4, 2, 4, 1, 0, True), (4, 2, 4, 2, 0, True),
    (8, 8, 16, 2, 0, True), (10, 8, 16, 2, 8, True), (10, 8, 16, 2, 10, True), (4, 3, 6, 3, 0, True)])
def test_segments_read_prompts_by_group_exactly_when_their_micro_batches_are_whole_groups(groups, g, replay_rows,
                                                                                        micro, narrow, apart):
    """`Segment.group_rows` is G exactly when every micro-batch of the segment is whole groups of G > 1
    on-policy rows in group order (what `attend_shared_prefix` assumes), checked against the rows' own groups."""
    lay = layout.Layout(width=4, replay_rows=replay_rows, narrow_groups=narrow, narrow_prompt_width=2 if narrow else 0,
                        replay_apart=apart)
    ids = np.concatenate([np.repeat(np.arange(groups), g), -1 - np.arange(replay_rows)])  # replay rows: no order
    segs = layout.segments(lay, micro, groups, g, 4)
    assert [s.start for s in segs] == list(np.cumsum([0] + [s.rows for s in segs[:-1]]))  # in row order, no gap
    assert sum(s.rows for s in segs) == len(ids)
    for seg in segs:
        if seg.rows % seg.micro_batches:
            continue
        n = seg.rows // seg.micro_batches
        parts = [ids[seg.start + j * n:seg.start + (j + 1) * n] for j in range(seg.micro_batches)]
        whole = g > 1 and n % g == 0 and all(np.array_equal(x, x[0] + np.arange(n) // g) for x in parts)
        assert seg.group_rows == (g if whole else 0), seg
