"""New tokens/s of r3jax `generate` vs transformers `generate` (PyTorch, CPU) on the same random weights.

Usage: python bench/sampler.py [--rounds 3] [--cases small medium wide]
Both sample at temperature 1 with no top-k/top-p and no end token, so every row generates exactly
max_new_tokens. Rounds alternate between the two; medians are reported with their spread. One JSON
line per case; the wide case also reports achieved FLOP/s against a jitted matmul timed in the same run.

Each case also times a floor: only the weight matmuls of `new` decode steps at batch B (every projection,
MLP and the vocabulary head, [out, in] weights, chained so nothing is elided), jitted as one loop, and the
same matmuls in torch. `matmul_floor_ratio` = (tokens/s if a decode step cost only its XLA matmuls) /
transformers tokens/s: the highest ratio any XLA sampler could reach on this machine at that shape.
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
from model_forward import matmul_gflops  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from r3jax import model as rm  # noqa: E402
from r3jax.sampling import generate  # noqa: E402

VOCAB, PROMPT = 2048, 32
CASES = {
    "small": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, batch=32, new=128),
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, batch=32, new=128),
    "wide": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=2, num_attention_heads=12,
                 num_key_value_heads=2, batch=16, new=64),
}


def decode_flops_per_token(c: dict, cache_len: float) -> float:
    d, f, n, k, layers = (c[x] for x in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "num_hidden_layers"))
    h = d // n
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f + 2 * n * h * cache_len
    return 2 * (layers * per_layer + d * VOCAB)


def matmul_floor(c: dict, batch: int, steps: int, rounds: int) -> dict:
    """Seconds for `steps` decode steps' weight matmuls alone at [batch, D], XLA and torch, timed alternately."""
    d, f, n, k, layers = (c[x] for x in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "num_hidden_layers"))
    h = d // n
    shapes = [(n * h, d), (k * h, d), (k * h, d), (d, n * h), (f, d), (f, d), (d, f)]
    rng = np.random.RandomState(1)
    weights = [[rng.standard_normal(s).astype(np.float32) * 0.02 for s in shapes] for _ in range(layers)]
    head = rng.standard_normal((VOCAB, d)).astype(np.float32) * 0.02
    x0 = rng.standard_normal((batch, d)).astype(np.float32)

    def step_jax(x, ws, head_w):
        for wq, wk, wv, wo, wg, wu, wd in ws:
            q = x @ wq.T
            kv = (x @ wk.T).sum() + (x @ wv.T).sum()
            x = x + (q @ wo.T) * 1e-3 + kv * 1e-6
            x = x + ((x @ wg.T) * (x @ wu.T)) @ wd.T * 1e-3
        return x + (x @ head_w.T).mean(-1, keepdims=True) * 1e-3

    loop = jax.jit(lambda x, ws, hw: jax.lax.fori_loop(0, steps, lambda _, x: step_jax(x, ws, hw), x))
    ws_j = jax.device_put(weights)
    hw_j = jax.device_put(head)
    loop(x0, ws_j, hw_j).block_until_ready()
    ws_t = [[torch.from_numpy(w) for w in layer] for layer in weights]
    hw_t, x_t = torch.from_numpy(head), torch.from_numpy(x0)

    def torch_loop():
        with torch.no_grad():
            x = x_t
            for _ in range(steps):
                for wq, wk, wv, wo, wg, wu, wd in ws_t:
                    q = x @ wq.T
                    kv = (x @ wk.T).sum() + (x @ wv.T).sum()
                    x = x + (q @ wo.T) * 1e-3 + kv * 1e-6
                    x = x + ((x @ wg.T) * (x @ wu.T)) @ wd.T * 1e-3
                x = x + (x @ hw_t.T).mean(-1, keepdim=True) * 1e-3
        return x

    timed = alternate({"xla": lambda: loop(x0, ws_j, hw_j).block_until_ready(), "torch": torch_loop}, rounds)
    return {name: t["median_s"] for name, t in timed.items()}


def run(name: str, case: dict, rounds: int):
    arch = {k: v for k, v in case.items() if k not in ("batch", "new")}
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=False, **arch)).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        model, _ = rm.load_pretrained(folder)
    b, n = case["batch"], case["new"]
    prompts = np.random.RandomState(0).randint(0, VOCAB, (b, PROMPT))
    mask = np.ones_like(prompts, bool)
    params = rm.split_params(model)
    calls = iter(range(10**6))

    def ours():
        out = generate(params, prompts, mask, jax.random.key(next(calls)), max_new_tokens=n, temperature=1.0)
        jax.block_until_ready(out.tokens)
        assert int(out.lengths.min()) == n

    def theirs():
        with torch.no_grad():
            out = hf.generate(torch.tensor(prompts), attention_mask=torch.tensor(mask.astype(np.int64)),
                              do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=n,
                              min_new_tokens=n, pad_token_id=0)
        assert out.shape[1] == PROMPT + n

    start = time.perf_counter()
    ours()
    compile_s = time.perf_counter() - start
    timed = alternate({"r3jax": ours, "transformers": theirs}, rounds)
    ours_tps, ref_tps = b * n / timed["r3jax"]["median_s"], b * n / timed["transformers"]["median_s"]
    record = {"bench": "sampler", "case": name, "batch": b, "new_tokens": n, "prompt": PROMPT, "vocab": VOCAB,
              **arch, "r3jax_new_tokens_per_s": round(ours_tps, 1),
              "transformers_new_tokens_per_s": round(ref_tps, 1), "ratio": round(ours_tps / ref_tps, 3),
              "r3jax_first_call_s_incl_compile": round(compile_s, 2),
              "r3jax_spread_s": [round(timed["r3jax"]["min_s"], 3), round(timed["r3jax"]["max_s"], 3)],
              "transformers_spread_s": [round(timed["transformers"]["min_s"], 3),
                                        round(timed["transformers"]["max_s"], 3)],
              "torch_threads": torch.get_num_threads()}
    floor = matmul_floor(arch, b, n, rounds)
    record.update(matmul_floor_xla_s=round(floor["xla"], 3), matmul_floor_torch_s=round(floor["torch"], 3),
                  r3jax_s=round(timed["r3jax"]["median_s"], 3),
                  transformers_s=round(timed["transformers"]["median_s"], 3),
                  matmul_floor_ratio=round(timed["transformers"]["median_s"] / floor["xla"], 2))
    if name == "wide":
        gflops = ours_tps * decode_flops_per_token(arch, PROMPT + n / 2) / 1e9
        ref = matmul_gflops(rounds)
        record.update(r3jax_gflops=round(gflops, 1), jitted_matmul_gflops=round(ref, 1),
                      fraction_of_matmul=round(gflops / ref, 3))
    emit(record)


if __name__ == "__main__":
    main_over_cases(CASES, run, default_rounds=3)
