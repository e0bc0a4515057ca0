"""In-Context Self-Reflection (ISR, R3-SPEC §5): extra prompts that show a hard question its own failure.

From epoch `start_epoch` on (1-based; the spec's default 2 is the second pass over the data), every question of
the batch that is **hard** gets one extra prompt next to its plain one:

    hard(q)    ⇔  corrects_q / attempts_q < τ  and  the buffer holds a wrong response of q      (DECIDED τ = 0.2)
    prompt     =  q ⊕ o_h ⊕ p_r                                                                 (R3-SPEC §5)

o_h is one stored wrong response of q, drawn uniformly, cut to its last `attempt_tokens` tokens (the end of a
failed attempt is where it went wrong or gave up); p_r is the reflection instruction. The prompt is one user
turn of the model's chat template:

    user text  =  question_text(problem) "\\n\\n" ATTEMPT_HEADER {attempt} "\\n\\n" {instruction}

In token ids (`ReflectionTemplate`): prefix ⊕ question ⊕ between ⊕ attempt tail ⊕ suffix, where prefix is the
template's text before the user message (BOS, `<｜User｜>`), between is "\\n\\n" ATTEMPT_HEADER and suffix is
"\\n\\n" instruction followed by the generation prompt (`<｜Assistant｜><think>\\n` for R1-Distill). The pieces
are tokenized separately and the attempt is the model's own ids, so the ids can differ from a fresh encoding
of the whole text at the seams, but they decode to exactly the rendered prompt.

The split keeps the tokenizer on the host, once per run (`make_template`, `question_ids`); building the
prompts (`reflection_prompts`) is pure and jittable: fixed shapes, at most `max_prompts` prompts per batch,
unused slots flagged by `valid`. A reflection group is graded against, and stored under, its original
question's index (`ReflectionBatch.qids`), so a correct answer found with help is replayed into the plain
question's group (cross-context replay, R3-SPEC §4).
"""

from __future__ import annotations

import dataclasses
import fractions
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from r3jax.data import prompts
from r3jax.rl import replay

DEFAULT_REFLECTION_INSTRUCTION = (
    "Here is an earlier attempt at this problem that reached a wrong answer. Find where its reasoning went "
    "wrong, then solve the problem again and put the final answer in \\boxed{}.")
ATTEMPT_HEADER = "Earlier attempt (its last part):\n"

# Stand-ins for the question and the attempt while the chat template is rendered once as text.
_QUESTION_MARK = "\x00r3jax-reflection-question\x00"
_ATTEMPT_MARK = "\x00r3jax-reflection-attempt\x00"
_MAX_DENOMINATOR = 10_000  # τ is read as a fraction a/b with b <= this: exact for decimals with <= 4 places


def reflection_text(question: str, attempt: str, instruction: str = DEFAULT_REFLECTION_INSTRUCTION) -> str:
    """The user message of a reflection prompt: question ⊕ attempt ⊕ instruction (R3-SPEC §5).

    `question` is the plain prompt's user text (`prompts.question_text(problem)`), `attempt` the text of the
    (cut) wrong response. `make_template` renders this very function, so host text and device ids agree.
    """
    return f"{question}\n\n{ATTEMPT_HEADER}{attempt}\n\n{instruction}"


@dataclasses.dataclass(frozen=True, eq=False)
class ReflectionTemplate:
    """The fixed token ids around the question and the attempt: prefix ⊕ q ⊕ between ⊕ o_h ⊕ suffix.

    Three 1-D int32 numpy arrays (read-only). Compared and hashed by identity (`eq=False`), so it can be closed
    over by, or passed as a static argument to, a jitted function.
    """

    prefix: np.ndarray
    between: np.ndarray
    suffix: np.ndarray

    def __post_init__(self):
        for name in ("prefix", "between", "suffix"):
            ids = np.array(getattr(self, name), dtype=np.int32).reshape(-1)
            ids.flags.writeable = False
            object.__setattr__(self, name, ids)

    @property
    def overhead(self) -> int:
        """Template tokens per prompt (everything but the question and the attempt)."""
        return len(self.prefix) + len(self.between) + len(self.suffix)


def make_template(tokenizer, instruction: str = DEFAULT_REFLECTION_INSTRUCTION) -> ReflectionTemplate:
    """Renders `reflection_text` with placeholders through the chat template and encodes the three pieces.

    Host side, once per tokenizer. The template must pass the user message through verbatim (every chat
    template does); one that drops or repeats it is an error here rather than a garbled prompt later.
    """
    rendered = prompts.render(tokenizer, reflection_text(_QUESTION_MARK, _ATTEMPT_MARK, instruction))
    if rendered.count(_QUESTION_MARK) != 1 or rendered.count(_ATTEMPT_MARK) != 1:
        raise ValueError("the chat template does not render the user message exactly once and verbatim; "
                         f"cannot build a reflection template from {rendered!r}")
    prefix, rest = rendered.split(_QUESTION_MARK)
    between, suffix = rest.split(_ATTEMPT_MARK)
    return ReflectionTemplate(*(np.asarray(prompts.encode(tokenizer, s), np.int32) for s in (prefix, between, suffix)))


def question_ids(tokenizer, problem: str) -> list[int]:
    """Ids of `prompts.question_text(problem)` alone, the q of a reflection prompt (no special tokens)."""
    return prompts.encode(tokenizer, prompts.question_text(problem))


def required_width(template: ReflectionTemplate, question_width: int, attempt_tokens: int) -> int:
    """The worst-case reflection prompt length: len(prefix) + Tq + len(between) + attempt_tokens + len(suffix)."""
    return template.overhead + int(question_width) + int(attempt_tokens)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReflectionBatch:
    """M reflection prompts, left-padded (last real token in column W - 1), ready for the sampler.

    tokens [M, W] int32  prompt ids; pad_id left of the prompt
    mask   [M, W] bool   True on real tokens
    qids   [M]    int32  the original question's index: rollouts are graded against it and stored under it
    rows   [M]    int32  position in the batch of the plain prompt it came from
    valid  [M]    bool   the slot holds a reflection prompt

    An unused slot (valid False) still holds a well-formed filler prompt (a batch question with an empty
    attempt; the sampler rejects all-padding rows) and in-range qids/rows; everything downstream masks by valid.
    """

    tokens: jax.Array
    mask: jax.Array
    qids: jax.Array
    rows: jax.Array
    valid: jax.Array

    @property
    def num_prompts(self) -> int:
        return self.tokens.shape[0]

    @property
    def added(self) -> jax.Array:  # [] int32, the `r3/isr_prompts` metric
        return self.valid.sum().astype(jnp.int32)


def _tau_fraction(tau) -> fractions.Fraction:
    """τ as an exact fraction a/b, so that `accuracy < τ` is integer arithmetic: corrects · b < a · attempts."""
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not 0 <= tau <= 1:
        raise ValueError(f"ISR tau must be a number with 0 <= tau <= 1, got {tau!r}")
    return fractions.Fraction(float(tau)).limit_denominator(_MAX_DENOMINATOR)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"ISR {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def hard_questions(buffer: replay.SampleBuffer, qids, epoch, *, tau: float = 0.2, start_epoch: int = 2) -> jax.Array:
    """[P] bool: row p asks a hard question and ISR is active (R3-SPEC §5).

    hard[p] ⇔ epoch + 1 >= start_epoch                      (epoch 0-based, start_epoch 1-based)
            ∧ corrects[q] / attempts[q] < τ                  exactly: corrects · b < a · attempts, τ = a/b
            ∧ q holds a filled wrong slot                    (so attempts > 0)
            ∧ p is the first row of the batch asking q       (a duplicate question gets one prompt)
    with q = qids[p]; a qid outside [0, Q) is never hard. `epoch` may be traced.
    """
    frac = _tau_fraction(tau)
    start_epoch = _check_int("start_epoch", start_epoch, 1)
    qids = jnp.asarray(qids, jnp.int32)
    in_range = (qids >= 0) & (qids < buffer.num_questions)
    q = jnp.where(in_range, qids, 0)
    below = buffer.corrects[q] * frac.denominator < frac.numerator * buffer.attempts[q]
    has_wrong = buffer.wrong.filled[q].any(axis=1)
    same = qids[:, None] == qids[None, :]                                        # [P, P]
    first = jnp.argmax(same, axis=1) == jnp.arange(qids.shape[0])
    active = jnp.asarray(epoch) + 1 >= start_epoch
    return active & in_range & below & has_wrong & first


def choose_rows(buffer: replay.SampleBuffer, qids, hard, max_prompts: int) -> tuple[jax.Array, jax.Array]:
    """(rows [M], valid [M]) with M = max_prompts: the hard rows, lowest accuracy first, ties by batch position.

    A stable argsort of accuracy (non-hard rows sent past every accuracy) keeps the order deterministic. Slots
    past the hard rows are valid False and point at some batch row (a filler).
    """
    qids = jnp.asarray(qids, jnp.int32)
    p = qids.shape[0]
    accuracy = buffer.accuracy()[jnp.clip(qids, 0, buffer.num_questions - 1)]
    order = jnp.argsort(jnp.where(hard, accuracy, 2.0), stable=True).astype(jnp.int32)    # [P]
    rows = jnp.pad(order, (0, max(0, max_prompts - p)))[:max_prompts]
    valid = hard[rows] & (jnp.arange(max_prompts) < p)
    return rows, valid


def attempt_tail(tokens, lengths, attempt_tokens: int, end_ids: tuple[int, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """(tokens [M, A], mask [M, A]): the last A = attempt_tokens real tokens of each response, right-aligned.

    tokens [M, T] hold a response in columns 0..L-1 (L = lengths, clipped to T). A final token in `end_ids` (the
    sampler counts its end token in L) is dropped first: an end-of-sequence id inside a user turn is noise.
    Shorter responses keep all their tokens and leave the first columns masked.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    length = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, tokens.shape[1])
    if end_ids:
        last = jnp.take_along_axis(tokens, jnp.maximum(length - 1, 0)[:, None], axis=1)[:, 0]
        length = length - ((length > 0) & jnp.isin(last, jnp.asarray(end_ids, jnp.int32))).astype(jnp.int32)
    keep = jnp.minimum(length, attempt_tokens)                                   # [M]
    column = jnp.arange(attempt_tokens)
    source = length[:, None] - attempt_tokens + column[None, :]                  # [M, A]
    mask = column[None, :] >= attempt_tokens - keep[:, None]
    tail = jnp.take_along_axis(tokens, jnp.clip(source, 0, tokens.shape[1] - 1), axis=1)
    return jnp.where(mask, tail, 0), mask


def compact_left(tokens, mask, width: int, pad_id: int) -> tuple[jax.Array, jax.Array]:
    """Moves each row's real tokens (in order) to its last columns: [M, S] with holes -> [M, W] left-padded.

    Real token j of a row with n real tokens goes to column W - n + cumsum(mask)_j - 1; the rest is pad_id.
    Requires n <= W (checked statically by the caller).
    """
    mask = jnp.asarray(mask, bool)
    total = mask.sum(axis=1, dtype=jnp.int32)                                    # [M]
    column = width - total[:, None] + jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1
    column = jnp.where(mask, column, width)                                      # out of range: dropped
    row = jnp.arange(tokens.shape[0])[:, None]
    out = jnp.full((tokens.shape[0], width), pad_id, jnp.int32).at[row, column].set(tokens, mode="drop")
    return out, jnp.arange(width)[None, :] >= width - total[:, None]


def _segments(template: ReflectionTemplate, question, question_mask, tail, tail_mask):
    """prefix ⊕ question ⊕ between ⊕ tail ⊕ suffix as [M, S] tokens and mask, holes included."""
    m = question.shape[0]

    def fixed(ids):
        return jnp.broadcast_to(jnp.asarray(ids), (m, len(ids))), jnp.ones((m, len(ids)), bool)

    parts = [fixed(template.prefix), (question, question_mask), fixed(template.between), (tail, tail_mask),
             fixed(template.suffix)]
    return (jnp.concatenate([t.astype(jnp.int32) for t, _ in parts], axis=1),
            jnp.concatenate([k.astype(bool) for _, k in parts], axis=1))


def reflection_prompts(buffer: replay.SampleBuffer, qids, question_tokens, question_mask, epoch, key, *,
                       template: ReflectionTemplate, tau: float = 0.2, start_epoch: int = 2, max_prompts: int,
                       attempt_tokens: int, width: int, pad_id: int,
                       end_ids: tuple[int, ...] = ()) -> ReflectionBatch:
    """ISR prompts for the current batch (R3-SPEC §5; Algorithm 1, line 1). Pure; jit with the keywords static.

    qids [P] question indices of the batch; question_tokens / question_mask [P, Tq] the ids of
    `question_text(problem)` (`question_ids`), padded on either side, mask on real tokens; epoch the 0-based
    epoch of the iterator (may be traced); key draws the stored wrong response.

    1. hard rows (`hard_questions`): ISR active (epoch + 1 >= start_epoch), accuracy < τ, a stored failure.
    2. up to max_prompts of them, lowest accuracy first (`choose_rows`).
    3. o_h: one filled wrong slot of each, uniformly at random (`replay.retrieve`, k = 1), cut to its last
       attempt_tokens tokens (`attempt_tail`; a final token in end_ids is left out).
    4. prefix ⊕ q ⊕ between ⊕ o_h ⊕ suffix, compacted and left-padded to width (`compact_left`).
    width must hold the worst case, `required_width(template, Tq, attempt_tokens)`; max_prompts 0 gives [0, W].
    """
    max_prompts = _check_int("max_prompts", max_prompts, 0)
    attempt_tokens = _check_int("attempt_tokens", attempt_tokens, 1)
    width, pad_id = _check_int("width", width, 1), _check_int("pad_id", pad_id, 0)
    qids = jnp.asarray(qids, jnp.int32)
    question_tokens = jnp.asarray(question_tokens, jnp.int32)
    _check_shapes(qids, question_tokens, question_mask, max_prompts)
    needed = required_width(template, question_tokens.shape[1], attempt_tokens)
    if width < needed:
        raise ValueError(f"ISR width {width} is too small: the longest reflection prompt has {needed} tokens = "
                         f"template {template.overhead} (prefix {len(template.prefix)}, between "
                         f"{len(template.between)}, suffix {len(template.suffix)}) + question width "
                         f"{question_tokens.shape[1]} + attempt_tokens {attempt_tokens}")
    hard = hard_questions(buffer, qids, epoch, tau=tau, start_epoch=start_epoch)
    if max_prompts == 0:
        empty = jnp.zeros((0,), jnp.int32)
        return ReflectionBatch(tokens=jnp.zeros((0, width), jnp.int32), mask=jnp.zeros((0, width), bool),
                               qids=empty, rows=empty, valid=jnp.zeros((0,), bool))
    rows, valid = choose_rows(buffer, qids, hard, max_prompts)
    chosen = qids[rows]
    attempt, lengths, _ = replay.retrieve(buffer.wrong, chosen, valid, 1, key)          # [M, 1, T], [M, 1]
    tail, tail_mask = attempt_tail(attempt[:, 0], lengths[:, 0], attempt_tokens, tuple(end_ids))
    seg_tokens, seg_mask = _segments(template, question_tokens[rows], jnp.asarray(question_mask, bool)[rows],
                                     tail, tail_mask)
    tokens, mask = compact_left(seg_tokens, seg_mask, width, pad_id)
    return ReflectionBatch(tokens=tokens, mask=mask, qids=chosen, rows=rows, valid=valid)


def _check_shapes(qids, question_tokens, question_mask, max_prompts: int) -> None:
    if qids.ndim != 1 or question_tokens.ndim != 2 or question_tokens.shape[0] != qids.shape[0]:
        raise ValueError(f"qids {qids.shape} and question_tokens {question_tokens.shape} must be [P] and [P, Tq]")
    if jnp.shape(question_mask) != question_tokens.shape:
        raise ValueError(f"question_mask {jnp.shape(question_mask)} must match question_tokens "
                         f"{question_tokens.shape}")
    if max_prompts and qids.shape[0] == 0:
        raise ValueError("ISR needs at least one batch question to build max_prompts > 0 prompt slots")
