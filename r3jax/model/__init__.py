"""The Qwen2 model family in Flax NNX, with Hugging Face weights in and out.

Public API: `load_pretrained`, `save_pretrained`, `Qwen2` (call as `model(tokens, attention_mask=mask)`),
`ModelConfig` and its presets, the KV `Cache`, and `token_logprobs_and_entropy`.
"""

from r3jax.model.cache import Cache, init_cache
from r3jax.model.config import ConfigError, ModelConfig, deepseek_r1_distill_qwen_1p5b, small_100m, tiny, tiny_tied
from r3jax.model.head import token_logprobs_and_entropy
from r3jax.model.qwen2 import Qwen2, abstract_model, init_model, merge_params, split_params
from r3jax.model.weights import CheckpointError, abstract_params, load_pretrained, save_pretrained

__all__ = [
    "Cache", "CheckpointError", "ConfigError", "ModelConfig", "Qwen2", "abstract_model", "abstract_params",
    "deepseek_r1_distill_qwen_1p5b", "init_cache", "init_model", "load_pretrained", "merge_params",
    "save_pretrained", "small_100m", "split_params", "tiny", "tiny_tied", "token_logprobs_and_entropy",
]
