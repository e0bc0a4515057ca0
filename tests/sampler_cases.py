"""What the sampler's test files share: a tiny checkpoint, a ragged batch of prompts, a run whose rows end apart."""

import jax
import numpy as np
from conftest import write_hf_checkpoint

from r3jax import model as rm
from r3jax.sampling import sampler

VOCAB = 128


def sampler_checkpoint(tmp_path_factory):
    """(folder, the transformers model, the r3jax model) of a random 2-layer Qwen2 (a module fixture's value)."""
    folder = tmp_path_factory.mktemp("sampler") / "ckpt"
    hf = write_hf_checkpoint(folder, seed=7, num_hidden_layers=2, rope_theta=1e6)
    model, _ = rm.load_pretrained(folder)
    return str(folder), hf, model


def prompts():
    """A left-padded batch of prompts of lengths 6, 3 and 1."""
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, VOCAB, (3, 6))
    mask = np.ones((3, 6), bool)
    mask[1, :3] = False
    mask[2, :5] = False
    tokens[~mask] = 0
    return tokens, mask


def ragged_run(model, slots, budget=14, **kw):
    """Six prompts x 3 samples with end tokens common enough that lengths spread from 1 to the budget."""
    tokens, mask = prompts()
    tokens, mask = np.concatenate([tokens, tokens[::-1]]), np.concatenate([mask, mask[::-1]])
    return sampler.decode(model, tokens, mask, jax.random.key(31), max_new_tokens=budget, num_samples=3,
                          eos_ids=tuple(range(3, 128, 9)), slots=slots, **kw)
