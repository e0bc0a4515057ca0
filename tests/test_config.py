import json

import pytest

from r3jax import model as rm
from r3jax.model.config import ConfigError, ModelConfig

BASE = dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def test_rope_theta_read_from_either_spelling():
    old = ModelConfig.from_dict({**BASE, "rope_theta": 1e6, "torch_dtype": "bfloat16"})
    new = ModelConfig.from_dict({**BASE, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
                                 "dtype": "bfloat16"})
    assert old == new
    assert new.rope_theta == 1e6 and new.dtype == "bfloat16"


def test_unknown_bookkeeping_keys_are_ignored():
    cfg = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "transformers_version": "5"})
    assert cfg.head_dim == 16


@pytest.mark.parametrize("bad, fragment", [
    ({"model_type": "llama"}, "model_type 'llama'"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope type 'yarn'"),
    ({"num_key_value_heads": 3}, "not divisible"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_configs_are_rejected_by_name(bad, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ModelConfig.from_dict({**BASE, **bad})


def test_missing_required_field_is_named():
    raw = dict(BASE)
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_dict(raw)


def test_to_dict_round_trips(tmp_path):
    cfg = rm.deepseek_r1_distill_qwen_1p5b()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert ModelConfig.from_json_file(tmp_path / "config.json") == cfg


def test_transformers_reads_our_config_json(tmp_path):
    from transformers import AutoConfig

    cfg = rm.tiny_tied()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert (hf.hidden_size, hf.num_key_value_heads, hf.tie_word_embeddings) == (64, 1, True)
    assert hf.rope_parameters["rope_theta"] == 1e6
