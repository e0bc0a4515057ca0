"""The embedded default (`python train.py`): R³ makes a small reasoning model better at multi-step arithmetic.

The base model (`configs/arith/base/`, ~1M parameters, made by `scripts/make_arith_base.py`: a JAX warm start)
writes arithmetic lines almost without error, but about half of the time it skips them and answers at once,
which is often wrong on longer chains. That choice is what RL can fix, and the fix carries over to questions it
never trained on. The task (`r3jax.data.arith`) has four levels of held-out problems, evaluated before training,
halfway and at the end (8 samples per question at T = 0.6, top-p 0.95); the run prints accuracy before -> after
per level and where the plots, metrics and final model went. Measured runs: docs/LEARNING.md.

RL trains on the 192 easy, medium and hard questions (8 per step: 24 steps per epoch). R³'s mechanisms: easy
questions give all-correct groups and hard ones some all-wrong groups, which CCR repairs with stored answers;
from the second epoch, questions the policy keeps failing get reflection prompts (ISR, 2 slots). SERR ranks
truncated failures, which this budget leaves to out-of-reach chains, held out here: on this task SERR has little
to do unless they are trained on (`--config.data.train` with a file that holds them). Other algorithms and
ablations by override, e.g. `--config.algorithm=grpo`, `--config.rl.r3.replay=False`; `scripts/compare.py` runs
them all.
"""

import os

import ml_collections

from r3jax.data import arith
from r3jax.train import config as run_config

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arith")


def get_config():
    c = run_config.base_config()
    c.algorithm = "r3"
    c.model.path = os.path.join(HERE, "base")
    c.data.train = os.path.join(HERE, "train.jsonl")
    c.data.eval = ml_collections.ConfigDict({name: os.path.join(HERE, f"heldout_{name}.jsonl")
                                             for name in arith.LEVELS})
    c.data.limit = None                # all 192 training questions (64 per trained level)
    c.prompts_per_step = 8
    c.samples_per_prompt = 8
    c.max_new_tokens = 56              # every careful solution up to 5 operations fits; no 8-operation one does
    c.temperature = 0.6
    c.top_p = 1.0
    c.steps = 100
    c.checkpoint_every = 50
    c.eval_every = 50
    c.eval_at_start = True
    c.keep_checkpoints = 1
    # 5e-5 moves the strategy within ~50 steps; held constant it then erodes the arithmetic (docs/LEARNING.md)
    c.rl.learning_rate = 5e-5
    # warm-up over the first 5% of the steps, then cosine decay to 0 at the last one, whatever --config.steps says
    c.rl.warmup_steps = c.get_ref("steps") // 20
    c.rl.total_steps = c.get_ref("steps")
    c.rl.chunk_size = 256
    c.rl.old_logprobs = "sampler"       # the sampler's log-probs are the old policy's: no extra forward pass
    c.rl.r3.max_reflection_prompts = 2
    c.rl.r3.reflection_attempt_tokens = 32
    # a short ISR instruction keeps the byte-level reflection prompts (and every row of the loss) short;
    # the warm start saw this very prompt format (scripts/make_arith_base.py reads it from here)
    c.rl.r3.reflection_instruction = "Find the slip in this attempt and solve it again in \\boxed{}."
    # the paper's protocol: n samples at T = 0.6, top-p 0.95; pass@1 is their mean, solve-none needs n > 1
    c.eval.greedy = False
    c.eval.num_samples = 8
    c.eval.batch_size = 64
    c.grading.timeout_s = 2.0
    c.grading.workers = 1
    return c
