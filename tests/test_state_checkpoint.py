"""The training state, buffer and key included, round-trips through Orbax with its shardings."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from r3jax.model import config, qwen2, sharding
from r3jax.rl import algorithm, replay, train_step


def test_state_with_its_buffer_restores_exactly(tmp_path):
    cfg = algorithm.algorithm_config("r3", max_response_tokens=6)
    tx = train_step.optimizer(cfg)
    _, params = qwen2.split_params(qwen2.init_model(config.tiny(vocab_size=64, hidden_size=32,
                                                                intermediate_size=64)))
    mesh = sharding.make_mesh(data=2, fsdp=4)
    state = train_step.init_train_state(params, cfg, tx, num_questions=8, seed=3, mesh=mesh)
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    buffer = jax.jit(replay.insert)(state.buffer, jnp.array([1, 6]), tokens, jnp.array([4, 6]),
                                    jnp.array([True, False]), jnp.array([True, True]), 7)
    state = dataclasses.replace(state, buffer=buffer, step=jnp.asarray(7, jnp.int32))

    manager = ocp.CheckpointManager(tmp_path.resolve() / "ckpt")
    manager.save(7, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = manager.restore(7, args=ocp.args.StandardRestore(abstract))

    assert isinstance(restored, train_step.TrainState)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        if jnp.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(got, want)
        assert got.sharding == want.sharding
    np.testing.assert_array_equal(restored.buffer.correct.tokens[1, 0], np.arange(6))
