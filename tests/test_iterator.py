"""The question stream is a pure function of (seed, state): deterministic, resumable, a permutation per epoch,
split into disjoint per-process slices."""

import json

import numpy as np
import pytest

from r3jax.data import iterator as ri


def stream(steps, **kwargs):
    """The first `steps` (indices, epoch) of a fresh iterator."""
    it = ri.QuestionIterator(**kwargs)
    return [next(it) for _ in range(steps)]


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) and ex == ey for (x, ex), (y, ey) in zip(a, b, strict=True))


def test_same_seed_same_stream():
    assert same(stream(7, num_questions=10, batch_size=3, seed=1), stream(7, num_questions=10, batch_size=3, seed=1))


def test_different_seeds_differ():
    assert not same(stream(3, num_questions=50, batch_size=10, seed=0),
                    stream(3, num_questions=50, batch_size=10, seed=1))


def test_permutation_is_pinned():
    """The order is SeedSequence + PCG64 raw bits, both stable across numpy versions: this must never change."""
    assert ri.epoch_permutation(0, 0, 10).tolist() == [3, 2, 1, 8, 6, 0, 7, 4, 5, 9]


def test_each_question_once_per_epoch_and_remainder_dropped():
    batches = stream(6, num_questions=10, batch_size=3, seed=2)  # 3 full batches per epoch, 1 question dropped
    assert [epoch for _, epoch in batches] == [0, 0, 0, 1, 1, 1]
    for epoch in (0, 1):
        seen = np.concatenate([idx for idx, e in batches if e == epoch])
        assert len(set(seen.tolist())) == 9 and set(seen.tolist()) <= set(range(10))
        assert seen.tolist() == ri.epoch_permutation(2, epoch, 10)[:9].tolist()


def test_epochs_reshuffle():
    assert not np.array_equal(ri.epoch_permutation(0, 0, 100), ri.epoch_permutation(0, 1, 100))


def test_batch_equal_to_num_questions_is_one_step_per_epoch():
    batches = stream(2, num_questions=4, batch_size=4, seed=0)
    assert [sorted(idx.tolist()) for idx, _ in batches] == [[0, 1, 2, 3]] * 2
    assert [epoch for _, epoch in batches] == [0, 1]


def test_resume_from_saved_state_gives_identical_stream():
    kwargs = dict(num_questions=11, batch_size=4, seed=5)
    full = stream(9, **kwargs)
    it = ri.QuestionIterator(**kwargs)
    for _ in range(4):
        next(it)
    saved = json.loads(json.dumps(it.state.to_dict()))  # as a checkpoint stores it
    resumed = ri.QuestionIterator(**kwargs)
    resumed.restore(ri.IteratorState.from_dict(saved))
    assert same([next(resumed) for _ in range(5)], full[4:])


def test_state_moves_to_next_epoch_after_its_last_full_batch():
    _, epoch, state = ri.next_batch(ri.IteratorState(0, 6), num_questions=10, batch_size=3, seed=0)
    assert epoch == 0 and state == ri.IteratorState(epoch=1, position=0)


def test_process_slices_are_disjoint_and_make_the_global_batch():
    kwargs = dict(num_questions=40, batch_size=12, seed=3)
    state = ri.IteratorState(epoch=2, position=12)
    global_batch, epoch, after = ri.next_batch(state, **kwargs)
    parts = [ri.next_batch(state, **kwargs, process_index=p, process_count=4) for p in range(4)]
    assert [len(idx) for idx, _, _ in parts] == [3] * 4
    assert np.concatenate([idx for idx, _, _ in parts]).tolist() == global_batch.tolist()
    assert len(set(global_batch.tolist())) == 12
    assert all(e == epoch and s == after for _, e, s in parts)


def test_indices_are_int32():
    indices, _, _ = ri.next_batch(ri.IteratorState(), num_questions=5, batch_size=2, seed=0)
    assert indices.dtype == np.int32


def test_state_round_trips_through_dict():
    state = ri.IteratorState(epoch=3, position=96)
    assert ri.IteratorState.from_dict(state.to_dict()) == state


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_questions=5, batch_size=6, seed=0), "larger than the 5 questions"),
    (dict(num_questions=10, batch_size=6, seed=0, process_count=4), "not divisible by process_count 4"),
    (dict(num_questions=10, batch_size=4, seed=0, process_index=2, process_count=2), "process_index 2 is not below"),
    (dict(num_questions=0, batch_size=1, seed=0), "num_questions must be an integer >= 1"),
    (dict(num_questions=10, batch_size=0, seed=0), "batch_size must be an integer >= 1"),
    (dict(num_questions=10, batch_size=2, seed=-1), "seed must be an integer >= 0"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ri.QuestionIterator(**kwargs)
    with pytest.raises(ValueError, match=message):
        ri.next_batch(ri.IteratorState(), **kwargs)


@pytest.mark.parametrize("raw", [{"epoch": -1, "position": 0}, {"epoch": 0}, {"epoch": 1.5, "position": 0}])
def test_bad_state(raw):
    with pytest.raises(ValueError, match="epoch"):
        ri.IteratorState.from_dict(raw)


def test_restore_takes_a_state():
    it = ri.QuestionIterator(num_questions=5, batch_size=2, seed=0)
    with pytest.raises(TypeError, match="IteratorState"):
        it.restore({"epoch": 0, "position": 0})


def test_state_restored_as_zero_d_arrays():
    from r3jax.data import iterator as ri

    restored = {"epoch": np.asarray(2), "position": np.asarray(6)}  # what some checkpoint restores give back
    assert ri.IteratorState.from_dict(restored) == ri.IteratorState(2, 6)
