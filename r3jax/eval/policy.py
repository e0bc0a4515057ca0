"""The model `eval.py` evaluates: a Hugging Face folder (a `train.py` workdir is read on the training side,
`r3jax.train.workdir`, which returns the same `Policy`)."""

from __future__ import annotations

import dataclasses
import os

from r3jax import model as rm
from r3jax.data import prompts


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
    """Loads the Hugging Face folder `path` for sampling (`sharding_mode="sample"` on a mesh); raises PolicyError
    (also for a train.py workdir: `r3jax.train.workdir.load_policy` reads those)."""
    path = os.path.abspath(path)
    if is_workdir(path):
        raise PolicyError(f"--model {path}: a train.py workdir; load it with r3jax.train.workdir.load_policy")
    try:
        if os.path.isfile(os.path.join(path, "config.json")):
            model, _ = rm.load_pretrained(path, mesh=mesh, sharding_mode="sample")
            return Policy(model, prompts.load_tokenizer(path), {"path": path, "kind": "huggingface", "step": None})
    except (rm.CheckpointError, rm.ConfigError, prompts.TokenizerError, OSError, ValueError) as e:
        raise PolicyError(f"--model {path}: {e}") from e
    raise PolicyError(f"--model {path}: neither a Hugging Face folder (config.json + safetensors) nor a train.py "
                      "workdir (config.json + checkpoints/)")
