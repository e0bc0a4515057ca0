"""Sampler -> grouped batch -> train step: the pieces compose, and on-policy log-probs agree."""

import jax
import numpy as np
import pytest

from r3jax.model import config, qwen2
from r3jax.rl import algorithm, batch, train_step
from r3jax.sampling import generate

P, G, T = 2, 3, 5


@pytest.mark.parametrize("padding", ["left", "right"])
def test_sampled_rollouts_train_and_the_mismatch_meter_reads_zero(padding):
    model = qwen2.init_model(config.tiny(vocab_size=64, hidden_size=32, intermediate_size=64), seed=1)
    graphdef, params = qwen2.split_params(model)
    prompts = np.array([[0, 0, 5, 6] if padding == "left" else [5, 6, 0, 0], [7, 8, 9, 10]], np.int32)
    mask = prompts > 0
    rollout = generate((graphdef, params), prompts, mask, jax.random.key(0), max_new_tokens=T, temperature=1.0,
                       num_samples=G, eos_ids=(3,))
    correct = np.asarray(rollout.tokens[:, 0]) % 2 == 0  # a stand-in grader
    rewards = np.where(correct, 1.0, 0.0)
    rb = batch.from_rollout(rollout, G, qids=[0, 1], prompt_tokens=prompts, prompt_mask=mask, correct=correct,
                            rewards=rewards)
    assert rb.tokens.shape == (P, G, T)
    cfg = algorithm.algorithm_config("r3", max_response_tokens=T, chunk_size=4)
    tx = train_step.optimizer(cfg)
    state = train_step.init_train_state(params, cfg, tx, num_questions=2)
    state, metrics = train_step.make_train_step(graphdef, cfg, tx, state, rb)(state, rb)
    # the trainer's teacher-forced log-probs of the sampled tokens are the sampler's own
    assert float(metrics["policy/logprob_mismatch"]) < 1e-5
    assert float(metrics["policy/clipfrac"]) == 0.0  # pi_old recomputed at the same params: every ratio is 1
    assert int(state.buffer.attempts.sum()) == P * G
    assert np.isfinite(np.asarray(jax.tree.leaves(params)[0])).all()  # the caller's params were not donated
