"""Training forward+backward tokens/s: r3jax's policy log-prob gradient vs PyTorch, and the matmul rate.

Usage: python bench/train_backward.py [--rounds 3] [--cases medium wide]
r3jax: jitted `value_and_grad` of sum(sequence_logprobs * mask) over every parameter (the forward and
backward the train step runs per micro-batch, entropy included, fp32). PyTorch: `Qwen2ForCausalLM` forward
with labels (cross-entropy) and `.backward()`, on the same weights and tokens. Both alternate round by round.
`fraction_of_matmul` = r3jax's achieved FLOP/s (6 x forward matmul FLOPs per token) over a jitted
[2048, 1536] x [1536, 8960] matmul timed in the same run; `torch_fraction_of_matmul` the same for PyTorch.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from r3jax import allocator  # noqa: E402

allocator.use_huge_pages()  # every system in this process gets huge pages (re-executes once)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import alternate, emit, main_over_cases  # noqa: E402
from flax import nnx  # noqa: E402
from model_forward import forward_flops_per_token, matmul_gflops  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from r3jax import model as rm  # noqa: E402
from r3jax.rl import loss  # noqa: E402

CASES = {
    "medium": dict(cfg=dict(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2), batch=16, seq=256),
    "wide": dict(cfg=dict(vocab_size=2048, hidden_size=1536, intermediate_size=8960, num_hidden_layers=2,
                          num_attention_heads=12, num_key_value_heads=2), batch=4, seq=512),
}


def run(name: str, case: dict, rounds: int):
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **case["cfg"])).train()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        model, _ = rm.load_pretrained(folder)
    graphdef, params = nnx.split(model)
    b, t = case["batch"], case["seq"]
    tokens = np.random.RandomState(0).randint(0, case["cfg"]["vocab_size"], (b, t))
    mask = np.ones((b, t), bool)

    @jax.jit
    def grad(params, tokens, mask):
        def objective(params):
            logp, ent = loss.sequence_logprobs(nnx.merge(graphdef, params), tokens, mask, mask)
            return jnp.sum(logp) + 1e-3 * jnp.sum(ent)
        return jax.value_and_grad(objective)(params)

    args = (params, jnp.asarray(tokens), jnp.asarray(mask))
    start = time.perf_counter()
    jax.block_until_ready(grad(*args))
    compile_s = time.perf_counter() - start
    ids = torch.tensor(tokens)

    def theirs():
        hf.zero_grad(set_to_none=True)
        hf(input_ids=ids, labels=ids).loss.backward()

    start = time.perf_counter()
    theirs()
    torch_first_s = time.perf_counter() - start
    times = alternate({"r3jax": lambda: jax.block_until_ready(grad(*args)), "torch": theirs}, rounds)
    ours_s, theirs_s = times["r3jax"]["median_s"], times["torch"]["median_s"]
    flops = 3 * forward_flops_per_token(case["cfg"], t) * b * t
    ref = matmul_gflops(rounds)
    emit({"bench": "train_backward", "case": name, "batch": b, "seq": t, **case["cfg"],
          "r3jax_s": round(ours_s, 3), "torch_s": round(theirs_s, 3),
          "r3jax_tokens_per_s": round(b * t / ours_s, 1), "torch_tokens_per_s": round(b * t / theirs_s, 1),
          "ratio": round(theirs_s / ours_s, 3), "target": ">= 1.0 and fraction_of_matmul >= 0.8",
          "fraction_of_matmul": round(flops / ours_s / 1e9 / ref, 3),
          "torch_fraction_of_matmul": round(flops / theirs_s / 1e9 / ref, 3),
          "jitted_matmul_gflops": round(ref, 1), "r3jax_first_call_s_incl_compile": round(compile_s, 2),
          "torch_first_call_s": round(torch_first_s, 2), "torch_threads": torch.get_num_threads()})


if __name__ == "__main__":
    main_over_cases(CASES, run, default_rounds=3)
