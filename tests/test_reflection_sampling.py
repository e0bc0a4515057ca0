"""A step where ISR built no reflection prompt samples only the plain prompts, at their own width."""

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


def collect(run, monkeypatch, plain_alone):
    calls = []

    def recording_generate(model, tokens, mask, key, **kw):
        calls.append(tokens.shape)
        return generate(model, tokens, mask, key, **kw)

    monkeypatch.setattr(rollouts, "generate", recording_generate)
    settings = dataclasses.replace(run.settings, plain_alone=plain_alone)
    qids = np.arange(run.questions_per_step)
    with rewards.GradingPool(1, timeout_s=2.0) as grader:
        got = rollouts.collect(run.graphdef, run.state.params, run.state.buffer, run.bank, qids, 1, cfg=run.rl,
                               settings=settings, num_groups=run.config.prompts_per_step,
                               sample_key=jax.random.key(3), reflection_key=jax.random.key(4),
                               tokenizer=run.tokenizer, grader=grader)
    return got, calls


def test_no_reflection_prompt_samples_the_plain_prompts_alone(run, monkeypatch):
    assert run.settings.reflection_prompts and run.settings.plain_alone
    p, m = run.questions_per_step, run.settings.reflection_prompts
    alone, calls = collect(run, monkeypatch, plain_alone=True)  # epoch 1: ISR starts at epoch 2
    assert calls == [(p, run.bank.prompt_tokens.shape[1])]
    both, calls_both = collect(run, monkeypatch, plain_alone=False)
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
