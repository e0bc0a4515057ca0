"""Rollouts at their own widths: a step where ISR built no reflection prompt samples only the plain prompts; one
with reflection prompts samples them in a call of their own, so the plain prompts are not padded to their width."""

import dataclasses
import pathlib
import runpy

import jax
import numpy as np
import pytest

from r3jax import rewards
from r3jax.sampling import generate
from r3jax.train import rollouts, setup

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run():
    return setup.prepare(runpy.run_path(str(REPO / "configs" / "tiny.py"))["get_config"]())


def collect(run, monkeypatch, plain_alone, reflection_alone=False):
    calls, outputs = [], []

    def recording_generate(model, tokens, mask, key, **kw):
        calls.append(tokens.shape)
        outputs.append(generate(model, tokens, mask, key, **kw))
        return outputs[-1]

    monkeypatch.setattr(rollouts, "generate", recording_generate)
    settings = dataclasses.replace(run.settings, plain_alone=plain_alone, reflection_alone=reflection_alone)
    qids = np.arange(run.questions_per_step)
    with rewards.GradingPool(1, timeout_s=2.0) as grader:
        got = rollouts.collect(run.graphdef, run.state.params, run.state.buffer, run.bank, qids, 1, cfg=run.rl,
                               settings=settings, num_groups=run.config.prompts_per_step,
                               sample_key=jax.random.key(3), reflection_key=jax.random.key(4),
                               tokenizer=run.tokenizer, grader=grader)
    return got, calls, outputs


def test_no_reflection_prompt_samples_the_plain_prompts_alone(run, monkeypatch):
    assert run.settings.reflection_prompts and run.settings.plain_alone
    p, m = run.questions_per_step, run.settings.reflection_prompts
    alone, calls, _ = collect(run, monkeypatch, plain_alone=True)  # epoch 1: ISR starts at epoch 2
    assert calls == [(p, run.bank.prompt_tokens.shape[1])]
    both, calls_both, _ = collect(run, monkeypatch, plain_alone=False)
    assert calls_both == [(p + m, rollouts.prompt_width(run.bank, run.settings))]
    a, b = alone.batch, both.batch
    for name, x in a.__dict__.items():  # the batch the train step sees keeps its shapes
        assert x.shape == getattr(b, name).shape and x.dtype == getattr(b, name).dtype, name
    np.testing.assert_array_equal(np.asarray(a.prompt_tokens), np.asarray(b.prompt_tokens))
    assert not np.asarray(a.group_valid)[p:].any()
    assert (np.asarray(a.lengths)[p:] == 0).all() and not np.asarray(a.mask)[p:].any()
    assert (np.asarray(a.tokens)[p:] == run.settings.pad_id).all()
    assert not np.asarray(a.correct)[p:].any() and (np.asarray(a.rewards)[p:] == 0).all()
    assert alone.generated_tokens == int(np.asarray(a.lengths)[:p].sum()) > 0
    assert alone.texts and len(alone.texts) == len(both.texts) == p * run.settings.num_samples


def test_reflection_prompts_are_sampled_in_calls_of_their_own(run, monkeypatch):
    """ISR's slots marked valid (they hold well-formed filler prompts): the plain prompts go in one call at the
    bank's width, the M reflection prompts in another at the reflection width, and the joined batch has the
    rows of the calls in order (plain groups, then reflection groups), as the one-call layout does."""
    assert run.settings.reflection_alone
    real = rollouts._reflection_batch

    def all_valid(*a, **k):
        refl = real(*a, **k)
        return dataclasses.replace(refl, valid=jax.numpy.ones_like(refl.valid))

    monkeypatch.setattr(rollouts, "_reflection_batch", all_valid)
    p, m, g = run.questions_per_step, run.settings.reflection_prompts, run.settings.num_samples
    split, calls, (plain_out, reflection_out) = collect(run, monkeypatch, plain_alone=True, reflection_alone=True)
    assert calls == [(p, run.bank.prompt_tokens.shape[1]), (m, run.settings.reflection_width)]
    assert split.sampled == ((p, run.bank.prompt_tokens.shape[1]), (m, run.settings.reflection_width))
    joint, calls_joint, _ = collect(run, monkeypatch, plain_alone=True, reflection_alone=False)
    assert calls_joint == [(p + m, rollouts.prompt_width(run.bank, run.settings))]
    a, b = split.batch, joint.batch
    for name, x in a.__dict__.items():
        assert x.shape == getattr(b, name).shape and x.dtype == getattr(b, name).dtype, name
    np.testing.assert_array_equal(np.asarray(a.prompt_tokens), np.asarray(b.prompt_tokens))
    assert np.asarray(a.group_valid).all()
    np.testing.assert_array_equal(np.asarray(a.tokens).reshape(-1, a.tokens.shape[-1]),
                                  np.concatenate([plain_out.tokens, reflection_out.tokens]))
    np.testing.assert_array_equal(np.asarray(a.lengths).reshape(-1),
                                  np.concatenate([plain_out.lengths, reflection_out.lengths]))
    assert len(split.texts) == (p + m) * g
    assert split.generated_tokens == int(np.asarray(a.lengths).sum()) > 0
