"""The 1.5B preset's abstract parameter tree matches Hugging Face tensor for tensor (nothing allocated)."""

from r3jax import model as rm
from r3jax.model import weights


def test_preset_has_exactly_the_hf_tensor_shapes():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = rm.deepseek_r1_distill_qwen_1p5b()
    hf_config = Qwen2Config(**{k: v for k, v in cfg.to_dict().items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        hf = Qwen2ForCausalLM(hf_config)
    hf_shapes = {name: tuple(p.shape) for name, p in hf.state_dict().items()}
    ours = weights._expected_tensors(cfg, rm.abstract_params(cfg))
    assert {name: shape for name, (_, _, _, shape) in ours.items()} == hf_shapes


def test_preset_has_1_777_088_000_parameters():
    cfg = rm.deepseek_r1_distill_qwen_1p5b()
    assert weights.param_count(rm.abstract_params(cfg, param_dtype="bfloat16")) == 1_777_088_000
    assert cfg.num_params() == 1_777_088_000
