"""Full-forward tokens/s of r3jax (jitted, fp32) vs transformers (PyTorch, CPU) on the same random weights.

Usage: python bench/model_forward.py [--rounds 5]
Prints one JSON line per config with both throughputs, their ratio, and r3jax's compile time.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import alternate, emit, main_over_cases  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from r3jax import model as rm  # noqa: E402

CASES = {
    "tiny": dict(cfg=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2), batch=16, seq=256),
    "wide1536_2l": dict(cfg=dict(vocab_size=2048, hidden_size=1536, intermediate_size=8960, num_hidden_layers=2,
                                 num_attention_heads=12, num_key_value_heads=2), batch=4, seq=512),
}


def forward_flops_per_token(cfg: dict, seq: int) -> float:
    """Matmul FLOPs of one token's forward: projections, MLP, head, and causal attention (avg seq/2 keys)."""
    d, f, v, n, k = (cfg[x] for x in ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
                                      "num_key_value_heads"))
    h = d // n
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f + 2 * n * h * seq / 2
    return 2 * (cfg["num_hidden_layers"] * per_layer + d * v)


def matmul_gflops(rounds: int) -> float:
    """Reference: a jitted fp32 [2048, 1536] x [1536, 8960] matmul on this machine, now."""
    x, w = jax.numpy.ones((2048, 1536)), jax.numpy.ones((1536, 8960))
    mm = jax.jit(lambda x, w: x @ w)
    mm(x, w).block_until_ready()
    timed = alternate({"mm": lambda: mm(x, w).block_until_ready()}, rounds)
    return 2 * 2048 * 1536 * 8960 / timed["mm"]["median_s"] / 1e9


def run(name, case, rounds):
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**case["cfg"], tie_word_embeddings=False)).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        model, _ = rm.load_pretrained(folder)
    graphdef, params = rm.split_params(model)
    forward = jax.jit(lambda p, t: rm.merge_params(graphdef, p)(t))
    tokens = np.random.RandomState(0).randint(0, case["cfg"]["vocab_size"], (case["batch"], case["seq"]))
    tokens_pt = torch.tensor(tokens)

    start = time.perf_counter()
    forward(params, tokens).block_until_ready()
    compile_s = time.perf_counter() - start

    def hf_forward():
        with torch.no_grad():
            hf(tokens_pt, use_cache=False)

    timed = alternate({"r3jax": lambda: forward(params, tokens).block_until_ready(), "transformers": hf_forward},
                      rounds)
    n = tokens.size
    ours, ref = n / timed["r3jax"]["median_s"], n / timed["transformers"]["median_s"]
    gflops = ours * forward_flops_per_token(case["cfg"], case["seq"]) / 1e9
    reference_gflops = matmul_gflops(rounds)
    emit({"bench": "model_forward", "case": name, "batch": case["batch"], "seq": case["seq"], **case["cfg"],
          "dtype": "float32", "r3jax_tokens_per_s": round(ours), "transformers_tokens_per_s": round(ref),
          "ratio": round(ours / ref, 3), "r3jax_compile_s": round(compile_s, 2),
          "r3jax_gflops": round(gflops, 1), "jitted_matmul_gflops": round(reference_gflops, 1),
          "fraction_of_matmul": round(gflops / reference_gflops, 3),
          "r3jax_spread_s": [round(timed["r3jax"]["min_s"], 4), round(timed["r3jax"]["max_s"], 4)],
          "transformers_spread_s": [round(timed["transformers"]["min_s"], 4),
                                    round(timed["transformers"]["max_s"], 4)],
          "torch_threads": torch.get_num_threads()})


if __name__ == "__main__":
    main_over_cases(CASES, run, default_rounds=5)
