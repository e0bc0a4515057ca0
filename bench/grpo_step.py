"""A whole GRPO step and a whole R³ step of r3jax against TRL's `GRPOTrainer`, on the same random weights.

    python bench/grpo_step.py                      # 2 rounds x 16 steps per system (~15 min on 2 cores)
    python bench/grpo_step.py --steps 3 --rounds 1 --skip 1   # smoke test

The driver (the project's venv) writes, once, a random `Qwen2ForCausalLM` (hidden 128, 4 layers, 4 heads, 2 KV
heads, intermediate 384, vocabulary 264: the project's byte-level tokenizer with R1-Distill's chat format,
`configs/tiny/tokenizer`) and 64 questions (the first 64 of `configs/arith/train.jsonl`), then runs each system in
its own process, every run under `flock /tmp/bench.lock` (so timed runs never overlap other benchmarks), in
alternating order (round 1: r3jax GRPO, TRL, r3jax R³; round 2 reversed):

- r3jax: its real training loop (`r3jax.train.setup.prepare` + `r3jax.train.loop.train`, what `train.py` runs)
  for `--steps` steps; the split is the loop's own per-step metrics (`time/sample_s`, `time/grade_s`,
  `time/train_s`); a step's wall time is the time between consecutive `metrics.jsonl` rows (the bench wraps
  `Logbook.write` to stamp them), so everything the loop does between steps counts.
- TRL (`--trl_python`, its own venv: trl 1.16.0, torch 2.13.0 CPU; skipped, with null ratios, when no
  --trl_python is given and /work/venvs/trl does not exist): `GRPOTrainer.train()` for `--steps` steps.
  sample = time in `_generate_single_turn` (transformers `generate`), grade = time in the reward function,
  train = on_step_begin -> on_step_end minus `_prepare_inputs` (forward, backward, clipping, AdamW), a step's
  wall time = on_step_end to on_step_end.

Both: 8 prompts x 8 samples x 64 new tokens per step, temperature 1, top-p 1, AdamW lr 1e-6 (constant,
betas 0.9/0.999, eps 1e-8, no weight decay, clip 1.0), one update per batch, beta (KL) 0, fp32, the GRPO loss
(clip 0.2, mean over each response's tokens then over responses). The reward is r3jax's own grading code
(`r3jax.rewards.grade_batch`: last \\boxed{} after </think>, math-verify in a 1-worker `GradingPool`, R³'s
length bonus), imported from this checkout into the TRL process (pure Python; math-verify 0.9.0 in both
venvs), on the same decoded text (special tokens kept). host = wall - sample - grade - train (prompt and
response bookkeeping, advantages, logging, data). The first `--skip` steps of each run (compilation, warm-up)
are left out of the medians; r3jax's compile seconds (its `compile/seconds`, no persistent cache) are reported.

Output: one JSON line per system+algorithm (median s/step and split over all rounds' steady steps) and a summary
line with the ratios TRL / r3jax and os.getloadavg() before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from common import check_python, emit  # noqa: E402  (bench/common.py: stdlib only, so the TRL venv imports it too)

TOKENIZER = REPO / "configs" / "tiny" / "tokenizer"
QUESTIONS = REPO / "configs" / "arith" / "train.jsonl"
MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
NUM_QUESTIONS, PROMPTS, SAMPLES, NEW_TOKENS = 64, 8, 8, 64
LEARNING_RATE, GRADING_WORKERS, GRADING_TIMEOUT_S = 1e-6, 1, 3.0
# R³'s reflection slots as in configs/arith.py (the project's CPU-scale R³): 2 extra prompts per batch, the last
# 32 tokens of the wrong attempt shown, a short instruction (long ones widen every row of a byte-level batch)
R3 = dict(max_reflection_prompts=2, reflection_attempt_tokens=32,
          reflection_instruction="Find the slip in this attempt and solve it again in \\boxed{}.")
LOCK = "/tmp/bench.lock"


# --- the driver (project venv) ----------------------------------------------------------------------------

def make_inputs(folder: pathlib.Path, seed: int) -> tuple[pathlib.Path, pathlib.Path]:
    """A random Qwen2 as a Hugging Face folder (with the tokenizer) and the question file; both sides read these."""
    import torch
    import transformers

    model_dir, data = folder / "model", folder / "train.jsonl"
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    config = transformers.Qwen2Config(
        vocab_size=-(-len(tokenizer) // 8) * 8, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, use_sliding_window=False,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, **MODEL)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).float()
    model.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / name, model_dir / name)
    lines = QUESTIONS.read_text().splitlines()[:NUM_QUESTIONS]
    data.write_text("\n".join(lines) + "\n")
    return model_dir, data


def run_one(argv: list[str], log: pathlib.Path, lock: bool) -> dict:
    """One timed run in its own process (under the bench lock); its result file's JSON plus the load around it."""
    out = log.with_suffix(".json")
    command = [*argv, "--out", str(out)]
    if lock:
        command = ["flock", LOCK, *command]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "w") as f:
        waited = time.perf_counter()
        load_before = os.getloadavg()
        code = subprocess.call(command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        load_after = os.getloadavg()
    if code:
        raise SystemExit(f"{' '.join(command)} failed ({code}); log: {log}\n" + log.read_text()[-3000:])
    result = json.loads(out.read_text())
    result["load_before"], result["load_after"] = [round(x, 2) for x in load_before], [round(x, 2) for x in load_after]
    result["process_s"] = round(time.perf_counter() - waited, 1)
    return result


def summarize(name: str, runs: list[dict], skip: int) -> dict:
    steady = [s for r in runs for s in r["steps"][skip:]]
    med = lambda key: round(statistics.median(s[key] for s in steady), 4)  # noqa: E731
    walls = [s["wall_s"] for s in steady]
    system, algorithm = name.split("/")
    out = {"system": system, "algorithm": algorithm, "median_step_s": med("wall_s"), "min_step_s": round(min(walls), 4),
           "max_step_s": round(max(walls), 4), "sample_s": med("sample_s"), "grade_s": med("grade_s"),
           "train_s": med("train_s"), "host_s": med("host_s"), "steady_steps": len(steady),
           "round_medians_s": [round(statistics.median(s["wall_s"] for s in r["steps"][skip:]), 4) for r in runs],
           "first_steps_s": [[round(s["wall_s"], 2) for s in r["steps"][:skip]] for r in runs],
           "startup_s": [r["startup_s"] for r in runs], "mean_response_tokens": med("tokens")}
    if system == "r3jax":
        out["compile_s"] = [r["compile_s"] for r in runs]
        out["programs_compiled"] = [r["programs"] for r in runs]
        out["other_s"] = med("other_s")  # the loop's own time/other_s (host inside a step); host_s adds between steps
        out["layouts"] = sorted({tuple(x) for r in runs for x in r["layouts"]})
        out["prompt_width"] = runs[0]["prompt_width"]
        if algorithm == "r3":
            out["r3_per_step"] = {k: round(statistics.mean(s[k] for s in steady), 2)
                                  for k in ("isr_prompts", "ccr_groups", "serr_scored")}
    return out


DEFAULT_TRL_PYTHON = "/work/venvs/trl/bin/python"
TRL_VENV = ("python3 -m venv /work/venvs/trl && /work/venvs/trl/bin/pip install trl==1.16.0 torch==2.13.0 "
            "math-verify==0.9.0")


def check_arguments(args) -> None:
    """Fails before the first timed run (each takes minutes) on what would fail later: a TRL venv that is asked for
    (--trl_python, or the default one when it exists) but cannot import TRL, or a step count that leaves no steady
    step for the medians. Without either venv, TRL is skipped: args.trl_python stays None."""
    if args.rounds < 1 or args.skip < 0 or args.steps <= args.skip:
        raise SystemExit(f"need --rounds >= 1 and --steps > --skip >= 0 (steady steps for the medians), got "
                         f"--rounds {args.rounds} --steps {args.steps} --skip {args.skip}")
    if args.trl_python is None:
        if not os.path.exists(DEFAULT_TRL_PYTHON):
            print(f"note: no TRL venv at {DEFAULT_TRL_PYTHON}: TRL is skipped (its ratios are null). Make it with\n"
                  f"    {TRL_VENV}\nor pass --trl_python PATH", file=sys.stderr, flush=True)
            return
        args.trl_python = DEFAULT_TRL_PYTHON
    got = check_python(args.trl_python, ("trl", "torch", "math_verify"), "--trl_python", TRL_VENV)
    if got != "1.16.0":
        print(f"note: --trl_python has trl {got}; the bench was written against 1.16.0", file=sys.stderr, flush=True)


def driver(args) -> None:
    check_arguments(args)
    folder = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="grpo_step_")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    model_dir, data = make_inputs(folder, args.seed)
    common = ["--model", str(model_dir), "--data", str(data), "--steps", str(args.steps), "--seed", str(args.seed)]
    me = str(pathlib.Path(__file__).resolve())
    commands = {
        "r3jax/grpo": [sys.executable, me, "--worker", "r3jax", "--algorithm", "grpo", *common],
        "trl/grpo": [args.trl_python, me, "--worker", "trl", "--algorithm", "grpo", *common],
        "r3jax/r3": [sys.executable, me, "--worker", "r3jax", "--algorithm", "r3", *common],
    }
    if args.trl_python is None:
        del commands["trl/grpo"]
    runs = {name: [] for name in commands}
    loads = []
    for k in range(args.rounds):
        order = list(commands) if k % 2 == 0 else list(reversed(commands))
        for name in order:
            run_dir = folder / f"round{k}_{name.replace('/', '_')}"
            shutil.rmtree(run_dir, ignore_errors=True)  # a leftover r3jax workdir would be resumed, not rerun
            log = run_dir.with_suffix(".log")
            result = run_one([*commands[name], "--workdir", str(run_dir)], log, lock=not args.no_lock)
            runs[name].append(result)
            loads.append({"round": k, "run": name, "before": result["load_before"], "after": result["load_after"],
                          "process_s": result["process_s"]})
            print(f"round {k} {name}: median {statistics.median(s['wall_s'] for s in result['steps'][args.skip:]):.3f}"
                  f" s/step (log {log})", file=sys.stderr, flush=True)
    lines = {name: summarize(name, rs, args.skip) for name, rs in runs.items()}
    for line in lines.values():
        emit(line)
    grpo, r3 = lines["r3jax/grpo"]["median_step_s"], lines["r3jax/r3"]["median_step_s"]
    trl = lines["trl/grpo"]["median_step_s"] if "trl/grpo" in lines else None
    versions = {**runs["r3jax/grpo"][0]["versions"], **{f"trl_venv_{k}": v for k, v in
                                                         (runs["trl/grpo"][0]["versions"] if trl else {}).items()}}
    ratio = lambda ours: None if trl is None else round(trl / ours, 3)  # noqa: E731
    emit({"summary": "grpo_step", "trl_over_r3jax_grpo": ratio(grpo), "trl_over_r3jax_r3": ratio(r3),
          **({} if trl else {"trl_note": f"skipped: no TRL venv ({DEFAULT_TRL_PYTHON} missing, no --trl_python)"}),
          "steps_per_run": args.steps, "skipped_per_run": args.skip, "rounds": args.rounds, "loadavg": loads,
          "model": {**MODEL, "vocab_size": runs["r3jax/grpo"][0]["vocab_size"]}, "versions": versions,
          "workdir": str(folder)})


# --- r3jax worker (project venv) --------------------------------------------------------------------------

def r3jax_worker(args) -> dict:
    started = time.perf_counter()
    import jax

    from r3jax.train import config as run_config
    from r3jax.train import logbook, loop, rollouts, setup

    c = run_config.base_config()
    c.algorithm = args.algorithm
    c.model.path = args.model
    c.data.train, c.data.limit = args.data, NUM_QUESTIONS
    c.prompts_per_step, c.samples_per_prompt, c.max_new_tokens = PROMPTS, SAMPLES, NEW_TOKENS
    c.temperature, c.top_p = 1.0, 1.0
    c.steps, c.seed = args.steps, args.seed
    c.checkpoint_every, c.keep_checkpoints, c.eval_every = args.steps, 1, 0  # one save, after the last timed step
    c.rl.learning_rate = LEARNING_RATE
    c.grading.workers, c.grading.timeout_s = GRADING_WORKERS, GRADING_TIMEOUT_S
    c.compilation_cache = ""  # compile for real: compile time is reported, not read back from a cache
    if args.algorithm == "r3":
        for k, v in R3.items():
            c.rl.r3[k] = v

    stamps = []
    write = logbook.Logbook.write

    def stamped(self, step, metrics):  # the bench's clock on each metrics row; the loop itself is unchanged
        row = write(self, step, metrics)
        stamps.append(time.perf_counter())
        return row

    logbook.Logbook.write = stamped
    run = setup.prepare(c)
    loop_start = time.perf_counter()
    code = loop.train(run, args.workdir)
    if code:
        raise SystemExit(f"r3jax loop exited {code}")
    rows = [json.loads(line) for line in (pathlib.Path(args.workdir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/sample_s" in r]
    steps, previous = [], loop_start
    for row, stamp in zip(rows, stamps, strict=True):
        wall = stamp - previous
        previous = stamp
        parts = {"sample_s": row["time/sample_s"], "grade_s": row["time/grade_s"], "train_s": row["time/train_s"]}
        steps.append({"wall_s": wall, **parts, "host_s": wall - sum(parts.values()), "other_s": row["time/other_s"],
                      "tokens": row["rollout/length_mean"], "isr_prompts": row.get("r3/isr_prompts", 0.0),
                      "ccr_groups": row.get("r3/ccr_groups", 0.0), "serr_scored": row.get("r3/serr_scored", 0.0)})
    from importlib.metadata import version

    import flax
    import optax
    import transformers
    return {"steps": steps, "startup_s": round(loop_start - started, 1),
            "compile_s": round(rows[-1]["compile/seconds"], 1), "programs": rows[-1]["compile/count_total"],
            "layouts": sorted({(r["layout/width"], r["layout/replay_rows"]) for r in rows}),
            "vocab_size": run.model_config.vocab_size, "prompt_width": rollouts.prompt_width(run.bank, run.settings),
            "versions": {"python": sys.version.split()[0], "jax": jax.__version__, "jaxlib": version("jaxlib"),
                         "flax": flax.__version__, "optax": optax.__version__, "transformers": transformers.__version__,
                         "math-verify": version("math-verify"), "devices": str(jax.devices())}}


# --- TRL worker (its own venv) ----------------------------------------------------------------------------

def trl_worker(args) -> dict:
    started = time.perf_counter()
    sys.path.insert(0, str(REPO))  # r3jax's grading code and prompt text: pure Python, no JAX
    from importlib.metadata import version

    import datasets
    import torch
    import transformers
    import trl

    from r3jax.data.prompts import question_text
    from r3jax.rewards import GradingPool, grade_batch

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(line) for line in pathlib.Path(args.data).read_text().splitlines()]
    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": question_text(r["problem"])}],
                                           "answer": str(r["answer"])} for r in rows])
    grader = GradingPool(GRADING_WORKERS, timeout_s=GRADING_TIMEOUT_S)
    clock = {"sample": 0.0, "grade": 0.0, "prepare": 0.0, "tokens": 0.0}

    def reward(prompts, completions, completion_ids, answer, **_):
        """r3jax's reward on the same text r3jax grades: the response without its end token, specials kept."""
        t = time.perf_counter()
        ends = set(trainer.eos_token_ids)
        texts = [tokenizer.decode(ids[:-1] if ids and ids[-1] in ends else ids, skip_special_tokens=False)
                 for ids in completion_ids]
        graded = grade_batch(texts, list(answer), num_tokens=[len(ids) for ids in completion_ids], grader=grader)
        clock["tokens"] = sum(len(ids) for ids in completion_ids) / len(completion_ids)
        clock["grade"] += time.perf_counter() - t
        return [g.reward for g in graded]

    config = trl.GRPOConfig(
        output_dir=args.workdir, max_steps=args.steps, per_device_train_batch_size=PROMPTS * SAMPLES,
        gradient_accumulation_steps=1, num_generations=SAMPLES, max_completion_length=NEW_TOKENS, temperature=1.0,
        top_p=1.0, learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, beta=0.0, loss_type="grpo",
        epsilon=0.2, num_iterations=1, use_vllm=False, use_cpu=True, bf16=False, fp16=False, seed=args.seed,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32})

    marks = {"begin": [], "end": []}

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks["start"] = time.perf_counter()

        def on_step_begin(self, *a, **k):
            marks["begin"].append(time.perf_counter())
            marks["at_begin"] = dict(clock)

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            marks["end"].append(now)
            marks.setdefault("deltas", []).append({k: clock[k] - marks["at_begin"][k] for k in ("sample", "grade",
                                                                                              "prepare")})
            marks["deltas"][-1]["tokens"] = clock["tokens"]

    trainer = trl.GRPOTrainer(model=args.model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Clock()])

    def timed(fn, key):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[key] += time.perf_counter() - t
        return wrapper

    trainer._generate_single_turn = timed(trainer._generate_single_turn, "sample")
    trainer._prepare_inputs = timed(trainer._prepare_inputs, "prepare")
    train_start = time.perf_counter()
    trainer.train()
    grader.close()
    steps, previous = [], marks["start"]
    for begin, end, d in zip(marks["begin"], marks["end"], marks["deltas"], strict=True):
        wall = end - previous
        previous = end
        train = (end - begin) - d["prepare"]
        steps.append({"wall_s": wall, "sample_s": d["sample"], "grade_s": d["grade"], "train_s": train,
                      "host_s": wall - d["sample"] - d["grade"] - train, "tokens": d["tokens"]})
    return {"steps": steps, "startup_s": round(train_start - started, 1),
            "versions": {"python": sys.version.split()[0], "trl": trl.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "accelerate": version("accelerate"),
                         "datasets": datasets.__version__, "math-verify": version("math-verify"),
                         "torch_threads": torch.get_num_threads()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="steps per run (each system, each round)")
    parser.add_argument("--skip", type=int, default=2, help="first steps of each run left out of the medians")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; odd rounds run the systems in reverse order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl_python", default=None,
                        help=f"python of the TRL venv (default {DEFAULT_TRL_PYTHON}; TRL is skipped if it is missing)")
    parser.add_argument("--workdir", help="where the model, data, logs and runs go (default: a new temp folder)")
    parser.add_argument("--no_lock", action="store_true", help=f"do not take {LOCK} around each timed run")
    # worker side (the driver passes these)
    parser.add_argument("--worker", choices=("r3jax", "trl"))
    parser.add_argument("--algorithm", choices=("grpo", "r3"))
    parser.add_argument("--model")
    parser.add_argument("--data")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker is None:
        driver(args)
        return
    result = (r3jax_worker if args.worker == "r3jax" else trl_worker)(args)
    pathlib.Path(args.out).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
