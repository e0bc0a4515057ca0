"""Tunix worker for bench/sampler.py: Tunix's `Sampler` on Tunix's Qwen2, run with Tunix's own Python.

Usage (the driver starts it): /work/venvs/tunix/bin/python bench/sampler_tunix.py --folder HF_DIR --new N
google-tunix==0.1.7 needs safetensors<0.8 and so transformers 5.12.1, so it lives in its own virtualenv
and cannot import r3jax; this file imports only Tunix, JAX, numpy and the stdlib helpers in common.py.

HF_DIR is a Qwen2ForCausalLM folder written by `save_pretrained` (config.json, model.safetensors) plus
prompts.npy ([B, Tp] int ids). Weights load through Tunix's safetensors loader. Tunix's sampler takes
strings, so a tokenizer of space-separated ids stands in (pad -1 and end -2, ids the model never emits:
every row samples exactly N tokens). Sampling is temperature 1 with top_p=1.0, no top-k, which Tunix
runs as a plain categorical draw; "greedy" runs its argmax mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import protocol_out, serve  # noqa: E402

PAD, NEVER = -1, -2


class IdTokenizer:
    """Strings of space-separated token ids; the interface Tunix's TokenizerAdapter asks of a tokenizer."""

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(t)) for t in ids)

    def bos_id(self):
        return None

    def eos_id(self) -> int:
        return NEVER

    def pad_id(self) -> int:
        return PAD


def tunix_config(folder: str):
    from tunix.models.qwen2 import model as tq

    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    heads = hf["num_attention_heads"]
    return tq.ModelConfig(num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
                          embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"], num_heads=heads,
                          head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                          num_kv_heads=hf["num_key_value_heads"], rope_theta=theta, norm_eps=hf["rms_norm_eps"],
                          use_tied_embedding=bool(hf.get("tie_word_embeddings", False)))


def main() -> None:
    out = protocol_out()
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--new", type=int, required=True)
    args = parser.parse_args()

    start = time.perf_counter()
    import jax
    import numpy as np
    import tunix
    from tunix.generate import sampler as tsampler
    from tunix.models.qwen2 import params as tparams

    config = tunix_config(args.folder)
    model = tparams.create_model_from_safe_tensors(args.folder, config)
    prompts = np.load(os.path.join(args.folder, "prompts.npy"))
    batch, prompt_len = prompts.shape
    cache = tsampler.CacheConfig(cache_size=prompt_len + args.new, num_layers=config.num_layers,
                                 num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    sampler = tsampler.Sampler(model, IdTokenizer(), cache)
    texts = [" ".join(str(int(t)) for t in row) for row in prompts]
    seeds = iter(range(10**6))
    load_s = time.perf_counter() - start

    def sample(steps: int, greedy: bool):
        result = sampler(texts, max_generation_steps=steps, max_prompt_length=prompt_len, echo=False,
                         eos_tokens=[NEVER], temperature=0.0 if greedy else 1.0, top_p=None if greedy else 1.0,
                         seed=next(seeds))
        assert len(result.tokens) == batch and all(len(t) == steps for t in result.tokens), \
            [len(t) for t in result.tokens]
        return result

    start = time.perf_counter()
    sample(args.new, greedy=False)
    first_s = time.perf_counter() - start

    def greedy(steps: int) -> dict:
        return {"tokens": np.asarray(sample(steps, greedy=True).tokens).tolist()}

    serve(out, {"generate": lambda: sample(args.new, greedy=False)}, {"greedy": greedy},
          {"ready": True, "load_s": round(load_s, 2), "first_call_s_incl_compile": round(first_s, 2),
           "versions": {"tunix": getattr(tunix, "__version__", None), "jax": jax.__version__},
           "devices": str(jax.devices())})


if __name__ == "__main__":
    main()
