"""The train step's layout: how many response columns and replay rows one step's loss computes on.

A step's rollouts are [P, G, T] with T the generation budget, but responses are long-tailed: most end long
before T. And CCR's k replay slots per group (R3-SPEC §4) are filled only in collapsed groups whose question
has stored responses of the other verdict, often none. Both are known on the host after grading, before the
step: `choose` reads the longest response the step will use (on-policy, or stored and replayable) and how many
responses CCR will append, and rounds each up to a bucket. The step then runs on

    P·G on-policy rows + R replay rows,  each [prompt | first W response columns],

instead of P·(G + k) rows of T columns, with the same loss and gradients: the columns and rows it drops are
masked out of the loss either way. The buffer keeps full-width rows; the step reads their first W columns.
Two more cuts of the same kind: the prompt columns (`prompt_width`: the last Wp columns of the left-aligned
prompts, Wp bucketed like W from the longest prompt of a valid group), and the groups (`groups`: the trailing
reflection slots that ISR left empty this step, which R³ reserves in every batch, have no row in the loss).

Rows that share a prompt (a group's G rows, replay rows of the same question) can run it once per micro-batch
(`shared_prompts`, `loss.shared_prompt_logprobs`): how many distinct prompts a micro-batch holds at most
follows from the same static numbers.

Prompts differ in width: ISR's reflection prompts carry a past answer and are about twice as wide as the plain
questions before them. With `narrow_groups` set, the loss runs in two segments (`segments`): the on-policy rows
of the first `narrow_groups` groups (the plain ones) at their own prompt width `narrow_prompt_width`, then the
rest (reflection groups, replay rows) at `prompt_width`, each split into micro-batches of at most the rows that
`num_micro_batches` gives the whole loss. And with `replay_apart`, the replay rows train in a segment of their
own after the on-policy rows: a micro-batch of whole groups in group order reads each prompt once per group in
attention (`Segment.group_rows`), one that holds a replay row reads every prompt row by row.

Buckets keep the number of compiled step programs small (one per layout a run meets): W and Wp are powers of
two of at least `RLConfig.bucket_min_width`, capped at T and at the prompts' width (`bucket_min_width = 0`:
always T and all prompt columns); R is 0, a quarter, a half or all of P·k, rounded up so that the P·G + R rows
split into micro-batches whose rows split over the mesh's batch devices; the empty reflection groups are left
out only when the rows still split so (`bucket_replay = False`: always P·k and every group, the padded layout).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from r3jax import hosts
from r3jax.model import sharding
from r3jax.rl import replay
from r3jax.rl.algorithm import RLConfig


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static (part of the compiled step): a new layout is a new program."""

    width: int        # W: response columns of every loss row (<= T)
    replay_rows: int  # R: loss rows for replayed responses, after the on-policy rows (<= P·k)
    prompt_width: int | None = None  # Wp: the last Wp columns of the left-aligned prompts (None: all of them)
    groups: int | None = None        # the first `groups` of the P groups have on-policy rows (None: all P)
    narrow_groups: int = 0           # the first groups' on-policy rows train apart at narrow_prompt_width (0: no)
    narrow_prompt_width: int = 0
    replay_apart: bool = False       # the replay rows train in a segment of their own, after the on-policy rows


@dataclasses.dataclass(frozen=True)
class Segment:
    """Consecutive loss rows [start, start + rows) that train together: the last `prompt_width` prompt columns,
    `micro_batches` micro-batches, at most `shared_prompts` distinct prompts in one (0: no fewer than its rows).
    group_rows: G when every micro-batch holds whole groups of G on-policy rows in group order and nothing else
    (no replay row), so its rows read their prompts group by group (0: any order)."""

    start: int
    rows: int
    prompt_width: int
    micro_batches: int
    shared_prompts: int
    group_rows: int = 0


def segments(layout: Layout, num_micro_batches: int, p: int, g: int, prompt_columns: int) -> tuple[Segment, ...]:
    """The loss's row segments for a layout of P groups of G (prompts of `prompt_columns`), in row order: the
    narrow on-policy rows (with `narrow_groups`), the other on-policy rows, and the replay rows, which join
    the on-policy rows before them unless `replay_apart`. One segment runs in `num_micro_batches`
    micro-batches; with several, each runs in micro-batches of at most rows / num_micro_batches rows.
    Whether a segment's rows split evenly is `_splits`'s (and `choose`'s) concern."""
    groups, replay_rows = layout.groups or p, layout.replay_rows
    wide = layout.prompt_width or prompt_columns
    parts = []  # (first group, groups, replay rows, prompt width) of each segment
    if layout.narrow_groups:
        parts.append((0, layout.narrow_groups, 0, layout.narrow_prompt_width))
    rest = groups - layout.narrow_groups
    apart = layout.replay_apart and replay_rows
    if rest or not apart:
        parts.append((layout.narrow_groups, rest, 0 if apart else replay_rows, wide))
    if apart:
        parts.append((groups, 0, replay_rows, wide))
    per = (groups * g + replay_rows) // num_micro_batches
    segs = []
    for first, count, replayed, width in parts:
        rows = count * g + replayed
        m = num_micro_batches if len(parts) == 1 else -(-rows // per)
        segs.append(Segment(first * g, rows, width, m, shared_prompts(count, g, replayed, m),
                            _group_rows(rows, m, g, replayed)))
    return tuple(segs)


def _group_rows(rows: int, micro_batches: int, g: int, replay_rows: int) -> int:
    """`Segment.group_rows` of a segment that starts at a group boundary: G when its micro-batches are whole
    groups of G > 1 on-policy rows, else 0."""
    regular = g > 1 and not replay_rows and rows % micro_batches == 0 and (rows // micro_batches) % g == 0
    return g if regular else 0


def reads_by_group(seg: Segment, devices: int = 1) -> bool:
    """Whether the segment's rows can read their prompts group by group with the rows split over `devices` batch
    devices: every micro-batch is whole groups in order (`Segment.group_rows`), and so is each device's share of
    it (no group straddles two devices, so no row, prompt or key crosses shards)."""
    return bool(seg.group_rows) and (seg.rows // seg.micro_batches) % (devices * seg.group_rows) == 0


def _splits(segs: tuple[Segment, ...], devices: int) -> bool:
    """Every segment's rows split into its micro-batches, each a multiple of `devices` rows (batch devices)."""
    return all(s.rows % s.micro_batches == 0 and (s.rows // s.micro_batches) % devices == 0 for s in segs)


def shared_prompts(groups: int, g: int, replay_rows: int, num_micro_batches: int) -> int:
    """How many distinct prompts a micro-batch of the loss's rows can hold at most (0: no fewer than its rows,
    so sharing them saves nothing). The rows are `groups` groups of G on-policy rows, in group order, then R
    replay rows (any group's), split evenly into micro-batches: a micro-batch's on-policy rows span a run of
    groups, and each replay row may bring one more. Static, like the layout."""
    rows = groups * g + replay_rows
    n = rows // num_micro_batches
    most = 0
    for j in range(num_micro_batches):
        start, stop = j * n, (j + 1) * n
        on_policy = range(start, min(stop, groups * g))
        spanned = (on_policy[-1] // g - on_policy[0] // g + 1) if on_policy else 0
        most = max(most, spanned + (stop - max(start, groups * g) if stop > groups * g else 0))
    return most if most < n else 0


def full(cfg: RLConfig, batch) -> Layout:
    """The padded layout: all T columns, k replay rows per group (none without CCR)."""
    p, _, t = batch.tokens.shape
    return Layout(width=t, replay_rows=p * cfg.r3.replay_k if cfg.uses_replay else 0)


def width_bucket(longest: int, budget: int, minimum: int) -> int:
    """The smallest power of two >= max(longest, minimum), capped at the budget T (T itself when minimum is 0)."""
    if not minimum:
        return budget
    return min(budget, max(minimum, 1 << max(longest - 1, 0).bit_length()))


def replay_bucket(needed: int, on_policy_rows: int, most: int, multiple: int) -> int:
    """The replay rows for `needed` replayed responses: the first of 0, most/4, most/2 (rounded up, then up
    again until on_policy_rows + R is a multiple of `multiple`) that holds them, else `most` (P·k, which
    always splits): at most four programs per width, whatever the batch size."""
    if not 0 <= needed <= most:
        raise ValueError(f"{needed} replayed responses do not fit the {most} replay slots")
    for rows in (0, -(-most // 4), -(-most // 2)):
        rows += -(on_policy_rows + rows) % multiple
        if needed <= rows < most:
            return rows
    return most


@functools.partial(jax.jit, static_argnames=("k",))
def _needs(buffer, batch, *, k: int):
    """[7] int32: the longest on-policy response of a valid row (its last masked column), the responses CCR
    will append (k = 0: none), the longest stored response it may draw, the longest prompt of a valid group,
    the groups before the trailing run of empty reflection slots, the plain groups before the first reflection
    group, and their longest valid prompt."""
    valid = batch.group_valid[:, None] & (batch.lengths > 0)                     # as `train_step`
    columns = jnp.arange(1, batch.tokens.shape[2] + 1)
    longest = jnp.max(jnp.where(batch.mask & valid[..., None], columns, 0))
    count, replay_longest = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
    if k:
        count, replay_longest = replay.replay_needs(buffer, batch.qids, batch.correct, valid, batch.group_valid, k)
    prompt = jnp.max(jnp.where(batch.group_valid, jnp.asarray(batch.prompt_mask).sum(axis=1), 0))
    empty_slot = batch.is_reflection & ~batch.group_valid
    groups = jnp.max(jnp.where(empty_slot, 0, jnp.arange(1, empty_slot.shape[0] + 1)))
    plain = jnp.argmin(jnp.append(~batch.is_reflection, False))  # the leading plain groups
    leading = jnp.arange(batch.is_reflection.shape[0]) < plain
    plain_prompt = jnp.max(jnp.where(batch.group_valid & leading, jnp.asarray(batch.prompt_mask).sum(axis=1), 0))
    return jnp.stack([longest.astype(jnp.int32), count, replay_longest, prompt.astype(jnp.int32),
                      groups.astype(jnp.int32), plain.astype(jnp.int32), plain_prompt.astype(jnp.int32)])


def choose(cfg: RLConfig, buffer, batch, mesh=None) -> Layout:
    """The bucketed layout of the step that will train on `batch` with `buffer` (the state's, before the step)."""
    p, g, t = batch.tokens.shape
    padded = full(cfg, batch)
    k = cfg.r3.replay_k if cfg.uses_replay else 0
    needs = hosts.fetch(_needs(buffer if k else None, batch, k=k))
    longest, needed, replay_longest, prompt_longest, groups, plain, plain_longest = (int(x) for x in needs)
    width = width_bucket(max(longest, replay_longest), t, cfg.bucket_min_width)
    prompt_columns = batch.prompt_tokens.shape[1]
    prompt_width = width_bucket(prompt_longest, prompt_columns, cfg.bucket_min_width)
    prompt_width = None if prompt_width == prompt_columns else prompt_width
    if not cfg.bucket_replay:
        return Layout(width=width, replay_rows=padded.replay_rows, prompt_width=prompt_width)
    multiple = cfg.num_micro_batches * sharding.batch_devices(mesh)
    rows = replay_bucket(needed, groups * g, padded.replay_rows, multiple) if k else 0
    if (groups * g + rows) % multiple:  # the empty reflection slots stay: the rows would not split
        groups = p
        rows = replay_bucket(needed, p * g, padded.replay_rows, multiple) if k else 0
    chosen = Layout(width=width, replay_rows=rows, prompt_width=prompt_width, groups=None if groups == p else groups)
    devices = sharding.batch_devices(mesh)
    chosen = _narrowed(chosen, cfg, p, g, prompt_columns, plain, width_bucket(plain_longest, prompt_columns,
                                                                               cfg.bucket_min_width), devices)
    return _replay_apart(chosen, cfg, p, g, prompt_columns, devices)


def _narrowed(chosen: Layout, cfg: RLConfig, p: int, g: int, prompt_columns: int, plain: int, narrow_width: int,
              devices: int) -> Layout:
    """`chosen` with its first `plain` groups in a segment of their own at `narrow_width` prompt columns, when
    that is narrower than the rest's, the rest has rows, and both segments split over micro-batches and
    devices; else `chosen`."""
    groups = chosen.groups or p
    rows = groups * g + chosen.replay_rows
    if not 0 < plain <= groups or plain * g >= rows or narrow_width >= (chosen.prompt_width or prompt_columns):
        return chosen
    narrowed = dataclasses.replace(chosen, narrow_groups=plain, narrow_prompt_width=narrow_width)
    segs = segments(narrowed, cfg.num_micro_batches, p, g, prompt_columns)
    return narrowed if _splits(segs, devices) else chosen


def _replay_apart(chosen: Layout, cfg: RLConfig, p: int, g: int, prompt_columns: int, devices: int) -> Layout:
    """`chosen` with its replay rows in a segment of their own, when that lets more on-policy rows read their
    prompts group by group (`reads_by_group`: a micro-batch holding a replay row reads every prompt row by row,
    and on several batch devices not at all) and every segment still splits over its micro-batches and the
    devices; else `chosen`. Only with shared prompts: without them no row reads its prompt by group anyway."""
    if not (cfg.share_prompts and chosen.replay_rows):
        return chosen
    apart = dataclasses.replace(chosen, replay_apart=True)
    segs, before = (segments(x, cfg.num_micro_batches, p, g, prompt_columns) for x in (apart, chosen))
    grouped = lambda segs: sum(s.rows for s in segs if reads_by_group(s, devices))  # noqa: E731
    return apart if _splits(segs, devices) and grouped(segs) > grouped(before) else chosen
