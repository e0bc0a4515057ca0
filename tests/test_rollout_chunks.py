"""`sampling_chunk`: a step's rollouts sampled a few rows at a time, graded chunk by chunk, one batch out.

Whatever the chunking, every row's verdict must be the grade of that row's own response against its own
question's answers (a misaligned chunk would credit one response with another's grade). A random tiny model
answers nothing right, so the grader here is a stand-in whose verdict and reward depend on the text and the
answer: any row mixed up with another shows.
"""

import dataclasses
import pathlib
import runpy
import threading

import jax
import numpy as np
import pytest

from r3jax import rewards
from r3jax.data import prompts
from r3jax.model import qwen2
from r3jax.train import rollouts, setup

REPO = pathlib.Path(__file__).resolve().parents[1]


def tiny():
    return runpy.run_path(str(REPO / "configs" / "tiny.py"))["get_config"]()


@pytest.fixture(scope="module")
def run():
    return setup.prepare(tiny())


def fake_grade(texts, answers, **_):
    return [rewards.GradeResult(correct=len(t) % 2 == 0, reward=float(len(t) + 100 * len(str(a))), reason="fake")
            for t, a in zip(texts, answers, strict=True)]


def step_batch(run, chunk, monkeypatch, slots=0, model=None):
    monkeypatch.setattr(rollouts.rewards, "grade_batch", fake_grade)
    graphdef, params = model or (run.graphdef, run.state.params)
    settings = dataclasses.replace(run.settings, sampling_chunk=chunk, sampling_slots=slots)
    qids = np.arange(run.questions_per_step)
    with rewards.GradingPool(1, timeout_s=2.0) as grader:
        return rollouts.collect(graphdef, params, run.state.buffer, run.bank, qids, 1, cfg=run.rl,
                                settings=settings, num_groups=run.config.prompts_per_step,
                                sample_key=jax.random.key(3), reflection_key=jax.random.key(4),
                                tokenizer=run.tokenizer, grader=grader)


@pytest.mark.parametrize("chunk", [0, 8, 24])  # 24 rows = 6 prompts: calls of 6 and 2 (padded to 6)
def test_each_row_carries_the_grade_of_its_own_response(run, chunk, monkeypatch):
    got = step_batch(run, chunk, monkeypatch)
    b = got.batch
    valid = np.asarray(b.group_valid)
    tokens, lengths = np.asarray(b.tokens)[valid], np.asarray(b.lengths)[valid]
    truncated = np.asarray(b.truncated)[valid]
    g = tokens.shape[1]
    texts = prompts.decode_responses(run.tokenizer, tokens.reshape(-1, tokens.shape[-1]), lengths.reshape(-1),
                                     truncated.reshape(-1))
    answers = [run.bank.problems[q].answers for q in np.repeat(np.asarray(b.qids)[valid], g)]
    expected = fake_grade(texts, answers)
    assert 0 < sum(r.correct for r in expected) < len(expected)
    np.testing.assert_array_equal(np.asarray(b.correct)[valid].reshape(-1), [r.correct for r in expected])
    np.testing.assert_allclose(np.asarray(b.rewards)[valid].reshape(-1), [r.reward for r in expected])
    assert got.generated_tokens == int(lengths.sum())


def test_chunks_keep_the_batch_shape(run, monkeypatch):
    whole = step_batch(run, 0, monkeypatch).batch
    for chunk in (8, 24):
        chunked = step_batch(run, chunk, monkeypatch).batch
        for a, b in zip(whole.__dict__.values(), chunked.__dict__.values(), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype


def test_refilled_slots_give_the_step_the_same_batch(run, monkeypatch):
    whole = step_batch(run, 0, monkeypatch).batch
    slotted = step_batch(run, 0, monkeypatch, slots=8).batch  # 8 slots over the step's 32 rows
    np.testing.assert_array_equal(np.asarray(slotted.tokens), np.asarray(whole.tokens))
    np.testing.assert_array_equal(np.asarray(slotted.correct), np.asarray(whole.correct))
    np.testing.assert_allclose(np.asarray(slotted.logprobs), np.asarray(whole.logprobs), atol=1e-6)


@pytest.mark.parametrize("chunk", [6, 12])
def test_a_chunk_of_part_groups_or_of_rows_the_devices_do_not_split_is_refused(chunk):
    c = tiny()
    c.sampling_chunk = chunk  # G = 4: 6 rows split a group; 12 rows do not split over the 8 devices
    with pytest.raises(setup.SetupError, match="sampling_chunk"):
        setup.prepare(c)


def one_device_model(run):
    """The run's model with every parameter on the first device and no mesh (a one-device run's model; this
    process has 8 devices, and a run's mesh spans all of them)."""
    graphdef, _ = qwen2.split_params(qwen2.abstract_model(run.model_config))
    return graphdef, jax.device_put(run.state.params, jax.devices()[0])


def test_sampler_calls_on_one_device_run_from_threads_with_the_batch_of_calls_in_turn(run, monkeypatch):
    graphdef, params = one_device_model(run)
    threads = []
    generate = rollouts.generate
    monkeypatch.setattr(rollouts, "generate", lambda *a, **k: threads.append(threading.current_thread()) or
                        generate(*a, **k))
    assert rollouts.threads_per_call(params)
    threaded = step_batch(run, 8, monkeypatch, model=(graphdef, params)).batch  # 8 rows a call: several calls
    assert len(threads) > 1 and threading.main_thread() not in threads
    threads.clear()
    monkeypatch.setattr(rollouts, "threads_per_call", lambda params: False)
    in_turn = step_batch(run, 8, monkeypatch, model=(graphdef, params)).batch
    assert threads == [threading.main_thread()] * len(threads)
    for name, a in threaded.__dict__.items():
        np.testing.assert_array_equal(np.asarray(a), np.asarray(getattr(in_turn, name)), err_msg=name)


def test_sampler_calls_over_several_devices_share_one_thread(run):
    assert not rollouts.threads_per_call(run.state.params)  # the tiny config's parameters span 8 devices
