"""The host side of one R³ iteration (R3-SPEC §7, steps 1-3): prompts in, a graded `RolloutBatch` out.

The training questions are tokenized once at start-up into a `QuestionBank` of fixed widths: every step's
prompts are rows of it, plus the reflection prompts ISR builds on device into the batch's fixed extra slots,
so the sampler and the train step each compile once. Grading runs in the worker pool; rows of unused
reflection slots are not graded (their groups are invalid).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from concurrent import futures

import jax
import jax.numpy as jnp
import numpy as np

from r3jax import hosts, rewards
from r3jax.data import prompts
from r3jax.model import attention_plan
from r3jax.rl import batch as rl_batch
from r3jax.rl import dapo, reflection
from r3jax.rl.algorithm import RLConfig
from r3jax.sampling import generate
from r3jax.sampling import parts as sampling_parts


@dataclasses.dataclass(frozen=True)
class QuestionBank:
    """Every training question, tokenized once: its chat prompt and its bare question (ISR's q)."""

    problems: tuple
    prompt_tokens: np.ndarray    # [Q, Tp] left-padded rendered prompts
    prompt_mask: np.ndarray      # [Q, Tp]
    question_tokens: np.ndarray  # [Q, Tq] `question_text` ids without template, left-padded
    question_mask: np.ndarray    # [Q, Tq]
    longest_prompt: int          # real tokens of the longest prompt


def build_bank(tokenizer, problem_list, *, max_prompt_tokens: int | None = None) -> QuestionBank:
    """Tokenizes every problem; a problem whose prompt is longer than the largest bucket is an error naming it."""
    texts = [prompts.question_text(p.problem) for p in problem_list]
    batch = prompts.tokenize_prompts(tokenizer, texts, max_length=max_prompt_tokens)
    if batch.dropped:
        first = problem_list[batch.dropped[0]]
        limit = max_prompt_tokens or max(prompts.DEFAULT_BUCKETS)
        raise ValueError(f"{len(batch.dropped)} training prompts are longer than {limit} "
                         f"tokens, e.g. question {first.uid} from {first.source}; shorten or filter them")
    question_ids = [reflection.question_ids(tokenizer, p.problem) for p in problem_list]
    width = max(len(q) for q in question_ids)
    q_tokens = np.zeros((len(question_ids), width), np.int32)
    q_mask = np.zeros((len(question_ids), width), bool)
    for i, ids in enumerate(question_ids):
        q_tokens[i, width - len(ids):], q_mask[i, width - len(ids):] = ids, True
    return QuestionBank(problems=tuple(problem_list), prompt_tokens=batch.tokens, prompt_mask=batch.mask,
                        question_tokens=q_tokens, question_mask=q_mask, longest_prompt=int(batch.lengths.max()))


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """What sampling needs besides the RL config; all static."""

    num_samples: int             # G
    max_new_tokens: int          # = RLConfig.max_response_tokens
    temperature: float           # = RLConfig.temperature
    top_p: float
    eos_ids: tuple[int, ...]
    pad_id: int
    valid_vocab: int | None      # = RLConfig.valid_vocab
    reflection_prompts: int      # M fixed extra slots (0 without ISR)
    reflection_width: int        # their prompt width
    template: reflection.ReflectionTemplate | None
    sampling_chunk: int = 0      # rows per sampler call (0: all rows in one call)
    sampling_slots: int = 0      # rows decoding at once within a call, refilled as rows end (0: all)
    plain_alone: bool = True     # P·G rows split over the devices: a step with no reflection prompt samples
                                 # the plain prompts alone, at their own width
    reflection_alone: bool = False  # M·G rows split too: reflection prompts are sampled in calls of their own,
                                    # at their own width (else with the plain ones, all at the wider width)


def prompt_width(bank: QuestionBank, settings: RolloutSettings) -> int:
    """The sampler's prompt width: plain prompts and reflection prompts share one padded width."""
    return max(bank.prompt_tokens.shape[1], settings.reflection_width if settings.reflection_prompts else 0)


def _left_pad(tokens, mask, width: int, pad_id: int):
    extra = width - tokens.shape[1]
    return (np.pad(tokens, ((0, 0), (extra, 0)), constant_values=pad_id), np.pad(mask, ((0, 0), (extra, 0))))


@functools.partial(jax.jit, static_argnames=("cfg", "settings"))
def _reflection_batch(buffer, qids, question_tokens, question_mask, epoch, key, *, cfg: RLConfig,
                      settings: RolloutSettings):
    return reflection.reflection_prompts(
        buffer, qids, question_tokens, question_mask, epoch, key, template=settings.template, tau=cfg.r3.tau,
        start_epoch=cfg.r3.reflection_start_epoch, max_prompts=settings.reflection_prompts,
        attempt_tokens=cfg.r3.reflection_attempt_tokens, width=settings.reflection_width, pad_id=settings.pad_id,
        end_ids=settings.eos_ids)


@dataclasses.dataclass
class StepRollouts:
    batch: rl_batch.RolloutBatch
    texts: list[str]             # the responses this host graded (all of them with one process)
    sample_s: float              # time not spent grading: prompts, sampling (what grading did not hide)
    grade_s: float               # time this host spent decoding and grading
    generated_tokens: int
    sampled: tuple = ()          # (prompts, prompt width) per part sampled: a new one compiles new sampler programs


def _grade_rows(part, rows_qids, rows_valid, bank, tokenizer, grader, cfg: RLConfig):
    """This process's rows of one sampled chunk, decoded and graded here; (correct, rewards) as global arrays
    sharded like the chunk's rows (each host grades only the responses its devices hold)."""
    rows, (tokens, lengths, truncated) = hosts.local_rows(part.tokens, part.lengths, part.truncated)
    keep = rows_valid[rows]                                            # rows of unused slots are not graded
    texts = prompts.decode_responses(tokenizer, tokens[keep], lengths[keep], truncated[keep])
    answers = [bank.problems[q].answers for q in rows_qids[rows][keep]]
    graded = rewards.grade_batch(texts, answers, num_tokens=lengths[keep], grader=grader,
                                 max_length=cfg.max_length_reward)
    correct, reward = np.zeros(len(rows), bool), np.zeros(len(rows), np.float32)
    correct[keep] = [r.correct for r in graded]
    reward[keep] = [r.reward for r in graded]
    return hosts.from_local_rows(part.lengths, correct), hosts.from_local_rows(part.lengths, reward), texts


def threads_per_call(params) -> bool:
    """Whether a step's sampler calls each run from a thread of their own: on a CPU
    (`attention_plan.CpuMechanisms`), where several programs may run at once (one process, every parameter on
    one device: `parts.device_of`). XLA:CPU runs a program whose inputs are
    ready in the thread that calls it, so calls made from one thread run one after the other, each leaving part
    of the cores idle (a decode step's ops are small); from a thread each they overlap. The GRPO bench's plain
    and reflection calls took 0.17 s together against 0.22 s in turn, with the same tokens to the bit: a call's
    numbers do not depend on what else runs. (`generate` also splits a small model's call into parts,
    `parts.auto_parts`; all calls' parts then share the cores: 0.13 s.)"""
    device = sampling_parts.device_of(params)
    return device is not None and attention_plan.cpu_mechanisms(device).threads_per_call


def _run_now(fn, *args) -> futures.Future:
    """fn(*args) called in this thread, as a finished future (`collect`'s calls when they share one thread)."""
    done = futures.Future()
    done.set_result(fn(*args))
    return done


@functools.partial(jax.jit, static_argnames=("keep", "empty", "pad_id"))
def _join(parts, graded, *, keep: tuple[int, ...], empty: int = 0, pad_id: int = 0):
    """The sampler calls' rollouts and verdicts as one batch: the first keep[i] rows of call i (a call padded
    with copies of a prompt loses those rows), then `empty` rows for reflection slots that were not sampled (no
    response: length 0, pad tokens, wrong, reward 0), in one program: on XLA:CPU, several small programs with
    collectives in flight at once can deadlock."""
    def join(*xs, fill=0):
        x = jnp.concatenate([x[:k] for x, k in zip(xs, keep, strict=True)])
        return jnp.concatenate([x, jnp.full((empty, *x.shape[1:]), fill, x.dtype)]) if empty else x

    rollout = type(parts[0])(**{f.name: join(*(getattr(p, f.name) for p in parts),
                                             fill=pad_id if f.name == "tokens" else 0)
                                for f in dataclasses.fields(parts[0])})
    return rollout, join(*(c for c, _ in graded)), join(*(r for _, r in graded))


_filter_groups = jax.jit(dapo.filter_groups, static_argnums=1)  # one program (see `_join`)


def chunk_prompts(num_prompts: int, num_samples: int, sampling_chunk: int) -> int:
    """Prompts per sampler call: `sampling_chunk` rows (0: all) are that many prompts' G samples each. The
    last call of a step may be part-full: it is padded with copies of a prompt whose samples are dropped."""
    if not sampling_chunk:
        return num_prompts
    if sampling_chunk % num_samples:
        raise ValueError(f"sampling_chunk {sampling_chunk} must be a multiple of samples_per_prompt G = "
                         f"{num_samples} (a call samples whole groups)")
    return min(sampling_chunk // num_samples, num_prompts)


def collect(graphdef, params, buffer, bank: QuestionBank, qids: np.ndarray, epoch: int, *, cfg: RLConfig,
            settings: RolloutSettings, num_groups: int, sample_key, reflection_key, tokenizer,
            grader: rewards.GradingPool) -> StepRollouts:
    """Steps 1-3 of one iteration: prompts (plain + reflection slots), G samples each, grades, one batch.

    `qids` may hold more questions than `num_groups` (DAPO's over-sampling); `dapo.filter_groups` then keeps
    `num_groups` plain groups. Prompts are sampled `settings.sampling_chunk` rows at a time (chunk c with
    `fold_in(sample_key, c)` when there are several, all started before the first is graded: from a thread each
    where a call runs in the thread that makes it, `threads_per_call`); the host grades chunk c while the devices
    sample c + 1.
    A step where ISR built no reflection prompt (before `reflection_start_epoch`, or no hard question) samples
    the plain prompts alone at their own width (`settings.plain_alone`); the empty slots' rows carry no
    response. Otherwise the reflection prompts (longer: they quote an attempt) get calls of their own at their
    own width when their rows split over the devices (`settings.reflection_alone`), so the plain prompts are
    not padded to it. On several hosts, each decodes and grades only the rows its own devices sampled."""
    start = time.perf_counter()
    width = prompt_width(bank, settings)
    tokens, mask = _left_pad(bank.prompt_tokens[qids], bank.prompt_mask[qids], width, settings.pad_id)
    all_qids, group_valid = qids, np.ones(len(qids), bool)
    is_reflection = np.zeros(len(qids), bool)
    if settings.reflection_prompts:
        refl = _reflection_batch(buffer, jnp.asarray(qids), bank.question_tokens[qids], bank.question_mask[qids],
                                 epoch, reflection_key, cfg=cfg, settings=settings)
        refl = jax.tree.map(hosts.fetch, refl)  # a few rows, the same on every host
        r_tokens, r_mask = _left_pad(refl.tokens, refl.mask, width, settings.pad_id)
        tokens, mask = np.concatenate([tokens, r_tokens]), np.concatenate([mask, r_mask])
        all_qids = np.concatenate([qids, refl.qids])
        group_valid = np.concatenate([group_valid, refl.valid])
        is_reflection = np.concatenate([is_reflection, np.ones(settings.reflection_prompts, bool)])

    g, n, p = settings.num_samples, len(all_qids), len(qids)
    plain = (bank.prompt_tokens[qids], bank.prompt_mask[qids])          # the plain prompts at their own width
    if not settings.reflection_prompts:
        segments = [(0, p, tokens, mask)]
    elif settings.plain_alone and not group_valid[p:].any():
        segments = [(0, p, *plain)]                                     # the reflection slots stay empty
    elif settings.reflection_alone:
        segments = [(0, p, *plain), (p, n, refl.tokens, refl.mask)]
    else:
        segments = [(0, n, tokens, mask)]
    calls = []  # (prompt of each group, tokens, mask, rows kept): a segment's last call is padded with copies
    for first, stop, seg_tokens, seg_mask in segments:
        per_call = chunk_prompts(stop - first, g, settings.sampling_chunk)
        for i in range(first, stop, per_call):
            group_prompts = np.minimum(np.arange(i, i + per_call), stop - 1)
            take = group_prompts - first
            calls.append((group_prompts, seg_tokens[take], seg_mask[take], min(per_call, stop - i) * g))
    def sample(c, call_tokens, call_mask):
        return generate((graphdef, params), call_tokens, call_mask,
                        sample_key if len(calls) == 1 else jax.random.fold_in(sample_key, c),
                        max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_p=settings.top_p,
                        eos_ids=settings.eos_ids, num_samples=g, valid_vocab=settings.valid_vocab,
                        pad_id=settings.pad_id, slots=settings.sampling_slots or None,
                        share_prompts=True)  # a static call's G samples read their prompt from one copy

    parts, graded, texts, grade_s = [], [], [], 0.0
    with futures.ThreadPoolExecutor(max_workers=len(calls)) as pool:
        start_call = pool.submit if len(calls) > 1 and threads_per_call(params) else _run_now
        pending = [start_call(sample, c, call_tokens, call_mask)
                   for c, (_, call_tokens, call_mask, _) in enumerate(calls)]   # all started, none waited for
        for (group_prompts, _, _, kept), call in zip(calls, pending, strict=True):
            part = call.result()
            jax.block_until_ready(part.lengths)
            t = time.perf_counter()
            rows_qids = np.repeat(all_qids[group_prompts], g)
            rows_valid = np.repeat(group_valid[group_prompts], g) & (np.arange(len(rows_qids)) < kept)  # padding
            correct, reward, part_texts = _grade_rows(part, rows_qids, rows_valid, bank, tokenizer, grader, cfg)
            parts.append(part)
            graded.append((correct, reward))
            texts.extend(part_texts)
            grade_s += time.perf_counter() - t
    sampled = segments[-1][1]
    rollout, correct, reward = _join(parts, graded, keep=tuple(call[-1] for call in calls), empty=(n - sampled) * g,
                                     pad_id=settings.pad_id)
    sampled_tokens = hosts.fetch(jnp.sum(jnp.where(jnp.asarray(np.repeat(group_valid, g)), rollout.lengths, 0)))
    batch = rl_batch.from_rollout(rollout, g, qids=all_qids, prompt_tokens=tokens[:n], prompt_mask=mask[:n],
                                  correct=correct, rewards=reward, group_valid=group_valid,
                                  is_reflection=is_reflection)
    if cfg.dynamic_sampling:
        batch = _filter_groups(batch, num_groups)
    return StepRollouts(batch=batch, texts=texts, sample_s=time.perf_counter() - start - grade_s, grade_s=grade_s,
                        generated_tokens=int(sampled_tokens),
                        sampled=tuple((stop - first, seg_tokens.shape[1]) for first, stop, seg_tokens, _ in segments))
