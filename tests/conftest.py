"""Test setup: 8 fake CPU devices (before anything imports jax) and tiny Hugging Face checkpoints."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from r3jax import hosts  # noqa: E402

hosts.size_cpu_thread_pool()  # XLA:CPU threads for several collectives in flight on each of the 8 devices


def write_hf_checkpoint(path, seed=0, **overrides):
    """Writes a random `Qwen2ForCausalLM` (transformers, fp32) to `path`; returns the torch model.

    Biases and norm scales are randomised too (transformers initialises them to 0 and 1, which
    would hide a mix-up between them)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kwargs = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  rope_theta=10000.0, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    theta = kwargs.pop("rope_theta")
    torch.manual_seed(seed)
    config = Qwen2Config(**kwargs, rope_parameters={"rope_type": "default", "rope_theta": theta})
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: hf_checkpoint(**config overrides) -> (folder, torch model)."""
    def make(name="ckpt", **overrides):
        folder = tmp_path / name
        return str(folder), write_hf_checkpoint(folder, **overrides)
    return make


def hf_logits(torch_model, tokens, mask):
    import numpy as np
    import torch

    with torch.no_grad():
        out = torch_model(torch.tensor(np.asarray(tokens)), attention_mask=torch.tensor(np.asarray(mask, np.int64)))
    return out.logits.numpy()
