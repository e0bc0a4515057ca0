"""Makes the embedded default's base model, `configs/arith/base/`: a JAX warm start on worked arithmetic.

    python scripts/make_arith_base.py                       # writes configs/arith/base (provenance.json: time)
    python scripts/make_arith_base.py --out /tmp/base --steps 100

A ~1M-parameter Qwen2 (hidden 128, 4 layers, byte-level vocabulary) starts from random weights (seed fixed) and
learns, by teacher-forced cross-entropy (`r3jax.train.sft`, the library's model, loss head and optimizer),
solutions of `r3jax.data.arith` chains of 1..5 operations. The teacher mixes two strategies: half of the plain
questions get the careful solution (a line per operation), the other half a shortcut that answers at once
(`</think>` and the boxed answer; `--shortcut_lines` lets a shortcut write some lines first). Done in the head,
one operation is easy and several are not, so the base model's accuracy on longer chains is held back by a
choice it makes at its first token, which RL can change on every question, seen or not.

Every eighth update is a batch of reflection prompts in exactly the format R³'s ISR builds (`configs/arith.py`'s
instruction and attempt length): the question, the tail of a failed attempt (a slipped step, a shortcut to a
wrong answer, or a cut-off one), the instruction, and the careful solution as the target. Held-out and RL
training problems are never shown. The held-out accuracy per level is measured at
the end (greedy, with `train.py`'s evaluation code) and written to `provenance.json` beside the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import runpy
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from r3jax import model as rm  # noqa: E402
from r3jax import rewards  # noqa: E402
from r3jax.data import arith, prompts, toy  # noqa: E402
from r3jax.data.problems import load_problems  # noqa: E402
from r3jax.eval import benchmark  # noqa: E402
from r3jax.rl import reflection  # noqa: E402
from r3jax.rl.loss import make_optimizer  # noqa: E402
from r3jax.train import sft  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARCHITECTURE = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0)


class Examples:
    """An endless, seeded stream of (prompt ids, response ids) batches: plain questions and reflection prompts."""

    def __init__(self, tokenizer, config, *, seed: int, batch_size: int, reflection_every: int, exclude: set[str],
                 shortcut_rate: float, shortcut_lines: int):
        self.tokenizer, self.rng, self.batch_size = tokenizer, random.Random(seed), batch_size
        self.shortcut_rate, self.shortcut_lines = shortcut_rate, shortcut_lines
        self.reflection_every, self.exclude, self.calls = reflection_every, exclude, 0
        self.template = reflection.make_template(tokenizer, config.rl.r3.reflection_instruction)
        self.attempt_tokens = config.rl.r3.reflection_attempt_tokens
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id

    def _chain(self) -> arith.Chain:
        while True:
            chain = arith.random_chain(self.rng, self.rng.choice(arith.WARM_START_OPS))
            if chain.problem not in self.exclude:
                return chain

    def _response(self, chain, plain: bool) -> list[int]:
        """A plain question gets a shortcut at `shortcut_rate` (the lines stop after 0..`shortcut_lines`
        operations, uniformly, and at most n-1), else the careful solution; a reflection prompt always gets the
        careful solution."""
        if plain and self.rng.random() < self.shortcut_rate:
            written = self.rng.randint(0, min(self.shortcut_lines, len(chain.ops) - 1))
            text = arith.shortcut_solution(chain, written)
        else:
            text = arith.worked_solution(chain)
        return prompts.encode(self.tokenizer, text) + [self.eos]

    def _prompt(self, chain, plain: bool, attempt: list[int] | None = None) -> list[int]:
        if plain:
            return prompts.encode(self.tokenizer, prompts.render(self.tokenizer, prompts.question_text(chain.problem)))
        if attempt is None:
            text = arith.wrong_solution(chain, self.rng)
            roll = self.rng.random()
            if roll < 1 / 3:  # a truncated attempt: cut anywhere, no answer
                text = text[:self.rng.randint(1, len(text) - 1)]
            elif roll < 2 / 3:  # a shortcut that boxed a wrong answer
                written = self.rng.randrange(len(chain.ops))
                wrong = chain.answer + self.rng.choice(arith.SLIPS)
                text = arith.response(arith.solution_lines(chain)[:written], wrong)
            attempt = prompts.encode(self.tokenizer, text)[-self.attempt_tokens:]
        t = self.template
        return [*t.prefix, *reflection.question_ids(self.tokenizer, chain.problem), *t.between, *attempt, *t.suffix]

    def __next__(self) -> sft.SFTBatch:
        self.calls += 1
        plain = self.calls % self.reflection_every != 0
        pairs = []
        for _ in range(self.batch_size):
            chain = self._chain()
            pairs.append((self._prompt(chain, plain), self._response(chain, plain)))
        longest = max(len(p) + len(r) for p, r in pairs)
        return sft.pack(pairs, -(-longest // 32) * 32, self.pad)  # a few widths, so a few compiles


def greedy_accuracy(model, tokenizer, config, max_new_tokens: int, limit: int | None = None) -> dict:
    """Greedy held-out accuracy per level (train.py's evaluation code, greedy, one sample)."""
    benches = [benchmark.load_benchmark(name, path, tokenizer, limit=limit)
               for name, path in config.data.eval.items()]
    settings = benchmark.EvalSettings(max_new_tokens=max_new_tokens, batch_size=64)
    grader = rewards.GradingPool(1, timeout_s=2.0)
    try:
        metrics = benchmark.evaluate(model, benches, settings, tokenizer=tokenizer, grader=grader,
                                     eos_ids=(tokenizer.eos_token_id,), pad_id=tokenizer.pad_token_id,
                                     valid_vocab=len(tokenizer))
    finally:
        grader.close()
    return {k.removeprefix("eval/"): round(v, 4) for k, v in metrics.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "configs" / "arith" / "base"))
    parser.add_argument("--config", default=str(ROOT / "configs" / "arith.py"),
                        help="the RL config whose reflection format, budget and held-out files are used")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--reflection_every", type=int, default=8, help="every n-th update is a reflection batch")
    parser.add_argument("--shortcut_rate", type=float, default=0.5,
                        help="the fraction of plain questions whose target stops writing lines early")
    parser.add_argument("--shortcut_lines", type=int, default=0,
                        help="a shortcut writes 0..this many lines (uniformly) before the answer; 0: answers at once")
    parser.add_argument("--eval_limit", type=int, default=None, help="held-out questions per level to measure")
    args = parser.parse_args()

    config = runpy.run_path(args.config)["get_config"]()
    out = pathlib.Path(args.out)
    toy.build_tokenizer(out)  # the byte-level tokenizer with R1-Distill's chat format
    tokenizer = prompts.load_tokenizer(out)
    held = [p for path in config.data.eval.values() for p in _problems(path)]
    exclude = set(held) | set(_problems(config.data.train))
    stream = Examples(tokenizer, config, seed=args.seed, batch_size=args.batch_size,
                      reflection_every=args.reflection_every, exclude=exclude, shortcut_rate=args.shortcut_rate,
                      shortcut_lines=args.shortcut_lines)
    model_config = rm.tiny(vocab_size=-(-len(tokenizer) // 8) * 8, eos_token_id=tokenizer.eos_token_id,
                           bos_token_id=tokenizer.bos_token_id, **ARCHITECTURE)
    model = rm.init_model(model_config, seed=args.seed)
    tx = make_optimizer(args.learning_rate, warmup_steps=args.steps // 20, total_steps=args.steps,
                        weight_decay=0.01)
    print(f"warm start: {rm.weights.param_count(rm.split_params(model)[1]):,} parameters, {args.steps} updates x "
          f"{args.batch_size} examples, lr {args.learning_rate}", flush=True)
    start = time.perf_counter()
    model, history = sft.fit(model, tx, stream, args.steps,
                             log=lambda r: print(f"  step {r['step']:5d}  loss {r['loss']:.4f}  {r['seconds']:.0f}s",
                                                 flush=True))
    train_seconds = time.perf_counter() - start
    rm.save_pretrained(model, out)
    accuracy = greedy_accuracy(rm.load_pretrained(out)[0], prompts.load_tokenizer(out), config, config.max_new_tokens,
                               args.eval_limit)
    provenance = {
        "made_by": "python scripts/make_arith_base.py " + " ".join(sys.argv[1:]),
        "git_commit": _git_commit(), "seed": args.seed, "steps": args.steps, "batch_size": args.batch_size,
        "learning_rate": args.learning_rate, "reflection_every": args.reflection_every,
        "shortcut_rate": args.shortcut_rate, "shortcut_lines": args.shortcut_lines,
        "warm_start_operations": list(arith.WARM_START_OPS), "architecture": ARCHITECTURE,
        "train_seconds": round(train_seconds, 1), "loss": history[-1]["loss"],
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__}",
        "greedy_heldout": accuracy, "heldout_per_level": args.eval_limit or "all",
        "max_new_tokens": config.max_new_tokens}
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(accuracy), flush=True)


def _problems(path: str) -> list[str]:
    return [p.problem for p in load_problems(path)]


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
