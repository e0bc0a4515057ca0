"""New tokens/s of r3jax `generate` vs transformers `generate` (PyTorch, CPU) vs Tunix's `Sampler`, same random weights.

Usage: python bench/sampler.py [--rounds 3] [--cases small medium wide] [--tunix_python /work/venvs/tunix/bin/python]
       [--greedy_steps 8] [--torch_threads N]

Each system runs in its own process, so none shares an interpreter, thread pools or allocator with another:
the driver writes one Qwen2ForCausalLM (`save_pretrained`, safetensors) and the prompts into a temp folder
per case, then starts a worker per system on that folder: `python bench/sampler.py --worker r3jax|transformers`
with this Python, and bench/sampler_tunix.py with --tunix_python (google-tunix==0.1.7 needs safetensors<0.8,
hence transformers 5.12.1: its own virtualenv). Workers start one after another, load, and warm up with one
full call (compile included); then each waits on stdin. Per round the driver asks each worker in turn to
time one call (the starting system rotates every round), so only one system computes at a time while the
others sit idle on stdin. Without --tunix_python, Tunix is skipped: "tunix": null and a "tunix_note".

All sample at temperature 1 with no top-k/top-p and no end token, so every row generates exactly
max_new_tokens (Tunix: top_p=1.0, which it runs as a plain categorical draw). One JSON line per case: per
system median/min/max seconds and new tokens/s, the ratios, the greedy tokens' agreement with transformers
over the first few steps, the 1/5/15-minute load averages before and after the timed rounds, and the CPU
that other processes used during them (cores busy, from /proc, ours excluded), plus any pytest seen running;
per system, "cpu_s_while_others_timed" checks that an idle worker really stays idle.

Each case also times a floor: only the weight matmuls of a call, its prefill (B x prompt tokens through
every projection and MLP, the vocabulary head on each prompt's last token) and `new` decode steps at batch B
(every projection, MLP and the head), chained so nothing is elided, jitted as one loop in the r3jax worker, and the
same matmuls in torch in the transformers worker, each with the weights stored [out, in] and [in, out]
(`matmul_floor_by_layout_s`); each system's floor is its faster layout. `matmul_floor_ratio` = (tokens/s if
a decode step cost only its XLA matmuls) / transformers tokens/s: the highest ratio any XLA sampler could
reach on this machine at that shape. The wide case also reports r3jax's achieved FLOP/s against a jitted
matmul timed in the r3jax worker.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import case_parser, check_python, emit, protocol_out, serve  # noqa: E402
from workers import Worker, alternate_workers, cpu_ticks, pytest_pids  # noqa: E402

VOCAB, PROMPT = 2048, 32
CASES = {
    "small": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, batch=32, new=128),
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, batch=32, new=128),
    "wide": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=2, num_attention_heads=12,
                 num_key_value_heads=2, batch=16, new=64),
}
ARCH_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
MATMUL_M, MATMUL_K, MATMUL_N = 2048, 1536, 8960  # the reference matmul's [M, K] x [K, N]


def decode_flops_per_token(c: dict, cache_len: float) -> float:
    d, f, n, k, layers = (c[x] for x in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "num_hidden_layers"))
    h = d // n
    per_layer = d * n * h + 2 * d * k * h + n * h * d + 3 * d * f + 2 * n * h * cache_len
    return 2 * (layers * per_layer + d * VOCAB)


def floor_weights(c: dict, batch: int):
    """Random [out, in] weights of every layer's projections and MLP, the head, and the prefill's input:
    [batch x PROMPT, D], the prompts' tokens of every row."""
    import numpy as np

    d, f, n, k, layers = (c[x] for x in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "num_hidden_layers"))
    h = d // n
    shapes = [(n * h, d), (k * h, d), (k * h, d), (d, n * h), (f, d), (f, d), (d, f)]
    rng = np.random.RandomState(1)
    weights = [[rng.standard_normal(s).astype(np.float32) * 0.02 for s in shapes] for _ in range(layers)]
    head = rng.standard_normal((VOCAB, d)).astype(np.float32) * 0.02
    return weights, head, rng.standard_normal((batch * PROMPT, d)).astype(np.float32)


FLOOR_LAYOUTS = ("out_in", "in_out")  # the floor's weights as stored by HF's Linear ([out, in]) or transposed


def in_out(weights: list, head):
    """`floor_weights`' weights and head transposed to [in, out] (contiguous copies)."""
    import numpy as np

    return [[np.ascontiguousarray(w.T) for w in layer] for layer in weights], np.ascontiguousarray(head.T)


def floor_step(x, layers, head, keepdims: dict, layout: str = "out_in", head_rows: int | None = None):
    """One step's weight matmuls, chained; works on jax arrays and torch tensors alike. layout: how the weights
    are stored, [out, in] (read as w.T) or [in, out]. head_rows: only the last rows reach the head (and the
    result), as in a prefill, where only each prompt's last token is sampled from."""
    mm = (lambda x, w: x @ w.T) if layout == "out_in" else (lambda x, w: x @ w)
    for wq, wk, wv, wo, wg, wu, wd in layers:
        q = mm(x, wq)
        kv = mm(x, wk).sum() + mm(x, wv).sum()
        x = x + mm(q, wo) * 1e-3 + kv * 1e-6
        x = x + mm(mm(x, wg) * mm(x, wu), wd) * 1e-3
    x = x if head_rows is None else x[-head_rows:]
    return x + mm(x, head).mean(-1, **keepdims) * 1e-3


def floor_call(x, layers, head, keepdims: dict, layout: str, steps: int, loop):
    """A call's weight matmuls: the prefill's (`floor_weights`' input), then `steps` decode steps at the batch
    (the prefill's last rows, one per prompt) in loop(steps, body, x)."""
    rows = x.shape[0] // PROMPT
    x = floor_step(x, layers, head, keepdims, layout, head_rows=rows)
    return loop(steps, lambda x: floor_step(x, layers, head, keepdims, layout), x)


# ---------------------------------------------------------------------------------------------------- workers


def worker_r3jax(out, folder: str, case: dict, _threads: int | None) -> None:
    start = time.perf_counter()
    import jax
    import numpy as np

    from r3jax import model as rm
    from r3jax.sampling import generate
    from r3jax.sampling import parts as sampling_parts

    model, _ = rm.load_pretrained(folder)
    params = rm.split_params(model)
    prompts = np.load(os.path.join(folder, "prompts.npy"))
    mask = np.ones_like(prompts, bool)
    new = case["new"]
    calls = iter(range(10**6))
    load_s = time.perf_counter() - start

    def sample(steps: int, temperature: float):
        result = generate(params, prompts, mask, jax.random.key(next(calls)), max_new_tokens=steps,
                       temperature=temperature)
        jax.block_until_ready(result.tokens)
        assert int(result.lengths.min()) == steps
        return result

    weights, head, x0 = floor_weights(case, prompts.shape[0])
    stored = {"out_in": (weights, head), "in_out": in_out(weights, head)}
    floors = {}
    for layout in FLOOR_LAYOUTS:
        loop = jax.jit(functools.partial(
            floor_call, keepdims={"keepdims": True}, layout=layout, steps=new,
            loop=lambda steps, body, x: jax.lax.fori_loop(0, steps, lambda _, x: body(x), x)))
        ws_j, hw_j = jax.device_put(stored[layout])
        floors[f"floor_{layout}"] = functools.partial(lambda loop, ws, hw: loop(x0, ws, hw).block_until_ready(),
                                                      loop, ws_j, hw_j)
    mm = jax.jit(lambda a, b: a @ b)
    a, b = jax.numpy.ones((MATMUL_M, MATMUL_K)), jax.numpy.ones((MATMUL_K, MATMUL_N))

    start = time.perf_counter()
    sample(new, 1.0)
    first_s = time.perf_counter() - start
    for floor in floors.values():
        floor()
    mm(a, b).block_until_ready()
    serve(out, {"generate": lambda: sample(new, 1.0), **floors,
                "matmul": lambda: mm(a, b).block_until_ready()},
          {"greedy": lambda steps: {"tokens": np.asarray(sample(steps, 0.0).tokens).tolist()}},
          {"ready": True, "load_s": round(load_s, 2), "first_call_s_incl_compile": round(first_s, 2),
           # how many programs generate split each call into (`parts.auto_parts`: one per core for small models)
           "parts": sampling_parts.auto_parts(prompts, params[1], model.config),
           "versions": {"jax": jax.__version__}})


def worker_transformers(out, folder: str, case: dict, threads: int | None) -> None:
    start = time.perf_counter()
    import numpy as np
    import torch
    import transformers
    from transformers import Qwen2ForCausalLM

    if threads:
        torch.set_num_threads(threads)

    hf = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = torch.tensor(np.load(os.path.join(folder, "prompts.npy")))
    mask = torch.ones_like(prompts)
    new = case["new"]
    load_s = time.perf_counter() - start

    def sample(steps: int, greedy: bool):
        with torch.no_grad():
            kw = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
            result = hf.generate(prompts, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                 pad_token_id=0, **kw)
        assert result.shape[1] == prompts.shape[1] + steps
        return result[:, prompts.shape[1]:]

    weights, head, x0 = floor_weights(case, prompts.shape[0])
    stored = {"out_in": (weights, head), "in_out": in_out(weights, head)}
    x_t = torch.from_numpy(x0)

    def loop(steps, body, x):
        for _ in range(steps):
            x = body(x)
        return x

    def floor(layout: str):
        ws_t = [[torch.from_numpy(w) for w in layer] for layer in stored[layout][0]]
        hw_t = torch.from_numpy(stored[layout][1])

        def run():
            with torch.no_grad():
                return floor_call(x_t, ws_t, hw_t, {"keepdim": True}, layout, new, loop)
        return run

    floors = {f"floor_{layout}": floor(layout) for layout in FLOOR_LAYOUTS}

    start = time.perf_counter()
    sample(new, greedy=False)
    first_s = time.perf_counter() - start
    for run in floors.values():
        run()
    serve(out, {"generate": lambda: sample(new, greedy=False), **floors},
          {"greedy": lambda steps: {"tokens": sample(steps, greedy=True).tolist()}},
          {"ready": True, "load_s": round(load_s, 2), "first_call_s_incl_compile": round(first_s, 2),
           "torch_threads": torch.get_num_threads(),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__}})


# ----------------------------------------------------------------------------------------------------- driver


def summary(times: list, tokens: int) -> dict:
    med = statistics.median(times)
    return {"new_tokens_per_s": round(tokens / med, 1), "median_s": round(med, 3), "min_s": round(min(times), 3),
            "max_s": round(max(times), 3), "times_s": [round(t, 3) for t in times]}


def agreement(ours: list, ref: list) -> dict:
    flat = [a == b for row_a, row_b in zip(ours, ref, strict=True) for a, b in zip(row_a, row_b, strict=True)]
    return {"tokens_equal": round(sum(flat) / len(flat), 4),
            "rows_equal": round(sum(a == b for a, b in zip(ours, ref, strict=True)) / len(ref), 4)}


def write_folder(folder: str, arch: dict, batch: int) -> None:
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=False, **arch)).eval().save_pretrained(folder)
    np.save(os.path.join(folder, "prompts.npy"), np.random.RandomState(0).randint(0, VOCAB, (batch, PROMPT)))


def run(name: str, case: dict, args) -> dict:
    arch = {k: case[k] for k in ARCH_KEYS}
    b, n = case["batch"], case["new"]
    record = {"bench": "sampler", "case": name, "batch": b, "new_tokens": n, "prompt": PROMPT, "vocab": VOCAB,
              **arch, "sampling": "temperature 1, no top-k/top-p, no end token", "rounds": args.rounds,
              "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    me = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory(prefix="sampler_bench_") as folder:
        write_folder(folder, arch, b)
        case_arg = ["--case", name, "--folder", folder]
        workers = {}
        try:
            workers["r3jax"] = Worker("r3jax", [sys.executable, me, "--worker", "r3jax", *case_arg],
                                      os.path.join(folder, "r3jax.log"))
            threads = ["--torch_threads", str(args.torch_threads)] if args.torch_threads else []
            workers["transformers"] = Worker("transformers", [sys.executable, me, "--worker", "transformers",
                                                              *case_arg, *threads],
                                             os.path.join(folder, "transformers.log"))
            if args.tunix_python:
                env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
                workers["tunix"] = Worker("tunix", [args.tunix_python, os.path.join(os.path.dirname(me),
                                                                                     "sampler_tunix.py"),
                                                    "--folder", folder, "--new", str(n)],
                                          os.path.join(folder, "tunix.log"), env=env)
            ours = {os.getpid(), *(w.proc.pid for w in workers.values())}
            pytest_seen = set(pytest_pids(ours))
            record["loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
            ticks0, wall0 = cpu_ticks(ours), time.perf_counter()
            idle = {}
            times = alternate_workers(workers, "generate", args.rounds, idle)
            ticks1, wall1 = cpu_ticks(ours), time.perf_counter()
            record["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            pytest_seen |= set(pytest_pids(ours))
            other = (ticks1[0] - ticks0[0]) - (ticks1[1] - ticks0[1])
            record["other_cpu_cores_busy"] = round(other / os.sysconf("SC_CLK_TCK") / (wall1 - wall0), 2)
            record["pytest_procs_seen"] = len(pytest_seen)
            for sys_name, worker in workers.items():
                record[sys_name] = {**summary(times[sys_name], b * n),
                                    "cpu_s_while_others_timed": round(idle[sys_name] / os.sysconf("SC_CLK_TCK"), 2),
                                    **{k: v for k, v in worker.ready.items() if k != "ready"}}
            if not args.tunix_python:
                record["tunix"] = None
                record["tunix_note"] = "skipped: no --tunix_python (google-tunix==0.1.7 needs its own virtualenv)"
            tps = {k: record[k]["new_tokens_per_s"] for k in workers}
            record["ratio_r3jax_over_transformers"] = round(tps["r3jax"] / tps["transformers"], 3)
            if "tunix" in tps:
                record["ratio_r3jax_over_tunix"] = round(tps["r3jax"] / tps["tunix"], 3)
                record["ratio_tunix_over_transformers"] = round(tps["tunix"] / tps["transformers"], 3)

            steps = min(args.greedy_steps, n)
            greedy = {k: w.ask("greedy", steps=steps)["tokens"] for k, w in workers.items()}
            record["greedy_agreement_with_transformers"] = {
                "steps": steps, **{k: agreement(greedy[k], greedy["transformers"]) for k in workers
                                   if k != "transformers"}}

            pair = {k: workers[k] for k in ("r3jax", "transformers")}
            floor = {layout: {k: statistics.median(v)
                              for k, v in alternate_workers(pair, f"floor_{layout}", args.rounds).items()}
                     for layout in FLOOR_LAYOUTS}
            floor_xla = min(f["r3jax"] for f in floor.values())
            floor_torch = min(f["transformers"] for f in floor.values())
            record.update(matmul_floor_xla_s=round(floor_xla, 3), matmul_floor_torch_s=round(floor_torch, 3),
                          matmul_floor_ratio=round(record["transformers"]["median_s"] / floor_xla, 2),
                          matmul_floor_by_layout_s={layout: {"xla": round(f["r3jax"], 3),
                                                             "torch": round(f["transformers"], 3)}
                                                    for layout, f in floor.items()})
            if name == "wide":
                mm = alternate_workers({"r3jax": workers["r3jax"]}, "matmul", args.rounds)["r3jax"]
                ref = 2 * MATMUL_M * MATMUL_K * MATMUL_N / statistics.median(mm) / 1e9
                gflops = tps["r3jax"] * decode_flops_per_token(arch, PROMPT + n / 2) / 1e9
                record.update(r3jax_gflops=round(gflops, 1), jitted_matmul_gflops=round(ref, 1),
                              fraction_of_matmul=round(gflops / ref, 3))
        finally:
            for worker in workers.values():
                worker.close()
    emit(record)
    return record


TUNIX_VENV = ('python3 -m venv /work/venvs/tunix && /work/venvs/tunix/bin/pip install google-tunix==0.1.7 '
              '"safetensors<0.8" torch==2.13.0')


def main() -> None:
    parser = case_parser(CASES, default_rounds=3)
    parser.add_argument("--tunix_python", default=None,
                        help="Python of a virtualenv with google-tunix==0.1.7; Tunix is skipped without it")
    parser.add_argument("--greedy_steps", type=int, default=8,
                        help="greedy tokens each system decodes once, compared with transformers'")
    parser.add_argument("--torch_threads", type=int, default=None,
                        help="torch.set_num_threads in the transformers worker (default: torch's own choice)")
    parser.add_argument("--worker", choices=["r3jax", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        out = protocol_out()
        worker = {"r3jax": worker_r3jax, "transformers": worker_transformers}[args.worker]
        worker(out, args.folder, CASES[args.case], args.torch_threads)
        return
    if args.tunix_python:  # before any case: each takes minutes
        check_python(args.tunix_python, ("tunix", "jax", "safetensors"), "--tunix_python", TUNIX_VENV)
    for name in args.cases:
        run(name, CASES[name], args)


if __name__ == "__main__":
    main()
