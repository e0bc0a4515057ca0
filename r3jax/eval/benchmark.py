"""Sampling and grading a held-out problem set in fixed-shape batches.

A benchmark's prompts are tokenized once into one left-padded bucket width; batches of `batch_size` prompts
(the last one filled with repeats of its first row, whose samples are dropped) give one compiled sampler per
(batch size, bucket), not one per question. Scores are pass@1 averaged over every sample of every question,
the mean response length in tokens and the truncation rate.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from r3jax import rewards
from r3jax.data import problems as data_problems
from r3jax.data import prompts
from r3jax.sampling import generate


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    problems: tuple                # Problem records, in row order
    tokens: np.ndarray             # [N, W] int32 left-padded prompts
    mask: np.ndarray               # [N, W] bool


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    max_new_tokens: int
    num_samples: int = 1
    temperature: float = 0.0       # 0: greedy
    top_p: float = 1.0
    batch_size: int = 64


def load_benchmark(name: str, path: str, tokenizer, *, limit: int | None = None,
                   max_prompt_tokens: int | None = None) -> Benchmark:
    """A problem file, its first `limit` questions, tokenized once. Raises DataError when nothing is usable."""
    problem_set = data_problems.load_problems(path, on_error="skip")
    chosen = list(problem_set)[:limit]
    if not chosen:
        raise data_problems.DataError(f"evaluation set {name!r} ({path}) has no usable problems")
    batch = prompts.tokenize_prompts(tokenizer, [prompts.question_text(p.problem) for p in chosen],
                                     max_length=max_prompt_tokens)
    return Benchmark(name=name, problems=tuple(chosen[i] for i in batch.kept), tokens=batch.tokens, mask=batch.mask)


def sample(model, bench: Benchmark, settings: EvalSettings, key, *, eos_ids, valid_vocab=None):
    """(tokens [N * n, T], lengths [N * n], truncated [N * n]) numpy, question-major: row i * n + j is sample j
    of question i."""
    n, size = settings.num_samples, settings.batch_size
    outs = []
    for start in range(0, len(bench.problems), size):
        rows = np.arange(start, min(start + size, len(bench.problems)))
        full = np.concatenate([rows, np.full(size - len(rows), rows[0])])  # one shape for every batch
        rollout = generate(model, bench.tokens[full], bench.mask[full], jax.random.fold_in(key, start),
                           max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                           top_p=settings.top_p, eos_ids=eos_ids, num_samples=n, valid_vocab=valid_vocab)
        keep = len(rows) * n
        outs.append(jax.device_get((rollout.tokens[:keep], rollout.lengths[:keep], rollout.truncated[:keep])))
    return tuple(np.concatenate(parts) for parts in zip(*outs, strict=True))


def evaluate(model, benchmarks: list[Benchmark], settings: EvalSettings, key, *, tokenizer, grader,
             eos_ids, valid_vocab=None) -> dict[str, float]:
    """`eval/{name}/pass@1`, `.../mean_response_tokens`, `.../truncation_rate` per benchmark, and the
    unweighted average of pass@1 over benchmarks (`eval/avg/pass@1`, the paper's Avg column)."""
    metrics = {}
    for i, bench in enumerate(benchmarks):
        tokens, lengths, truncated = sample(model, bench, settings, jax.random.fold_in(key, i), eos_ids=eos_ids,
                                            valid_vocab=valid_vocab)
        texts = prompts.decode_responses(tokenizer, tokens, lengths, truncated)
        answers = [p.answers for p in bench.problems for _ in range(settings.num_samples)]
        graded = rewards.grade_batch(texts, answers, num_tokens=lengths, grader=grader)
        metrics[f"eval/{bench.name}/pass@1"] = float(np.mean([g.correct for g in graded]))
        metrics[f"eval/{bench.name}/mean_response_tokens"] = float(np.mean(lengths))
        metrics[f"eval/{bench.name}/truncation_rate"] = float(np.mean(truncated))
    if benchmarks:
        metrics["eval/avg/pass@1"] = float(np.mean([metrics[f"eval/{b.name}/pass@1"] for b in benchmarks]))
    return metrics
