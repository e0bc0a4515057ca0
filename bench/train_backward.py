"""Training forward+backward tokens/s: r3jax's policy log-prob gradient vs PyTorch, and the matmul rate.

Usage: python bench/train_backward.py [--rounds 3] [--cases medium wide]
r3jax: jitted `value_and_grad` of sum(sequence_logprobs * mask) over every parameter (the forward and
backward the train step runs per micro-batch, entropy included, fp32). PyTorch: `Qwen2ForCausalLM` forward
with labels (cross-entropy) and `.backward()`, on the same weights and tokens.

Each system runs in its own process: the driver writes one random Qwen2ForCausalLM (torch seed 0,
`save_pretrained`) and the token batch into a temp folder per case, then starts
`python bench/train_backward.py --worker r3jax|torch` on it. Each worker loads the folder, runs one call
(r3jax's includes compiling) and waits on stdin; per round the driver asks each in turn for one timed call,
the first system rotating every round, so only one computes at a time. After each round the r3jax worker
also times a jitted [2048, 1536] x [1536, 8960] matmul, the reference for `fraction_of_matmul` = r3jax's
achieved FLOP/s (6 x forward matmul FLOPs per token) over the matmul's; `torch_fraction_of_matmul` the
same for PyTorch. The record also has the load averages before and after the timed rounds and the CPU other
processes used during them (`other_cpu_cores_busy`, ours excluded), and per system every call's time, user
and system CPU seconds and minor page faults (the worker's getrusage around the call).

After the rounds each worker also times the call's matmuls alone (`dot_list`, `dot_floor`): every product of
the forward and backward, each at its fastest operand layout, summed. `dot_floor_s` gives XLA's (jitted
`dot_general`, the r3jax worker) and PyTorch's (`torch.bmm`); `dot_floor_ratio` = PyTorch's whole call / XLA's
floor. Below 1, no XLA program reaches PyTorch's time at this shape on this machine: XLA's dots alone, at
their best layouts and with nothing else to do, take longer than PyTorch's forward and backward.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import case_parser, emit, protocol_out, serve  # noqa: E402
from workers import Worker, cpu_ticks, process_ticks, pytest_pids  # noqa: E402

CASES = {
    "medium": dict(cfg=dict(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2), batch=16, seq=256),
    "wide": dict(cfg=dict(vocab_size=2048, hidden_size=1536, intermediate_size=8960, num_hidden_layers=2,
                          num_attention_heads=12, num_key_value_heads=2), batch=4, seq=512),
}
MATMUL_M, MATMUL_K, MATMUL_N = 2048, 1536, 8960  # the reference matmul's [M, K] x [K, N]


# ------------------------------------------------------------------------------------------------ dot floor


def dot_list(cfg: dict, batch: int, seq: int) -> list[dict]:
    """Every matmul of one forward + backward at this shape, as [b, m, k] x [b, k, n] products: each projection,
    the MLP and the head forward (x W), and their input and weight gradients (dY Wᵀ, Xᵀ dY); attention's two
    forward products (scores, weighted values) and four backward ones, queries grouped per key-value head.
    `count` is how often a call runs it; attention's is halved (causal: a kernel may skip the masked half), so
    the list's FLOPs are 3 x `forward_flops_per_token` x tokens exactly."""
    d, f, v, n, k, layers = (cfg[x] for x in ("hidden_size", "intermediate_size", "vocab_size",
                                              "num_attention_heads", "num_key_value_heads", "num_hidden_layers"))
    h, tokens, g = d // n, batch * seq, n // k
    dots = []
    for name, (i, o, count) in {"q": (d, n * h, layers), "k,v": (d, k * h, 2 * layers), "o": (n * h, d, layers),
                                "gate,up": (d, f, 2 * layers), "down": (f, d, layers), "head": (d, v, 1)}.items():
        for part, (m, kk, nn) in {"fwd": (tokens, i, o), "dx": (tokens, o, i), "dw": (i, tokens, o)}.items():
            dots.append({"name": f"{name} {part}", "b": 1, "m": m, "k": kk, "n": nn, "count": count})
    rows, queries = batch * k, g * seq
    for name, (m, kk, nn) in {"scores": (queries, h, seq), "values": (queries, seq, h),
                              "d probs": (queries, h, seq), "d values": (seq, queries, h),
                              "d queries": (queries, seq, h), "d keys": (seq, queries, h)}.items():
        dots.append({"name": f"attention {name}", "b": rows, "m": m, "k": kk, "n": nn, "count": layers / 2})
    return dots


def dot_floor(dots: list[dict], timer, reps: int = 5) -> dict:
    """Each dot timed alone in every operand layout (A as [m, k] or [k, m], B as [k, n] or [n, k]; median of
    `reps` calls after two warm-ups), its best layout kept. timer(b, m, k, n, a_t, b_t) returns a callable that
    runs the product once and blocks. floor_s = sum of count x best time: the matmul time of a call whose every
    dot ran at its best standalone layout and nothing else took time."""
    total, rows = 0.0, []
    for dot in dots:
        b, m, k, n = dot["b"], dot["m"], dot["k"], dot["n"]
        best = None
        for a_t in (False, True):
            for b_t in (False, True):
                fn = timer(b, m, k, n, a_t, b_t)
                fn(), fn()
                times = []
                for _ in range(reps):
                    start = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - start)
                s = statistics.median(times)
                if best is None or s < best[0]:
                    best = (s, a_t, b_t)
        total += best[0] * dot["count"]
        rows.append({**dot, "best_ms": round(best[0] * 1e3, 3), "a_transposed": best[1], "b_transposed": best[2],
                     "gflops": round(2 * b * m * k * n / best[0] / 1e9, 1)})
    return {"floor_s": round(total, 4), "dots": rows}


def _operands(b, m, k, n, a_t, b_t):
    import numpy as np

    rng = np.random.RandomState(0)
    a = rng.standard_normal((b, k, m) if a_t else (b, m, k)).astype(np.float32)
    w = rng.standard_normal((b, n, k) if b_t else (b, k, n)).astype(np.float32)
    return a, w


def xla_timer(b, m, k, n, a_t, b_t):
    """One jitted `dot_general` over operands stored in the given layouts."""
    import jax

    a, w = (jax.device_put(x) for x in _operands(b, m, k, n, a_t, b_t))
    numbers = (((1 if a_t else 2,), (2 if b_t else 1,)), ((0,), (0,)))
    product = jax.jit(lambda a, w: jax.lax.dot_general(a, w, numbers))
    return lambda: product(a, w).block_until_ready()


def torch_timer(b, m, k, n, a_t, b_t):
    """`torch.bmm` over transposed views of operands stored in the given layouts (what autograd hands it)."""
    import torch

    a, w = (torch.from_numpy(x) for x in _operands(b, m, k, n, a_t, b_t))
    a, w = (a.transpose(1, 2) if a_t else a), (w.transpose(1, 2) if b_t else w)
    return lambda: torch.bmm(a, w).numpy()


# ---------------------------------------------------------------------------------------------------- workers


def rusage() -> dict:
    """This process's CPU seconds and page faults so far (the driver diffs them around each timed call)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"user_s": r.ru_utime, "sys_s": r.ru_stime, "minor_faults": r.ru_minflt}


ENTROPY_WEIGHT = 1e-3  # r3jax's objective: sum(logp) + this x sum(entropy), so the entropy's backward runs too


def r3jax_call(folder: str, remat: str):
    """r3jax's timed call on the folder's weights and tokens. call() runs the jitted value_and_grad of
    sum(logp) + ENTROPY_WEIGHT x sum(entropy) and returns ((objective, sum(logp)), grads)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from r3jax import model as rm
    from r3jax.rl import loss

    model, _ = rm.load_pretrained(folder, remat=remat)
    graphdef, params = nnx.split(model)
    tokens = np.load(os.path.join(folder, "tokens.npy"))
    mask = np.ones(tokens.shape, bool)

    @jax.jit
    def grad(params, tokens, mask):
        def objective(params):
            logp, ent = loss.sequence_logprobs(nnx.merge(graphdef, params), tokens, mask, mask)
            return jnp.sum(logp) + ENTROPY_WEIGHT * jnp.sum(ent), jnp.sum(logp)
        return jax.value_and_grad(objective, has_aux=True)(params)

    args = (params, jnp.asarray(tokens), jnp.asarray(mask))
    return lambda: grad(*args)


def torch_call(folder: str):
    """PyTorch's timed call on the same folder. call() zeroes the gradients, runs the forward with labels (mean
    cross-entropy over the B x (T - 1) next tokens) and its backward, and returns (loss, model)."""
    import numpy as np
    import torch
    from transformers import Qwen2ForCausalLM

    hf = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    ids = torch.tensor(np.load(os.path.join(folder, "tokens.npy")))

    def step():
        hf.zero_grad(set_to_none=True)
        out = hf(input_ids=ids, labels=ids).loss
        out.backward()
        return out, hf

    return step


def worker_r3jax(out, folder: str, remat: str) -> None:
    start = time.perf_counter()
    import jax
    import jax.numpy as jnp

    call = r3jax_call(folder, remat)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(call())
    first_s = time.perf_counter() - start
    mm = jax.jit(lambda a, b: a @ b)
    a, b = jnp.ones((MATMUL_M, MATMUL_K)), jnp.ones((MATMUL_K, MATMUL_N))
    mm(a, b).block_until_ready()
    serve(out, {"go": lambda: jax.block_until_ready(call()), "matmul": lambda: mm(a, b).block_until_ready()},
          {"rusage": rusage, "dot_floor": lambda dots: dot_floor(dots, xla_timer)},
          {"ready": True, "load_s": round(load_s, 2), "first_call_s_incl_compile": round(first_s, 2),
           "versions": {"jax": jax.__version__}})


def worker_torch(out, folder: str) -> None:
    start = time.perf_counter()
    import torch
    import transformers

    step = torch_call(folder)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    step()
    first_s = time.perf_counter() - start
    serve(out, {"go": step}, {"rusage": rusage, "dot_floor": lambda dots: dot_floor(dots, torch_timer)},
          {"ready": True, "load_s": round(load_s, 2), "first_call_s": round(first_s, 2),
           "torch_threads": torch.get_num_threads(),
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__}})


# ----------------------------------------------------------------------------------------------------- driver


def write_folder(folder: str, case: dict) -> None:
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **case["cfg"])).save_pretrained(folder)
    tokens = np.random.RandomState(0).randint(0, case["cfg"]["vocab_size"], (case["batch"], case["seq"]))
    np.save(os.path.join(folder, "tokens.npy"), tokens)


def summary(times: list) -> dict:
    return {"median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3),
            "max_s": round(max(times), 3), "times_s": [round(t, 3) for t in times]}


def run(name: str, case: dict, rounds: int, remat: str) -> dict:
    b, t = case["batch"], case["seq"]
    record = {"bench": "train_backward", "case": name, "batch": b, "seq": t, **case["cfg"], "rounds": rounds,
              "remat": remat}
    me = os.path.abspath(__file__)
    tick = os.sysconf("SC_CLK_TCK")
    with tempfile.TemporaryDirectory(prefix="train_backward_bench_") as folder:
        write_folder(folder, case)
        workers = {}
        try:
            for system in ("r3jax", "torch"):
                workers[system] = Worker(system, [sys.executable, me, "--worker", system, "--folder", folder,
                                                           *(["--remat", remat] if system == "r3jax" else [])],
                                         os.path.join(folder, f"{system}.log"))
            ours = {os.getpid(), *(w.proc.pid for w in workers.values())}
            pytest_seen = set(pytest_pids(ours))
            names = list(workers)
            times = {k: [] for k in names}
            idle = dict.fromkeys(names, 0)
            per_call = {k: {"user_s": [], "sys_s": [], "minor_faults": []} for k in names}
            matmul = []
            record["loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
            ticks0, wall0 = cpu_ticks(ours), time.perf_counter()
            for r in range(rounds):
                for system in names[r % len(names):] + names[:r % len(names)]:
                    before = {k: process_ticks(w.proc.pid) for k, w in workers.items() if k != system}
                    usage = workers[system].ask("rusage")
                    times[system].append(workers[system].ask("go")["s"])
                    usage = {k: v - usage[k] for k, v in workers[system].ask("rusage").items()}
                    for k, v in usage.items():
                        per_call[system][k].append(v)
                    for k, ticks in before.items():
                        idle[k] += process_ticks(workers[k].proc.pid) - ticks
                matmul.append(workers["r3jax"].ask("matmul")["s"])  # between rounds, torch idle
            dots = dot_list(case["cfg"], b, t)
            floors = {k: w.ask("dot_floor", dots=dots) for k, w in workers.items()}  # one at a time
            ticks1, wall1 = cpu_ticks(ours), time.perf_counter()
            record["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            pytest_seen |= set(pytest_pids(ours))
            other = (ticks1[0] - ticks0[0]) - (ticks1[1] - ticks0[1])
            record["other_cpu_cores_busy"] = round(other / tick / (wall1 - wall0), 2)
            record["pytest_procs_seen"] = len(pytest_seen)
        finally:
            for worker in workers.values():
                worker.close()
    from model_forward import forward_flops_per_token  # imports jax and torch: only once the workers are gone

    ready = {k: w.ready for k, w in workers.items()}
    ours_s, theirs_s = statistics.median(times["r3jax"]), statistics.median(times["torch"])
    flops = 3 * forward_flops_per_token(case["cfg"], t) * b * t
    ref = 2 * MATMUL_M * MATMUL_K * MATMUL_N / statistics.median(matmul) / 1e9
    record.update({
        "r3jax_s": round(ours_s, 3), "torch_s": round(theirs_s, 3),
        "r3jax_tokens_per_s": round(b * t / ours_s, 1), "torch_tokens_per_s": round(b * t / theirs_s, 1),
        "ratio": round(theirs_s / ours_s, 3), "target": ">= 1.0 and fraction_of_matmul >= 0.8",
        "fraction_of_matmul": round(flops / ours_s / 1e9 / ref, 3),
        "torch_fraction_of_matmul": round(flops / theirs_s / 1e9 / ref, 3),
        "jitted_matmul_gflops": round(ref, 1), "matmul_s": summary(matmul),
        "dot_floor_s": {k: f["floor_s"] for k, f in floors.items()},
        "dot_floor_ratio": round(theirs_s / floors["r3jax"]["floor_s"], 3),
        "dot_floor_ms": {x["name"]: [x["best_ms"], y["best_ms"]]
                         for x, y in zip(floors["r3jax"]["dots"], floors["torch"]["dots"], strict=True)},
        "r3jax_first_call_s_incl_compile": ready["r3jax"]["first_call_s_incl_compile"],
        "torch_first_call_s": ready["torch"]["first_call_s"], "torch_threads": ready["torch"]["torch_threads"],
        **{k: {**summary(times[k]), **{f"{u}_per_call": [round(v, 2) for v in per_call[k][u]] for u in per_call[k]},
               "cpu_s_while_others_timed": round(idle[k] / tick, 2), "load_s": ready[k]["load_s"]} for k in names},
        "versions": {**ready["r3jax"]["versions"], **ready["torch"]["versions"]}})
    emit(record)
    return record


def main() -> None:
    parser = case_parser(CASES, default_rounds=3)
    parser.add_argument("--worker", choices=["r3jax", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--remat", default="dots", choices=("none", "dots", "full"),
                        help="r3jax's per-layer rematerialisation (default: the training config's, model.remat)")
    args = parser.parse_args()
    if args.worker == "r3jax":
        worker_r3jax(protocol_out(), args.folder, args.remat)
        return
    if args.worker == "torch":
        worker_torch(protocol_out(), args.folder)
        return
    for name in args.cases:
        run(name, CASES[name], args.rounds, args.remat)


if __name__ == "__main__":
    main()
