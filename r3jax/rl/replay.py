"""The sample buffer and Cross-Context Replay (CCR, R3-SPEC §4).

The buffer is a fixed-shape pytree of device arrays indexed by the dense question index q (a
`ProblemSet` position): per question a ring of `slots_correct` correct and a ring of `slots_wrong`
wrong responses (tokens, length, step written), plus attempt and correct counters. It lives in the
training state, is sharded along Q over the whole mesh (`buffer_shardings`), and is checkpointed with it.

CCR: a group whose G on-policy responses are all wrong (all correct) gets up to k stored responses of
the same question with the opposite correctness appended, in k fixed extra slots that stay masked when
the buffer has fewer. A reflection group is stored and replayed under its question's index, so a
correct answer found with a reflection prompt can be replayed into the plain question's group.

Memory: Q * (slots_correct + slots_wrong) * T * 4 bytes of tokens; 40k questions x 4 slots x 8192
tokens = 5.2 GB, spread over the mesh.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from r3jax.model import sharding

EMPTY = -1  # `step` of a slot never written


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Ring:
    """Stored responses of one kind (correct or wrong) for every question."""

    tokens: jax.Array   # [Q, S, T] int32
    lengths: jax.Array  # [Q, S] int32 response tokens (0 in an empty slot)
    step: jax.Array     # [Q, S] int32 train step that wrote the slot; EMPTY if never
    next: jax.Array     # [Q] int32 slot the next response goes to (oldest first once full)

    @property
    def filled(self) -> jax.Array:  # [Q, S]
        return self.step != EMPTY


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleBuffer:
    correct: Ring
    wrong: Ring
    attempts: jax.Array  # [Q] int32 graded on-policy responses (plain and reflection)
    corrects: jax.Array  # [Q] int32 of which correct

    @property
    def num_questions(self) -> int:
        return self.attempts.shape[0]

    def accuracy(self) -> jax.Array:
        """[Q] historical accuracy; 0 for a question never attempted."""
        return self.corrects / jnp.maximum(self.attempts, 1)


def _empty_ring(q: int, slots: int, t: int) -> Ring:
    return Ring(tokens=jnp.zeros((q, slots, t), jnp.int32), lengths=jnp.zeros((q, slots), jnp.int32),
                step=jnp.full((q, slots), EMPTY, jnp.int32), next=jnp.zeros((q,), jnp.int32))


def init_buffer(num_questions: int, max_response_tokens: int, *, slots_correct: int = 2,
                slots_wrong: int = 2) -> SampleBuffer:
    """An empty buffer for `num_questions` questions of responses up to `max_response_tokens` long."""
    for name, value in (("num_questions", num_questions), ("max_response_tokens", max_response_tokens),
                        ("slots_correct", slots_correct), ("slots_wrong", slots_wrong)):
        if int(value) < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    return SampleBuffer(correct=_empty_ring(num_questions, slots_correct, max_response_tokens),
                        wrong=_empty_ring(num_questions, slots_wrong, max_response_tokens),
                        attempts=jnp.zeros((num_questions,), jnp.int32),  # two buffers: the step donates both
                        corrects=jnp.zeros((num_questions,), jnp.int32))


def buffer_shardings(buffer: SampleBuffer, mesh) -> SampleBuffer:
    """NamedShardings from the sharding table: every array split along Q over the mesh (`buffer_q*`)."""
    names = {1: "buffer_q", 2: "buffer_qs", 3: "buffer_qst"}
    return jax.tree.map(lambda x: sharding.named(mesh, names[x.ndim], x.shape), buffer)


def _ring_insert(ring: Ring, qids, tokens, lengths, keep, step) -> Ring:
    """Writes the rows with `keep` into their question's ring, most recent last.

    Several rows may share a question (a group's G responses): row b takes slot
    (next[q] + rank of b among the kept rows of q) mod S, and rows that a later row of the same batch
    would overwrite are dropped, so the scatter's indices are unique.
    """
    slots = ring.lengths.shape[1]
    same = (qids[:, None] == qids[None, :]) & keep[:, None] & keep[None, :]    # [B, B]
    earlier = jnp.tril(same, k=-1).sum(axis=1)                                  # [B] rank among its q
    total = same.sum(axis=1)                                                    # [B] kept rows of its q
    write = keep & (earlier >= total - slots)                                   # the last S of each q
    slot = (ring.next[qids] + earlier) % slots
    q_idx = jnp.where(write, qids, ring.lengths.shape[0])                      # out of range: dropped
    t = ring.tokens.shape[2]
    tokens = jnp.pad(tokens, ((0, 0), (0, max(0, t - tokens.shape[1]))))[:, :t]
    counts = jnp.zeros_like(ring.next).at[qids].add(keep.astype(jnp.int32))
    return Ring(tokens=ring.tokens.at[q_idx, slot].set(tokens, mode="drop"),
                lengths=ring.lengths.at[q_idx, slot].set(lengths, mode="drop"),
                step=ring.step.at[q_idx, slot].set(jnp.broadcast_to(step, qids.shape).astype(jnp.int32),
                                                   mode="drop"),
                next=(ring.next + counts) % slots)


def insert(buffer: SampleBuffer, qids, tokens, lengths, correct, valid, step) -> SampleBuffer:
    """Adds graded on-policy responses (Algorithm 1, line 11) and counts them as attempts.

    qids [B] question indices; tokens [B, T'] (T' <= T is padded, longer is cut); lengths [B];
    correct [B] bool; valid [B] bool (False rows, e.g. unused reflection slots, change nothing).
    step: the optimizer step that sampled them, >= 0 (a ring slot's step -1 means "empty", so a
    negative step would store an entry that retrieval never sees).
    """
    if not isinstance(step, jax.core.Tracer) and int(step) < 0:
        raise ValueError(f"replay.insert needs the step that sampled the responses (>= 0), got {int(step)}")
    qids, tokens = jnp.asarray(qids, jnp.int32), jnp.asarray(tokens, jnp.int32)
    correct, valid = jnp.asarray(correct, bool), jnp.asarray(valid, bool)
    lengths = jnp.minimum(jnp.asarray(lengths, jnp.int32), buffer.correct.tokens.shape[2])
    valid = valid & (qids >= 0) & (qids < buffer.num_questions)
    return SampleBuffer(
        correct=_ring_insert(buffer.correct, qids, tokens, lengths, valid & correct, step),
        wrong=_ring_insert(buffer.wrong, qids, tokens, lengths, valid & ~correct, step),
        attempts=buffer.attempts.at[qids].add(valid.astype(jnp.int32), mode="drop"),
        corrects=buffer.corrects.at[qids].add((valid & correct).astype(jnp.int32), mode="drop"))


def retrieve(ring: Ring, qids, need, k: int, key):
    """Up to k stored responses per question, chosen uniformly without replacement among filled slots.

    qids [P]; need [P] bool (rows that want a replay). Returns (tokens [P, k, T], lengths [P, k],
    valid [P, k]); fewer than k valid where the ring holds fewer (possibly none).
    """
    filled = ring.filled[qids] & need[:, None]                                  # [P, S]
    noise = jax.random.uniform(key, filled.shape)
    score = jnp.where(filled, noise, -1.0)                                      # filled slots first, random
    k_eff = min(k, filled.shape[1])
    _, slot = jax.lax.top_k(score, k_eff)                                       # [P, k_eff]
    valid = jnp.take_along_axis(filled, slot, axis=1)
    tokens = ring.tokens[qids[:, None], slot]                                   # [P, k_eff, T]
    lengths = jnp.where(valid, ring.lengths[qids[:, None], slot], 0)
    pad = k - k_eff                                                             # k > S: slots never filled
    if pad:
        tokens = jnp.pad(tokens, ((0, 0), (0, pad), (0, 0)))
        lengths, valid = jnp.pad(lengths, ((0, 0), (0, pad))), jnp.pad(valid, ((0, 0), (0, pad)))
    return jnp.where(valid[..., None], tokens, 0), lengths, valid


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Replay:
    """The k replay slots of every group."""

    tokens: jax.Array   # [P, k, T]
    lengths: jax.Array  # [P, k]
    correct: jax.Array  # [P, k] bool: the stored correctness
    valid: jax.Array    # [P, k] bool: a replayed response fills the slot

    @property
    def appended(self) -> jax.Array:  # [P] int32
        return self.valid.sum(axis=1).astype(jnp.int32)


def collapsed(correct, response_valid, group_valid):
    """([P] all wrong, [P] all correct): the valid groups whose on-policy responses all got one verdict."""
    n = response_valid.sum(axis=1)
    n_correct = (correct & response_valid).sum(axis=1)
    live = group_valid & (n > 0)
    return live & (n_correct == 0), live & (n_correct == n)


def cross_context_replay(buffer: SampleBuffer, qids, correct, response_valid, group_valid, k: int, key) -> Replay:
    """CCR (R3-SPEC §4): all-wrong groups fetch stored correct responses, all-correct groups wrong ones.

    correct / response_valid: [P, G] on-policy correctness and which slots hold a response; group_valid [P].
    Mixed groups (and invalid ones) get nothing. Retrieval only reads the buffer: insert this step's
    responses afterwards, so a group never replays itself.
    """
    all_wrong, all_correct = collapsed(correct, response_valid, group_valid)
    key_c, key_w = jax.random.split(key)
    tok_c, len_c, ok_c = retrieve(buffer.correct, qids, all_wrong, k, key_c)
    tok_w, len_w, ok_w = retrieve(buffer.wrong, qids, all_correct, k, key_w)
    use_c = all_wrong[:, None]
    return Replay(tokens=jnp.where(use_c[..., None], tok_c, tok_w), lengths=jnp.where(use_c, len_c, len_w),
                  correct=jnp.broadcast_to(use_c, ok_c.shape), valid=ok_c | ok_w)


def replay_needs(buffer: SampleBuffer, qids, correct, response_valid, group_valid, k: int):
    """What `cross_context_replay` will fill, known before it draws: ([] int32 replayed responses,
    [] int32 the longest response it may pick).

    A collapsed group gets min(k, stored responses of the needed kind) of them, whichever are drawn; the
    longest is over every stored one it may draw from. The host reads both to size the step (`layout.py`)."""
    all_wrong, all_correct = collapsed(correct, response_valid, group_valid)
    count, longest = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
    for ring, need in ((buffer.correct, all_wrong), (buffer.wrong, all_correct)):
        filled = ring.filled[qids] & need[:, None]                              # [P, S]
        count += jnp.minimum(filled.sum(axis=1), k).sum().astype(jnp.int32)
        longest = jnp.maximum(longest, jnp.max(jnp.where(filled, ring.lengths[qids], 0), initial=0))
    return count, longest
