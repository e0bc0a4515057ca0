"""Causal key-block skipping on the XLA path: one layer's attention forward + backward, skipping vs dense.

Usage: python bench/causal_attention.py [--rounds 3] [--cases t1024 t2048 t4096]
Both run on the same [B, T, 12, 128] queries over [B, 2, T, 128] keys and values (the 1.5B model's heads, fp32,
rows left-padded by T / 8): `attention.attend_causal` in one block of T queries (every key read, the upper
triangle masked: dense) and in blocks of `attention.CAUSAL_BLOCK` (block i reads keys up to its diagonal). Prints
one JSON line per case: each median time, `speedup` = dense / skipping, and the share of the [T, T] scores the
blocks compute (`scores_read`).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import alternate, emit, main_over_cases  # noqa: E402

from r3jax.model import attention  # noqa: E402

CASES = {"t1024": dict(batch=2, seq=1024), "t2048": dict(batch=1, seq=2048), "t4096": dict(batch=1, seq=4096)}


def run(name: str, case: dict, rounds: int) -> None:
    b, t, n, k, h = case["batch"], case["seq"], 12, 2, 128
    rng = np.random.RandomState(0)
    q, kk, v = (jnp.asarray(rng.randn(*s), jnp.float32) for s in ((b, t, n, h), (b, k, t, h), (b, k, t, h)))
    mask = jnp.asarray(np.arange(t)[None, :] >= t // 8).repeat(b, 0)
    g = jnp.asarray(rng.randn(b, t, n, h), jnp.float32) * mask[:, :, None, None]

    def fwd_bwd(fn):
        @jax.jit
        def step(q, kk, v):
            out, pull = jax.vjp(lambda q, kk, v: fn(q, kk, v), q, kk, v)
            return out, pull(g)
        return lambda: jax.block_until_ready(step(q, kk, v))

    dense = fwd_bwd(lambda q, kk, v: attention.attend_causal(q, kk, v, mask, query_block=t))
    skipping = fwd_bwd(lambda q, kk, v: attention.attend_causal(q, kk, v, mask))
    dense(), skipping()  # compile
    times = alternate({"dense": dense, "skipping": skipping}, rounds)
    spans = attention._causal_spans(t, attention.CAUSAL_BLOCK)
    emit({"bench": "causal_attention", "case": name, "batch": b, "seq": t, "causal_block": attention.CAUSAL_BLOCK,
          "dense_s": times["dense"]["median_s"], "skipping_s": times["skipping"]["median_s"],
          "speedup": times["dense"]["median_s"] / times["skipping"]["median_s"],
          "scores_read": sum((end - first) * end for first, end in spans) / (t * t), "times": times})


if __name__ == "__main__":
    main_over_cases(CASES, run, default_rounds=3)
