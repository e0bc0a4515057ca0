"""`generate(parts=N)`: a call's prompts in blocks, each block's program from a thread of its own, with one
program's rollout; by default on a CPU with one device, for small models (`sampling.parts`)."""

import dataclasses
import threading

import jax
import numpy as np
import pytest
from sampler_cases import prompts, ragged_run, sampler_checkpoint

from r3jax import model as rm
from r3jax.model import sharding
from r3jax.sampling import generate, sampler
from r3jax.sampling import parts as sampling_parts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return sampler_checkpoint(tmp_path_factory)


def calls_of_generate(monkeypatch):
    """The threads `sampler._generate` (one compiled program) is called from, recorded from now on."""
    threads, program = [], sampler._generate
    monkeypatch.setattr(sampler, "_generate", lambda *a: threads.append(threading.current_thread()) or program(*a))
    return threads


@pytest.mark.parametrize("parts, slot_count, share", [(2, None, False), (3, None, True), (2, 4, False)],
                         ids=["two", "three_shared", "two_with_slots"])
def test_a_call_split_into_parts_gives_the_rollout_of_one_program(checkpoint, monkeypatch, parts, slot_count,
                                                                   share):
    _, _, model = checkpoint
    whole, _ = ragged_run(model, slot_count, parts=1, share_prompts=share)
    threads = calls_of_generate(monkeypatch)
    split, cost = ragged_run(model, slot_count, parts=parts, share_prompts=share)
    assert len(threads) == parts and threading.main_thread() not in threads  # one program per part, off the main
    lengths = np.asarray(whole.lengths)
    assert 1 < len(set(lengths.tolist()))
    for name in ("tokens", "lengths", "truncated", "mask"):
        np.testing.assert_array_equal(np.asarray(getattr(split, name)), np.asarray(getattr(whole, name)), name)
    np.testing.assert_allclose(np.asarray(split.logprobs), np.asarray(whole.logprobs), atol=1e-6)
    np.testing.assert_allclose(np.asarray(split.entropies), np.asarray(whole.entropies), atol=1e-6)
    assert int(cost["slot_steps"]) >= int(lengths.sum()) and int(cost["steps"]) >= int(lengths.max())


def test_by_default_a_static_batch_on_one_cpu_device_splits_over_the_cores(checkpoint, monkeypatch):
    folder, _, model = checkpoint
    monkeypatch.setattr(sampling_parts, "cores", lambda: 4)
    config = model.config
    params = rm.split_params(model)[1]
    assert [sampling_parts.auto_parts(np.ones((p, 3), np.int32), params, config) for p in (1, 2, 6, 7, 8, 12)] == \
        [1, 2, 3, 1, 4, 4]
    sharded, _ = rm.load_pretrained(folder, mesh=sharding.make_mesh(data=2, fsdp=2, tensor=2), sharding_mode="sample")
    sharded_params = rm.split_params(sharded)[1]  # programs over 8 devices run whole
    assert sampling_parts.auto_parts(np.ones((8, 3), np.int32), sharded_params, config) == 1
    wide = dataclasses.replace(config, intermediate_size=sampling_parts.PARTS_MAX_MLP_WEIGHTS // config.hidden_size + 1)
    assert sampling_parts.auto_parts(np.ones((8, 3), np.int32), params, wide) == 1  # its decode ops spread already
    threads = calls_of_generate(monkeypatch)
    ragged_run(model, None)  # 6 prompts: 3 parts
    assert len(threads) == 3
    threads.clear()
    ragged_run(model, 4)  # refilled slots: one program unless parts are asked for
    assert threads == [threading.main_thread()]


def test_parts_that_do_not_split_the_call_are_refused(checkpoint):
    folder, _, model = checkpoint
    tokens, mask = prompts()
    with pytest.raises(ValueError, match="parts must be a positive divisor of the 3 prompts, got 2"):
        generate(model, tokens, mask, jax.random.key(0), max_new_tokens=2, parts=2)
    with pytest.raises(ValueError, match=r"slots=4 do not split over parts=3"):
        generate(model, tokens, mask, jax.random.key(0), max_new_tokens=2, parts=3, slots=4)
    sharded, _ = rm.load_pretrained(folder, mesh=sharding.make_mesh(data=2, fsdp=2, tensor=2), sharding_mode="sample")
    with pytest.raises(ValueError, match="parts=3 needs one process, one device"):
        generate(sharded, tokens, mask, jax.random.key(0), max_new_tokens=2, parts=3)
