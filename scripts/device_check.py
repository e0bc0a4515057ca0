"""One command to check the attention plan on a GPU or TPU at hand (under 5 minutes): one JSON line per case.

    python scripts/device_check.py                       # the platform's backends, the paper's lengths
    python scripts/device_check.py --rows 1 --prompt 1024 --response 8192 --samples 8

Cases, per backend the platform runs (`attention_plan`: "xla" everywhere, "splash" on TPU, "cudnn" on GPU):
- parity: the backend's causal self-attention against the XLA path (`attention.attend_causal`), values and
  gradients at real positions, on padded bf16 and fp32 rows (what tests/test_attention_backends.py checks on a
  CPU through interpreters); parity-prefixed: the same for rows that continue a shared prompt, on the backends
  that `attention_plan.shares_prompts` (against `attention.attend_shared_prefix`);
- train: one step of a 1.5B-shaped model with 2 layers (bf16, remat "dots") on rows of prompt + response
  tokens: the policy's teacher-forced log-probs, their gradient and an AdamW update, compiled once, then
  timed (median of --rounds);
- sample (once, the sampler's attention is the cached XLA path on every platform): `generate` at the paper's
  budget from --prompts prompts x --samples samples.
On a CPU it runs too, at whatever lengths are given (the XLA backend only).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from r3jax import model as rm  # noqa: E402
from r3jax.model import attention, attention_plan, cudnn, splash  # noqa: E402
from r3jax.rl import loss  # noqa: E402
from r3jax.sampling import generate  # noqa: E402

KERNELS = {"tpu": ("xla", "splash"), "gpu": ("xla", "cudnn"), "cpu": ("xla",)}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def timed(fn, rounds: int) -> dict:
    jax.block_until_ready(fn())  # compiles
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def backend_fn(backend: str, platform: str, prefixed: bool = False):
    """The backend's causal self-attention (prefixed: its form for rows that continue a shared prompt), with
    the kernels in an interpreter where the platform cannot run them."""
    if prefixed:
        if backend == "splash":
            return functools.partial(splash.attend_prefixed, interpret=platform != "tpu")
        return attention.attend_shared_prefix
    if backend == "splash":
        return functools.partial(splash.attend_causal, interpret=platform != "tpu")
    if backend == "cudnn":
        return functools.partial(cudnn.attend_causal, implementation="cudnn" if platform == "gpu" else "xla")
    return attention.attend_causal


def parity(backend: str, platform: str, dtype, prefixed: bool = False) -> dict:
    """The backend against the XLA path at real positions: causal self-attention over [B, T] rows, or
    (prefixed) 2 groups of 2 rows over a 300-slot prompt each, then causally over their own keys."""
    rng = np.random.RandomState(0)
    b, t, n, k, h, p = (4, 700, 12, 2, 128, 300) if prefixed else (2, 1000, 12, 2, 128, 0)
    arrays = [(b, t, n, h), (b, k, t, h), (b, k, t, h)] + [(b // 2, k, p, h)] * 2 * prefixed
    q, kk, v, *prefix_kv = (jnp.asarray(rng.randn(*s), dtype) for s in arrays)
    mask = np.ones((b, t), bool)
    mask[1, :123], mask[1, 600:] = False, False  # a training row: [padding | real | padding]
    mask = jnp.asarray(mask)
    prefix_mask = jnp.asarray(np.arange(p)[None, :] >= np.array([[0], [57]]))  # the second prompt left-padded
    g = jnp.asarray(rng.randn(b, t, n, h), dtype) * mask[:, :, None, None]

    def vjp(fn):  # the inputs are arguments, not constants the compiler would fold
        @jax.jit
        def run(q, kk, v, mask, g, *prefix_kv):
            if prefixed:
                call = lambda q, k, v, pk, pv: fn(q, pk, pv, k, v, prefix_mask, mask)  # noqa: E731
            else:
                call = lambda q, k, v: fn(q, k, v, mask)  # noqa: E731
            out, pull = jax.vjp(call, q, kk, v, *prefix_kv)
            return out, pull(g)
        return run(q, kk, v, mask, g, *prefix_kv)

    want = vjp(backend_fn("xla", platform, prefixed))  # the XLA path
    got = vjp(backend_fn(backend, platform, prefixed))
    real = np.asarray(mask)[:, :, None, None]
    err = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))  # noqa: E731
    out_err = float(np.max(np.where(real, np.abs(np.asarray(got[0], np.float32) - np.asarray(want[0], np.float32)),
                                    0)))
    grad_err = max(err(a, b) for a, b in zip(got[1], want[1], strict=True))
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-4
    return {"case": "parity-prefixed" if prefixed else "parity", "backend": backend, "dtype": jnp.dtype(dtype).name,
            "max_abs_out": out_err, "max_abs_grad": grad_err, "finite": bool(jnp.isfinite(got[0]).all()),
            "ok": out_err < tol and grad_err < tol * 10}


def model_config(vocab: int = 151936):
    return rm.ModelConfig(vocab_size=vocab, hidden_size=1536, intermediate_size=8960, num_hidden_layers=2,
                          num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=False,
                          eos_token_id=151643, dtype="bfloat16")


def train_case(backend: str, args) -> dict:
    cfg, b, tp, t = model_config(args.vocab), args.rows, args.prompt, args.response
    m = rm.init_model(cfg, param_dtype=jnp.float32, dtype=jnp.bfloat16, remat="dots", attention=backend)
    graphdef, params = rm.split_params(m)
    rng = np.random.RandomState(1)
    tokens = jnp.asarray(rng.randint(3, cfg.vocab_size, (b, tp + t)), jnp.int32)
    mask = np.ones((b, tp + t), bool)
    mask[:, : tp // 4] = False                        # left-padded prompts
    response = np.zeros_like(mask)
    response[:, tp:tp + (3 * t) // 4] = True          # responses that end before the budget
    mask[:, tp + (3 * t) // 4:] = False
    mask, response = jnp.asarray(mask), jnp.asarray(response)
    tx = optax.adamw(1e-6)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt):
        def objective(p):
            logp, _ = loss.sequence_logprobs(rm.merge_params(graphdef, p), tokens, mask, response, chunk_size=1024)
            return -jnp.sum(logp) / jnp.sum(response)
        value, grads = jax.value_and_grad(objective)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    timing = timed(lambda: step(params, opt), args.rounds)
    return {"case": "train", "backend": backend, "rows": b, "positions": tp + t, "layers": 2,
            "tokens_per_s": b * (tp + t) / timing["median_s"], **timing}


def sample_case(args) -> dict:
    m = rm.init_model(model_config(args.vocab), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    prompts = jnp.asarray(np.random.RandomState(2).randint(3, args.vocab, (args.prompts, args.prompt)), jnp.int32)
    run = lambda: generate(m, prompts, jnp.ones_like(prompts, bool), jax.random.key(0),  # noqa: E731
                           max_new_tokens=args.response, num_samples=args.samples, temperature=1.0).tokens
    timing = timed(run, max(1, args.rounds // 2))
    rows = args.prompts * args.samples
    return {"case": "sample", "rows": rows, "prompt": args.prompt, "max_new_tokens": args.response, "layers": 2,
            "tokens_per_s": rows * args.response / timing["median_s"], **timing}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1, help="training rows per step")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt positions (the paper: up to 1,024)")
    parser.add_argument("--response", type=int, default=8192, help="response budget (the paper: 8,192)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary rows (the 1.5B model's by default)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["parity", "train", "sample"])
    args = parser.parse_args()
    platform = attention_plan.platform_of()
    plan = attention_plan.plan()
    emit({"case": "plan", "device": jax.devices()[0].device_kind, **plan.as_dict()})
    ok = True
    for backend in KERNELS.get(platform, ("xla",)):
        if "parity" not in args.skip:
            for dtype, prefixed in itertools.product((jnp.float32, jnp.bfloat16), (False, True)):
                if prefixed and not attention_plan.shares_prompts(backend):
                    continue
                record = parity(backend, platform, dtype, prefixed)
                ok &= record["ok"]
                emit(record)
        if "train" not in args.skip:
            emit(train_case(backend, args))
    if "sample" not in args.skip:
        emit(sample_case(args))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
