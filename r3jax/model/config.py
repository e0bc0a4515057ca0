"""The Qwen2 architecture as a frozen dataclass whose field names are `config.json` keys."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2",)


class ConfigError(ValueError):
    """A config.json that r3jax cannot run faithfully (wrong architecture, unsupported feature, bad value)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen2 decoder. Field names mirror Hugging Face's `config.json`.

    Only what changes the computation is kept; `from_dict` ignores bookkeeping keys
    (`architectures`, `transformers_version`, ...) and rejects features r3jax does not implement.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    dtype: str = "float32"  # the checkpoint's storage dtype (`torch_dtype` in older files)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ConfigError(f"head dim {self.hidden_size // self.num_attention_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def num_params(self) -> int:
        d, f, v, h = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        q, kv = self.num_attention_heads * h, self.num_key_value_heads * h
        per_layer = d * q + q + 2 * (d * kv + kv) + q * d + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_hidden_layers * per_layer + d + head

    # --- config.json interop -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> ModelConfig:
        """Builds a config from a parsed config.json, accepting transformers 4.x and 5.x spellings."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {model_type!r} is not supported; r3jax implements "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        if raw.get("use_sliding_window"):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported (r3jax implements full "
                              "causal attention only)")
        if any(t != "full_attention" for t in raw.get("layer_types") or ()):
            raise ConfigError(f"{source}: layer_types {raw['layer_types']!r} asks for non-full attention, "
                              "which r3jax does not implement")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (Qwen2 uses 'silu')")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (only 'default' RoPE)")
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim")
        if head_dim is not None and head_dim != raw["hidden_size"] // heads:
            raise ConfigError(f"{source}: head_dim {head_dim} != hidden_size / num_attention_heads; "
                              "Qwen2 ties them")
        eos = raw.get("eos_token_id")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        )

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> ModelConfig:
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"missing file: {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """The config.json that `transformers.Qwen2ForCausalLM` loads (5.x spelling plus `rope_theta`)."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "dtype": self.dtype,
            "torch_dtype": self.dtype,
            "attention_dropout": 0.0,
        }


# --- presets ---------------------------------------------------------------------------------------

def deepseek_r1_distill_qwen_1p5b() -> ModelConfig:
    """deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B (1,777,088,000 parameters)."""
    return ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                       tie_word_embeddings=False, max_position_embeddings=131072, bos_token_id=151646,
                       eos_token_id=151643, dtype="bfloat16")


def tiny(**overrides) -> ModelConfig:
    """A 2-layer model for unit tests (GQA 4:2, untied head)."""
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, bos_token_id=1,
                eos_token_id=2)
    return ModelConfig(**{**base, **overrides})


def tiny_tied(**overrides) -> ModelConfig:
    """A 1-layer model with a tied output head and multi-query attention (4:1)."""
    return tiny(**{"num_hidden_layers": 1, "num_key_value_heads": 1, "tie_word_embeddings": True,
                   "rope_theta": 1e6, **overrides})


def small_100m(**overrides) -> ModelConfig:
    """About 100M parameters with the real 1.5B head geometry (head dim 128, 6:1 GQA), for load benchmarks."""
    return tiny(**{"vocab_size": 32768, "hidden_size": 768, "intermediate_size": 2816,
                   "num_hidden_layers": 8, "num_attention_heads": 6, "num_key_value_heads": 1, **overrides})
