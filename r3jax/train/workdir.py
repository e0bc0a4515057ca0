"""A `train.py` workdir as a policy to evaluate (`eval.py --model WORKDIR`): its latest checkpoint, built the way
the run built its model (its config.json, tokenizer and Orbax checkpoints). Here, on the training side, so that
`r3jax.eval` does not depend on how training stores its runs."""

from __future__ import annotations

import json
import os

import jax
import ml_collections

from r3jax import model as rm
from r3jax.data import prompts
from r3jax.eval import policy
from r3jax.model import sharding
from r3jax.train import checkpoint, setup
from r3jax.train import config as run_config


def load_policy(path: str, *, mesh=None) -> policy.Policy:
    """`policy.load_policy` that also takes a train.py workdir (config.json + checkpoints/), at its latest complete
    checkpoint; raises `policy.PolicyError`."""
    path = os.path.abspath(path)
    if not policy.is_workdir(path):
        return policy.load_policy(path, mesh=mesh)
    try:
        return _from_workdir(path, mesh)
    except (rm.CheckpointError, rm.ConfigError, prompts.TokenizerError, OSError, ValueError) as e:
        raise policy.PolicyError(f"--model {path}: {e}") from e


def _from_workdir(path: str, mesh) -> policy.Policy:
    with open(os.path.join(path, "config.json")) as f:
        c = ml_collections.ConfigDict(json.load(f))
    tokenizer = prompts.load_tokenizer(run_config.tokenizer_path(c))
    config = setup.model_config(c, tokenizer)
    ckpt = checkpoint.Checkpointer(os.path.join(path, "checkpoints"), keep=c.keep_checkpoints, async_save=False)
    step = ckpt.latest_step()
    if step is None:
        raise policy.PolicyError(f"--model {path}: the workdir has no complete checkpoint yet")
    dtype = jax.numpy.dtype(c.model.dtype)
    graphdef, abstract = rm.split_params(rm.abstract_model(config, param_dtype=dtype, mesh=mesh,
                                                           dtype=jax.numpy.dtype(c.model.compute_dtype or dtype)))
    shardings = None if mesh is None else sharding.param_shardings(abstract, mesh, "sample")
    params = ckpt.restore_params(step, abstract, shardings)
    ckpt.close()
    return policy.Policy(rm.merge_params(graphdef, params), tokenizer,
                         {"path": path, "kind": "train_workdir", "step": step})
