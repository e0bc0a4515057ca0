"""Evaluate a model with the DeepScaleR / R³ protocol: n samples per question, Pass@1 averaged, unbiased Pass@k.

    python eval.py --model runs/r3 --benchmarks aime24,amc,math500,minerva,olympiad --data_dir data/test \
        --num_samples 16 --max_new_tokens 8192,16384,32768 --temperature 0.6 --top_p 0.95 --output evals/r3
    python eval.py --model /models/DeepSeek-R1-Distill-Qwen-1.5B --data aime.json amc.json --output evals/base

--model is a Hugging Face folder or a train.py workdir (its latest checkpoint). Rerunning the same command
resumes. Several --max_new_tokens values reuse one sampling pass at the largest. Writes DIR/settings.json,
DIR/samples.jsonl (one row per sample), DIR/results.json (computed from samples.jsonl alone), DIR/pass_at_k.png,
and prints the table. The work is done by `r3jax.eval`; this file wires.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

# --benchmarks names -> file stems in --data_dir (rllm's test files)
PRESETS = {"aime24": "aime", "amc": "amc", "math500": "math", "minerva": "minerva", "olympiad": "olympiad_bench",
           "gsm8k": "gsm8k", "aime25": "aime25"}


def fail(message: str) -> None:
    print(f"eval.py: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def ints(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face folder or train.py workdir")
    p.add_argument("--data", nargs="+", default=[], help="problem files; a benchmark's name is its file stem")
    p.add_argument("--benchmarks", default="", help=f"comma-separated presets from --data_dir: {sorted(PRESETS)}")
    p.add_argument("--data_dir", default="data/test", help="folder of the preset files (rllm's layout)")
    p.add_argument("--num_samples", type=int, default=16)
    p.add_argument("--max_new_tokens", type=ints, default=[32768], help="one budget, or several (a sweep)")
    p.add_argument("--temperature", type=float, default=0.6, help="0 decodes greedily")
    p.add_argument("--top_p", type=float, default=0.95)
    p.add_argument("--output", required=True)
    p.add_argument("--limit", type=int, default=None, help="first K questions of each benchmark")
    p.add_argument("--on_error", choices=("raise", "skip"), default="raise", help="a malformed row of a benchmark "
                   "file: stop, naming the file and line (raise), or leave it out, counted in results.json (skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pass_k", type=ints, default=None, help="default: 1, 2, 4, ... up to num_samples")
    p.add_argument("--batch_size", type=int, default=None, help="questions per sampler call (default by platform)")
    p.add_argument("--slots", type=int, default=0, help="rows decoding at once within a sampler call; a finished "
                   "row's slot goes to the next waiting row (0: all rows of the call; the samples are the same)")
    p.add_argument("--timeout_s", type=float, default=5.0, help="grading time limit per answer")
    p.add_argument("--compilation_cache", default="~/.cache/r3jax/xla", help="XLA's persistent compilation cache "
                   "(train.py's default): a rerun compiles nothing; '' turns it off, JAX_COMPILATION_CACHE_DIR wins")
    hosts = p.add_argument_group("several hosts (the same command on each; --output a folder they share)")
    hosts.add_argument("--distributed", action="store_true", help="join the other hosts with jax.distributed, "
                       "found by JAX's cluster detection (TPU VMs, SLURM, Open MPI)")
    hosts.add_argument("--coordinator_address", default=None,
                       help="HOST:PORT of process 0 (or JAX_COORDINATOR_ADDRESS)")
    hosts.add_argument("--num_processes", type=int, default=None,
                       help="processes in the run (or JAX_NUM_PROCESSES)")
    hosts.add_argument("--process_id", type=int, default=None, help="this process's index (or JAX_PROCESS_ID)")
    hosts.add_argument("--heartbeat_timeout_s", type=int, default=100, help="a process silent this long is dead")
    return p.parse_args(argv)


def data_files(args) -> dict[str, str]:
    files = {pathlib.Path(f).stem: f for f in args.data}
    for name in filter(None, (b.strip() for b in args.benchmarks.split(","))):
        if name not in PRESETS:
            fail(f"--benchmarks: unknown preset {name!r}; one of {sorted(PRESETS)}")
        files[name] = str(pathlib.Path(args.data_dir) / f"{PRESETS[name]}.json")
    if not files:
        fail("no benchmark: give --data FILE [FILE ...] or --benchmarks with --data_dir")
    for name, path in files.items():
        if not os.path.isfile(path):
            fail(f"benchmark {name}: no file {path!r}")
    return files


def check_values(args) -> None:
    """Settings that are wrong on their own, each in one line before anything loads."""
    for name, ok, what in (("num_samples", args.num_samples >= 1, "a positive integer"),
                           ("temperature", args.temperature >= 0, ">= 0 (0: greedy)"),
                           ("top_p", 0 < args.top_p <= 1, "in (0, 1]"),
                           ("limit", args.limit is None or args.limit >= 1, "a positive integer"),
                           ("batch_size", args.batch_size is None or args.batch_size >= 1, "a positive integer"),
                           ("slots", args.slots >= 0, ">= 0"),
                           ("timeout_s", args.timeout_s > 0, "> 0 seconds")):
        if not ok:
            fail(f"--{name} must be {what}, got {getattr(args, name)}")
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        fail(f"--output {args.output!r} is a file, not a folder")


def main(argv=None) -> int:
    args = parse_args(argv)
    files = data_files(args)
    check_values(args)
    pass_k = args.pass_k or [2 ** i for i in range(args.num_samples.bit_length()) if 2 ** i <= args.num_samples]
    if max(pass_k) > args.num_samples:
        fail(f"--num_samples {args.num_samples} is smaller than the largest --pass_k {max(pass_k)}")
    if args.temperature == 0 and args.num_samples > 1:
        print("eval.py: temperature 0 is greedy: all samples of a question are the same", file=sys.stderr)

    import jax
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from r3jax import compiles, hosts, rewards
    from r3jax.data import problems as data_problems
    from r3jax.eval import benchmark, policy, report
    from r3jax.model import sharding
    from r3jax.train import workdir

    compiles.use_persistent_cache(args.compilation_cache)
    compiles.start_counting()
    try:
        hosts.initialize(args.coordinator_address, args.num_processes, args.process_id, auto=args.distributed,
                         heartbeat_timeout_s=args.heartbeat_timeout_s)
    except hosts.DistributedError as e:
        fail(str(e))
    main_process = hosts.is_main()
    output = pathlib.Path(args.output)
    mesh = sharding.make_mesh(data=1, fsdp=-1, tensor=1)
    try:
        loaded = workdir.load_policy(args.model, mesh=mesh)  # a Hugging Face folder or a train.py workdir
        benches = [benchmark.load_benchmark(n, f, loaded.tokenizer, limit=args.limit, on_error=args.on_error)
                   for n, f in files.items()]
    except (policy.PolicyError, data_problems.DataError, OSError) as e:
        fail(str(e))
    devices = mesh.shape["data"] * mesh.shape["fsdp"]
    default_batch = {"cpu": 8, "gpu": 64, "tpu": 128}.get(jax.default_backend(), 32)
    batch_size = args.batch_size or -(-default_batch // devices) * devices
    settings = benchmark.EvalSettings(max_new_tokens=max(args.max_new_tokens), num_samples=args.num_samples,
                                      temperature=args.temperature, top_p=args.top_p, batch_size=batch_size,
                                      seed=args.seed, slots=args.slots)
    recorded = {"data": files, "num_samples": args.num_samples, "max_new_tokens": args.max_new_tokens,
                "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, "limit": args.limit,
                "batch_size": batch_size, "pass_k": pass_k, "model": loaded.identity,
                **({"skipped_rows": {b.name: len(b.skipped) for b in benches if b.skipped}}
                   if any(b.skipped for b in benches) else {})}
    for b in benches if main_process else ():
        if b.skipped:
            print(f"eval.py: {benchmark.skipped_note(b.name, files[b.name], b.skipped)}", file=sys.stderr, flush=True)
    try:
        report.check_settings(output, recorded, write=main_process)
    except report.ReportError as e:
        fail(str(e))
    hosts.barrier("eval settings checked")  # the others read what process 0 found

    plans = {b.name: benchmark.plan(b, batch_size) for b in benches}
    expected = {(name, p.ordinal): len(p.questions) * args.num_samples for name, ps in plans.items() for p in ps}
    done = report.completed_batches(output, expected, write=main_process)
    hosts.barrier("eval resume point found")  # process 0 drops incomplete batches before anyone samples
    tok = loaded.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    console = Console(quiet=not main_process)
    total = sum(len(b.problems) for b in benches)
    finished = sum(len(p.questions) for name, ps in plans.items() for p in ps if (name, p.ordinal) in done)
    with rewards.GradingPool(timeout_s=args.timeout_s) as grader, Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("questions"),
            TextColumn("{task.fields[speed]}"), TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("eval", total=total, completed=finished, speed="")
        start, new_tokens = time.perf_counter(), 0
        for bench in benches:
            def write(batch, samples, bench=bench):  # every process has every sample; process 0 writes
                nonlocal new_tokens
                if main_process:
                    report.append_samples(output, report.sample_rows(bench, batch, samples))
                new_tokens += sum(s.tokens for s in samples)
                bar.update(task, advance=len(batch.questions), description=bench.name,
                           speed=f"{new_tokens / (time.perf_counter() - start):,.0f} tok/s")

            benchmark.run(loaded.model, bench, settings, tokenizer=tok, grader=grader, eos_ids=(tok.eos_token_id,),
                          pad_id=pad_id, valid_vocab=len(tok),
                          skip={o for (n, o) in done if n == bench.name}, on_batch=write)
    hosts.barrier("eval samples written")
    if not main_process:
        return 0
    results = report.results_from_samples(report.read_samples(output), recorded, loaded.identity)
    import json

    (output / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    report.plot_pass_at_k(results, output / "pass_at_k.png")
    report.print_table(results, console)
    console.print(f"results: {output / 'results.json'}  samples: {output / 'samples.jsonl'}")
    console.print(f"compile: {compiles.counts().describe()}", highlight=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
