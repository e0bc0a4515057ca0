"""The R³ training loop (R3-SPEC §7): sample, grade, one jitted step; log, evaluate and checkpoint on schedule.

Resume is exact: a step's randomness is `fold_in(key, step)` (sampling, reflection and the train step each
their own stream), the question iterator's position and the loop's counters are checkpointed with the
`TrainState`, and `metrics.jsonl` rows after the restored step are dropped. So a run killed at any moment
(SIGKILL mid-step or mid-save) and rerun with the same command ends bitwise where an uninterrupted run ends.
SIGTERM / SIGINT (a TPU preemption, Ctrl-C) finish the current step, save, and exit 0.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import signal
import time

import jax

from r3jax import compiles, hosts, rewards
from r3jax import model as rm
from r3jax.data import iterator as data_iterator
from r3jax.eval import benchmark, report
from r3jax.model import attention_plan
from r3jax.rl import layout as rl_layout
from r3jax.rl import train_step
from r3jax.train import checkpoint, logbook, plots, progress, rollouts, summary
from r3jax.train import config as run_config
from r3jax.train.setup import Run, SetupError

MAX_SKIPPED_IN_A_ROW = 3


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. updates that keep failing); the message says why and where it stopped."""


class StopRequest:
    """SIGTERM / SIGINT ask the loop to stop after the current step; a second one stops at once."""

    def __init__(self):
        self.signal: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum


@dataclasses.dataclass
class LoopState:
    """The loop's own counters, checkpointed beside the TrainState (JSON)."""

    skipped_total: int = 0
    skipped_in_a_row: int = 0
    epoch: int = 0
    recompiles: int = 0  # compilations after a process's first two steps (a new layout's or sampled shape's
                         # programs excepted)


def _keys(seed: int, step: int):
    """Independent streams for step `step`: sampling and reflection. (Evaluation has its own fixed seed,
    `eval.seed`, so that every evaluation of a run, and eval.py on a checkpoint, draws alike.)"""
    base = jax.random.key(seed)
    return tuple(jax.random.fold_in(jax.random.fold_in(base, stream), step) for stream in (1, 2))


def _checkpoint_payload(run: Run, it: data_iterator.QuestionIterator, loop: LoopState) -> dict:
    return {"iterator": it.state.to_dict(), "loop": dataclasses.asdict(loop), "config": run.config.to_dict()}


def _restore(run: Run, ckpt: checkpoint.Checkpointer, it, loop: LoopState) -> tuple[int, list[str]]:
    """Loads the newest checkpoint that reads into run.state / it / loop; returns its step (0 when there is none)
    and a line for each newer one that could not be read (each moved aside: `Checkpointer.set_aside`). A config
    that changed the checkpoint's shapes is refused at once; no intact checkpoint at all is refused too."""
    damaged = []
    for step in ckpt.all_steps():
        try:
            saved = ckpt.read_loop(step)
        except Exception as e:  # noqa: BLE001  (Orbax, tensorstore and JSON each raise their own)
            damaged.append((step, e))
            continue
        changed = run_config.changed_shape_fields(saved["config"], run.config)
        if changed:
            raise SetupError(f"cannot resume from {ckpt.directory} (step {step}): the config changed fields that "
                             f"fix the checkpoint's shapes: {'; '.join(changed)}. Use another --workdir, or the old "
                             "values")
        try:
            run.state, payload = ckpt.restore(step, run.state)
        except Exception as e:  # noqa: BLE001
            damaged.append((step, e))
            continue
        it.restore(data_iterator.IteratorState.from_dict(payload["iterator"]))
        for k, v in payload["loop"].items():
            setattr(loop, k, v)
        return step, _set_aside(ckpt, damaged)
    if damaged:
        raise SetupError(f"no checkpoint in {ckpt.directory} can be read ({_reasons(damaged)}); to start over, "
                         "use another --workdir or move that folder away")
    return 0, []


def _reasons(damaged: list) -> str:
    return "; ".join(f"step {step}: {type(e).__name__}: {' '.join(str(e).split())[:200]}" for step, e in damaged)


def _set_aside(ckpt: checkpoint.Checkpointer, damaged: list) -> list[str]:
    """Moves the unreadable checkpoints newer than the one restored out of the way (process 0; the others wait),
    so that their steps can be saved again. Returns one line for each."""
    lines = []
    for step, e in damaged:
        where = ckpt.set_aside(step) if hosts.is_main() else "damaged_checkpoints/"
        lines.append(f"checkpoint step {step} cannot be read ({_reasons([(step, e)])}); moved to {where}")
    if damaged:
        hosts.barrier("damaged checkpoints set aside")
        ckpt.reload()
    return lines


def _evaluate(run: Run, grader, folder: pathlib.Path, step: int) -> dict:
    """Evaluates the current policy; its samples go to `DIR/eval/step_{step}.jsonl` (eval.py's row format)."""
    name = f"step_{step}.jsonl"
    if hosts.is_main():
        (folder / name).unlink(missing_ok=True)  # a resumed run evaluates this step again
    model = rm.merge_params(run.graphdef, run.state.params)

    def keep(bench, batch, samples):  # every process has every sample; process 0 writes them
        if hosts.is_main():
            report.append_samples(folder, report.sample_rows(bench, batch, samples), name)

    return benchmark.evaluate(model, run.benchmarks, run.eval_settings, tokenizer=run.tokenizer, grader=grader,
                              eos_ids=run.settings.eos_ids, pad_id=run.settings.pad_id, valid_vocab=run.rl.valid_vocab,
                              on_batch=keep)


def _update(run: Run, step_fn, batch, seen: set) -> tuple[dict, rl_layout.Layout, int]:
    """The jitted step on `batch` in the layout the host buckets for it (`rl.layout`): (metrics, layout, programs
    built for a layout new to this process: expected, not recompiles)."""
    layout = rl_layout.choose(run.rl, run.state.buffer, batch, run.mesh)
    before = compiles.counts().programs
    run.state, metrics = step_fn(run.state, batch, layout)
    new = 0 if layout in seen else compiles.counts().programs - before
    seen.add(layout)
    return jax.tree.map(hosts.fetch, metrics), layout, new


def _save_final(run: Run, workdir: pathlib.Path) -> None:
    final = workdir / "final"
    rm.save_pretrained(rm.merge_params(run.graphdef, run.state.params), final)  # every process gathers; 0 writes
    if hosts.is_main():
        run.tokenizer.save_pretrained(final)


def train(run: Run, workdir: str) -> int:
    """Runs (or resumes) until `steps` optimizer updates; returns the process exit code."""
    c, workdir = run.config, pathlib.Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        hosts.check_shared_folder(workdir, "--workdir")
    except hosts.DistributedError as e:
        raise SetupError(str(e)) from e
    it = data_iterator.QuestionIterator(len(run.bank.problems), run.questions_per_step, seed=c.seed)
    loop = LoopState()
    ckpt = checkpoint.Checkpointer(workdir / "checkpoints", keep=c.keep_checkpoints)
    start, damaged = _restore(run, ckpt, it, loop)
    main = hosts.is_main()
    for line in damaged if main else []:
        print(f"{line}; resuming from step {start}", flush=True)
    plan = attention_plan.plan(mesh=run.mesh, backend=c.model.attention)
    if main:
        # the config as run, and which attention paths it runs (`attention_plan`)
        (workdir / "config.json").write_text(json.dumps({**c.to_dict(), "attention_plan": plan.as_dict()}, indent=2,
                                                        default=str) + "\n")
        print(plan.describe(), flush=True)
    book = logbook.Logbook(workdir, resume_step=start, wandb_config=c.wandb.to_dict(), run_config=c.to_dict(),
                           writer=main)
    stop = StopRequest()
    stop.install()
    grader = rewards.GradingPool(c.grading.workers, timeout_s=c.grading.timeout_s)
    step_fn, layouts, sampled_shapes = None, set(), set()
    bar = progress.TrainProgress(total=c.steps, done=start, quiet=not main)
    try:
        if c.eval_at_start and run.benchmarks and start == 0 and not any(r["step"] == 0 for r in book.rows()):
            evaluated = _evaluate(run, grader, workdir / "eval", 0)
            book.write(0, evaluated)
            bar.print_eval(0, evaluated)
        for step in range(start + 1, c.steps + 1):
            t0, built = time.perf_counter(), compiles.counts().programs
            qids, loop.epoch = next(it)
            sample_key, reflection_key = _keys(c.seed, step)
            got = rollouts.collect(run.graphdef, run.state.params, run.state.buffer, run.bank, qids, loop.epoch,
                                   cfg=run.rl, settings=run.settings, num_groups=c.prompts_per_step,
                                   sample_key=sample_key, reflection_key=reflection_key, tokenizer=run.tokenizer,
                                   grader=grader)
            # R³'s first step with reflection prompts samples a new shape (`rollouts.collect`): expected programs
            new_shape = 0 if got.sampled in sampled_shapes else compiles.counts().programs - built
            sampled_shapes.add(got.sampled)
            t1 = time.perf_counter()
            if step_fn is None:
                step_fn = train_step.make_train_step(run.graphdef, run.rl, run.tx, run.state, got.batch, run.mesh)
            metrics, layout, expected = _update(run, step_fn, got.batch, layouts)
            t2 = time.perf_counter()
            if step > start + 2:  # a process compiles its programs in its first two steps; later is a recompile
                loop.recompiles += compiles.counts().programs - built - expected - new_shape
            loop.skipped_in_a_row = loop.skipped_in_a_row + 1 if metrics["policy/skipped"] else 0
            loop.skipped_total += int(metrics["policy/skipped"])
            evaluated = {}
            if run.benchmarks and (step == c.steps or (c.eval_every and step % c.eval_every == 0)):
                evaluated = _evaluate(run, grader, workdir / "eval", step)
            t3 = time.perf_counter()
            row = book.write(step, {
                **metrics, **evaluated, "data/epoch": loop.epoch, "policy/skipped_steps": loop.skipped_total,
                "compile/count": loop.recompiles, **compiles.counts().metrics(),
                "layout/width": layout.width, "layout/replay_rows": layout.replay_rows,
                "layout/prompt_width": layout.prompt_width or got.batch.prompt_tokens.shape[1],
                "layout/groups": layout.groups or got.batch.tokens.shape[0],
                "layout/narrow_groups": layout.narrow_groups, "layout/replay_apart": float(layout.replay_apart),
                **({"resume/damaged_checkpoints": len(damaged)} if damaged and step == start + 1 else {}),
                "time/sample_s": got.sample_s, "time/grade_s": got.grade_s, "time/train_s": t2 - t1,
                "time/eval_s": t3 - t2, "time/other_s": (time.perf_counter() - t0) - (t3 - t1) - got.sample_s
                - got.grade_s, "tokens_per_s": got.generated_tokens / (time.perf_counter() - t0)})
            bar.update(step, row)
            if step == start + 1:
                bar.print_note(f"compile: {compiles.counts().describe()} up to step {step}")
            if evaluated:
                bar.print_eval(step, evaluated)
                if main:
                    plots.draw(book.rows(), workdir / "plots")
            if loop.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                raise TrainingError(f"{loop.skipped_in_a_row} updates in a row (up to step {step}) had a non-finite "
                                    f"loss or gradient norm and were skipped; stopping. The last checkpoint is at "
                                    f"step {ckpt.latest_step()}: lower rl.learning_rate or check the data")
            stopping = hosts.any_process(stop.signal is not None)  # a signal on one host stops every host
            if step == c.steps or (c.checkpoint_every and step % c.checkpoint_every == 0) or stopping:
                ckpt.save(step, run.state, _checkpoint_payload(run, it, loop))
            if stopping and step < c.steps:
                ckpt.wait()
                bar.close()
                why = signal.Signals(stop.signal).name if stop.signal else "another process's signal"
                if main:
                    print(f"Stopped at step {step} of {c.steps} on {why}; checkpoint saved in {ckpt.directory}. "
                          "Resume with the same command (same --workdir).", flush=True)
                return 0
        ckpt.wait()
        bar.close()
        if start < c.steps or not hosts.all_processes((workdir / "final").exists()):
            _save_final(run, workdir)
        if main:
            plots.draw(book.rows(), workdir / "plots")
            print(f"Done: {c.steps} steps.", flush=True)
            summary.print_summary(bar.console, book.rows(), workdir, final=workdir / "final",
                                  order=list(c.data.eval), skipped_rows=run.skipped_rows)
        return 0
    finally:
        bar.close()
        grader.close()
        book.close()
        ckpt.close()

