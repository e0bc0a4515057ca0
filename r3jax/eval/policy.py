"""The model `eval.py` evaluates: a Hugging Face folder, or a `train.py` workdir at its latest checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import ml_collections

from r3jax import model as rm
from r3jax.data import prompts
from r3jax.model import sharding


class PolicyError(ValueError):
    """A --model that cannot be loaded; the message says what was found."""


@dataclasses.dataclass
class Policy:
    model: rm.Qwen2
    tokenizer: object
    identity: dict        # {"path", "kind": "huggingface" | "train_workdir", "step"}


def is_workdir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "checkpoints")) and os.path.isfile(os.path.join(path, "config.json"))


def load_policy(path: str, *, mesh=None) -> Policy:
    """Loads `path` for sampling (`sharding_mode="sample"` on a mesh); raises PolicyError."""
    path = os.path.abspath(path)
    try:
        if is_workdir(path):
            return _from_workdir(path, mesh)
        if os.path.isfile(os.path.join(path, "config.json")):
            model, _ = rm.load_pretrained(path, mesh=mesh, sharding_mode="sample")
            return Policy(model, prompts.load_tokenizer(path), {"path": path, "kind": "huggingface", "step": None})
    except (rm.CheckpointError, rm.ConfigError, prompts.TokenizerError, OSError, ValueError) as e:
        raise PolicyError(f"--model {path}: {e}") from e
    raise PolicyError(f"--model {path}: neither a Hugging Face folder (config.json + safetensors) nor a train.py "
                      "workdir (config.json + checkpoints/)")


def _from_workdir(path: str, mesh) -> Policy:
    from r3jax.train import checkpoint, setup  # the training side knows how its runs are built
    from r3jax.train import config as run_config

    with open(os.path.join(path, "config.json")) as f:
        c = ml_collections.ConfigDict(json.load(f))
    tokenizer = prompts.load_tokenizer(run_config.tokenizer_path(c))
    config = setup.model_config(c, tokenizer)
    ckpt = checkpoint.Checkpointer(os.path.join(path, "checkpoints"), keep=c.keep_checkpoints, async_save=False)
    step = ckpt.latest_step()
    if step is None:
        raise PolicyError(f"--model {path}: the workdir has no complete checkpoint yet")
    dtype = jax.numpy.dtype(c.model.dtype)
    graphdef, abstract = rm.split_params(rm.abstract_model(config, param_dtype=dtype, mesh=mesh,
                                                           dtype=jax.numpy.dtype(c.model.compute_dtype or dtype)))
    shardings = None if mesh is None else sharding.param_shardings(abstract, mesh, "sample")
    params = ckpt.restore_params(step, abstract, shardings)
    ckpt.close()
    return Policy(rm.merge_params(graphdef, params), tokenizer, {"path": path, "kind": "train_workdir", "step": step})
