"""Sampling and grading a held-out problem set: bucketed fixed-shape batches, grading overlapped with sampling.

Questions are ordered by prompt-length bucket (128, 256, ..., 4096 tokens) and cut into batches of
`batch_size` questions (the last batch of a bucket is filled with repeats of its first question, whose samples
are dropped), so a whole benchmark compiles one sampler per bucket. The plan depends only on the benchmark and
the batch size, and batch b samples with `fold_in(key, b)`: a batch gives the same samples whether it runs
first, last or alone, which is what makes an interrupted evaluation resumable to the same result. While the
device samples batch b + 1, the host grades batch b.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Iterable

import jax
import numpy as np

from r3jax import hosts, rewards
from r3jax.data import problems as data_problems
from r3jax.data import prompts
from r3jax.eval import report
from r3jax.sampling import generate


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    problems: tuple                      # Problem records, in file order (limit applied)
    prompt_ids: tuple[tuple[int, ...]]   # each question's rendered prompt ids
    skipped: tuple = ()                  # malformed rows left out (`on_error="skip"`): `problems.RowIssue`s


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    max_new_tokens: int
    num_samples: int = 1
    temperature: float = 0.0             # 0: greedy
    top_p: float = 1.0
    batch_size: int = 64                 # questions per sampler call (rows = batch_size * num_samples)
    seed: int = 0
    slots: int = 0                       # rows decoding at once within a call, refilled as rows end (0: all)


@dataclasses.dataclass(frozen=True)
class Batch:
    ordinal: int                         # position in the plan: its random stream
    questions: tuple[int, ...]           # indices into Benchmark.problems
    width: int                           # prompt bucket


@dataclasses.dataclass(frozen=True)
class Sample:
    """One graded sample: what samples.jsonl stores per row."""

    question: int
    index: int
    text: str
    tokens: int
    truncated: bool
    correct: bool
    reason: str


def load_benchmark(name: str, path: str, tokenizer, *, limit: int | None = None, on_error: str = "raise") -> Benchmark:
    """A problem file's first `limit` questions, tokenized once. A malformed row raises DataError naming the file
    and line, or with on_error="skip" is left out and listed in `Benchmark.skipped`. Raises DataError when none is
    usable or a prompt is longer than the largest bucket."""
    loaded = data_problems.load_problems(path, on_error=on_error)
    chosen = list(loaded)[:limit]
    if not chosen:
        raise data_problems.DataError(f"evaluation set {name!r} ({path}) has no usable problems")
    ids = [prompts.encode(tokenizer, prompts.render(tokenizer, prompts.question_text(p.problem))) for p in chosen]
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    if len(ids[longest]) > max(prompts.DEFAULT_BUCKETS):
        raise data_problems.DataError(f"evaluation set {name!r}: question {chosen[longest].uid} has a "
                                      f"{len(ids[longest])}-token prompt, over {max(prompts.DEFAULT_BUCKETS)}")
    return Benchmark(name=name, problems=tuple(chosen), prompt_ids=tuple(tuple(i) for i in ids),
                     skipped=loaded.report.skipped)


def skipped_note(what: str, path: str, skipped) -> str:
    """One line saying which malformed rows of a file were left out (the first few, where and why)."""
    first = "; ".join(f"{issue.where}: {issue.reason}" for issue in skipped[:3])
    return f"{what}: skipped {len(skipped)} malformed row{'s' * (len(skipped) != 1)} of {path} ({first}" + \
        (", ..." if len(skipped) > 3 else "") + ")"


def plan(bench: Benchmark, batch_size: int) -> list[Batch]:
    """Batches of up to `batch_size` questions of one bucket each, in bucket order, then question order."""
    widths = [prompts.bucket_length(len(ids), prompts.DEFAULT_BUCKETS) for ids in bench.prompt_ids]
    batches = []
    for width in sorted(set(widths)):
        members = [i for i, w in enumerate(widths) if w == width]
        for start in range(0, len(members), batch_size):
            batches.append(Batch(len(batches), tuple(members[start:start + batch_size]), width))
    return batches


def batch_prompts(bench: Benchmark, batch: Batch, batch_size: int, pad_id: int):
    """[batch_size, width] left-padded prompt tokens and mask (filler rows repeat the batch's first question)."""
    rows = list(batch.questions) + [batch.questions[0]] * (batch_size - len(batch.questions))
    tokens = np.full((batch_size, batch.width), pad_id, np.int32)
    mask = np.zeros((batch_size, batch.width), bool)
    for r, q in enumerate(rows):
        ids = bench.prompt_ids[q]
        tokens[r, batch.width - len(ids):], mask[r, batch.width - len(ids):] = ids, True
    return tokens, mask


def benchmark_key(settings: EvalSettings, name: str):
    """The benchmark's random stream: from the seed and its name only (not its position in a list)."""
    return jax.random.fold_in(jax.random.key(settings.seed), zlib.crc32(name.encode()) & 0x7FFFFFFF)


def run(model, bench: Benchmark, settings: EvalSettings, *, tokenizer, grader, eos_ids, pad_id: int,
        valid_vocab: int | None = None, skip: Iterable[int] = (),
        on_batch: Callable[[Batch, list[Sample]], None] | None = None) -> list[Sample]:
    """Samples and grades every batch of the plan except those whose ordinal is in `skip`; returns the samples
    (question-major within each batch) and hands each finished batch to `on_batch` as soon as it is graded."""
    skip = set(skip)
    key = benchmark_key(settings, bench.name)
    todo = [b for b in plan(bench, settings.batch_size) if b.ordinal not in skip]
    out: list[Sample] = []
    pending = None
    for batch in [*todo, None]:
        launched = None
        if batch is not None:  # dispatched: the device samples while the host grades the previous batch
            tokens, mask = batch_prompts(bench, batch, settings.batch_size, pad_id)
            launched = (batch, generate(model, tokens, mask, jax.random.fold_in(key, batch.ordinal),
                                        max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                        top_p=settings.top_p, eos_ids=eos_ids, num_samples=settings.num_samples,
                                        valid_vocab=valid_vocab, pad_id=pad_id, slots=settings.slots or None,
                                        share_prompts=True))  # without slots, one copy of each prompt
        if pending is not None:
            samples = _grade(bench, *pending, settings, tokenizer, grader)
            out.extend(samples)
            if on_batch is not None:
                on_batch(pending[0], samples)
        pending = launched
    return out


def _grade(bench: Benchmark, batch: Batch, rollout, settings: EvalSettings, tokenizer, grader) -> list[Sample]:
    """Each host decodes and grades the rows its devices sampled; the graded records (not the arrays) are then
    shared, so every process returns the batch's samples in row order."""
    n, keep = settings.num_samples, len(batch.questions) * settings.num_samples
    rows, (tokens, lengths, truncated) = hosts.local_rows(rollout.tokens, rollout.lengths, rollout.truncated)
    mine = rows < keep                                  # rows past `keep` repeat a question to fill the shape
    rows, tokens, lengths, truncated = rows[mine], tokens[mine], lengths[mine], truncated[mine]
    texts = prompts.decode_responses(tokenizer, tokens, lengths, truncated)
    questions = np.repeat(batch.questions, n)[rows]
    graded = rewards.grade_batch(texts, [bench.problems[q].answers for q in questions], num_tokens=lengths,
                                 grader=grader)
    local = [(int(r), dataclasses.asdict(Sample(question=int(q), index=int(r) % n, text=t, tokens=int(ln),
                                                truncated=bool(tr), correct=g.correct, reason=g.reason)))
             for r, q, t, ln, tr, g in zip(rows, questions, texts, lengths, truncated, graded, strict=True)]
    by_row = dict(reversed(hosts.gather_objects(local)))  # a row held by several hosts: the first one's
    return [Sample(**by_row[r]) for r in sorted(by_row)]


def evaluate(model, benchmarks: list[Benchmark], settings: EvalSettings, *, tokenizer, grader, eos_ids,
             pad_id: int, valid_vocab=None, on_batch=None) -> dict[str, float]:
    """What train.py logs: `eval/{name}/pass@1`, `.../solve_none` (no sample correct), `.../mean_response_tokens`,
    `.../truncation_rate` per benchmark and `eval/avg/pass@1`, `eval/avg/solve_none`, unweighted means over
    benchmarks (the paper's Avg column). `on_batch(bench, batch,
    samples)` sees every graded batch (train.py keeps them beside its metrics)."""
    metrics = {}
    for bench in benchmarks:
        hook = None if on_batch is None else (lambda batch, samples, bench=bench: on_batch(bench, batch, samples))
        samples = run(model, bench, settings, tokenizer=tokenizer, grader=grader, eos_ids=eos_ids, pad_id=pad_id,
                      valid_vocab=valid_vocab, on_batch=hook)
        rows = report.sample_rows(bench, Batch(0, (), 0), samples)  # eval.py's rows: one summary for both
        summary = report.summarize(rows, settings.num_samples, [1], settings.max_new_tokens)
        for key in ("pass@1", "solve_none", "mean_response_tokens", "truncation_rate"):
            metrics[f"eval/{bench.name}/{key}"] = summary[key]
    for key in ("pass@1", "solve_none") if benchmarks else ():
        metrics[f"eval/avg/{key}"] = float(np.mean([metrics[f"eval/{b.name}/{key}"] for b in benchmarks]))
    return metrics
