"""A tiny random model on toy arithmetic: a few R³ steps on a CPU in under a minute (tests and CI run it).

Everything it needs is in `configs/tiny/` (a byte-level tokenizer with R1-Distill's chat format, 64 training
and 16 evaluation problems), rebuilt by `python -m r3jax.data.toy configs/tiny`. The model starts random, so
it learns nothing in a few steps: this config exercises the whole program, not the algorithm's gains.
"""

import os

import ml_collections

from r3jax.train import config as run_config

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny")


def get_config():
    c = run_config.base_config()
    c.algorithm = "r3"
    c.model.init = "tiny"
    c.model.init_tokenizer = os.path.join(HERE, "tokenizer")  # --config.model.path=DIR brings DIR's own
    c.model.init_overrides = ml_collections.ConfigDict(dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024))
    c.data.train = os.path.join(HERE, "train.jsonl")
    c.data.eval = ml_collections.ConfigDict({"arith": os.path.join(HERE, "eval.jsonl")})
    c.data.limit = 16                  # 4 steps per epoch: epoch ends and ISR (from epoch 2) show up early
    c.data.eval_limit = 8
    c.prompts_per_step = 4
    c.samples_per_prompt = 4
    c.max_new_tokens = 16
    c.temperature = 1.0
    c.top_p = 1.0
    c.steps = 6
    c.checkpoint_every = 2
    c.eval_every = 3
    c.keep_checkpoints = 2
    c.rl.learning_rate = 1e-3
    c.rl.chunk_size = 64
    c.rl.r3.max_reflection_prompts = 4
    c.rl.r3.reflection_attempt_tokens = 8
    # a short ISR instruction keeps the byte-level reflection prompts (and the loss's rows) short
    c.rl.r3.reflection_instruction = "Find the mistake in this wrong attempt, then solve it again in \\boxed{}."
    c.eval.batch_size = 8
    c.grading.timeout_s = 2.0
    c.grading.workers = 1
    return c
