"""Which row decodes in which slot: the decode loop's carry, and how rows take, keep and leave slots.

`sampler.generate` decodes N = P·G rows in B slots. `schedule` says the slot counts the loop runs at and the row
groups (one per device the rows are split over); `seat_all` seats a static batch before the loop; `refill` gives
free slots the next waiting rows; `narrow` keeps the busy slots once few are left; `keep_width` is the loop's
condition at each width. Everything here is per row group, so on a mesh a row's cache never leaves its device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from r3jax.model import cache as kv_cache
from r3jax.model import sharding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptCache:
    """Every prompt run once: its keys and values, which of its slots are real, its next-token logits."""

    k: jax.Array       # [L, P, K, Tp, H]
    v: jax.Array       # [L, P, K, Tp, H]
    mask: jax.Array    # [P, Tp]
    logits: jax.Array  # [P, V]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingState:
    """The decode loop's carry: B slots decoding, N = P * G rollout rows to fill.

    A slot holds one row at a time: its cache is the row's prompt (slots [0, Tp)) then its response (slot
    Tp + t holds response token t); or, when the rows share their prompts (`shares_prompts`), the response
    alone (slot t), the prompts held once in the cache's `Prefix`. A slot whose row has ended takes the next
    row that has not started. Outputs are kept per row, so the result does not depend on which slot decoded
    which row. With D row groups, the slots and rows are D equal blocks, and block d's slots decode only block
    d's rows.
    """

    step: jax.Array       # [] int32 decode steps run
    slot_steps: jax.Array  # [] int32 slots x steps: what the decoding paid for
    next_row: jax.Array   # [D] int32 per row group (`schedule`), the first of its rows no slot has taken yet
    row: jax.Array        # [B] int32 the row each slot decodes
    length: jax.Array     # [B] int32 tokens that row has so far
    free: jax.Array       # [B] the slot's row has ended (or it never had one)
    logits: jax.Array     # [B, V] the prediction each slot draws its next token from
    cache: kv_cache.Cache  # [L, B, K, Tp + T, H], one write index per slot
    tokens: jax.Array     # [N, T]
    logprobs: jax.Array   # [N, T]
    entropies: jax.Array  # [N, T]
    lengths: jax.Array    # [N] tokens generated, end token included
    ended: jax.Array      # [N] an end token has been generated
    uniforms: jax.Array   # [N, T] the number each row's draw of token t inverts the CDF at


def schedule(prompts: int, samples: int, slots: int | None, mesh=None) -> tuple[tuple[int, ...], int]:
    """(widths, groups): the slot counts the loop decodes at (`loop_widths`), and the row groups it seats rows
    in. On a mesh that splits the rows over D devices (D dividing the P·G rows), the rows are D groups, one
    device's block each, and each device's slots take only its own group's rows: seating a row and narrowing
    the slots then move caches within a device, never across. A group takes its prompts' caches from its own
    block of prompts when D divides P too, else from all of them (prompts that D does not divide are whole on
    every device: `sharding.fit_spec`). Else one group. What `memory_plan` compiles must be this very program."""
    shards = row_shards(mesh)
    groups = shards if (prompts * samples) % shards == 0 else 1
    return loop_widths(prompts * samples, slots, mesh), groups


def loop_widths(rows: int, slots: int | None, mesh=None) -> tuple[int, ...]:
    """The slot counts `generate`'s loop decodes at: all `rows` at once (slots None: no refill, no narrowing),
    or `slots` (rounded up to a multiple of the devices the mesh splits the rows over) narrowing by quarters
    (`slot_widths`)."""
    if slots is None:
        return (rows,)
    multiple = row_shards(mesh)
    return slot_widths(min(-(-int(slots) // multiple) * multiple, rows), multiple)


def slot_widths(slots: int, multiple: int = 1) -> tuple[int, ...]:
    """The slot counts the loop narrows through once no row is waiting: each a quarter of the one before,
    rounded up to `multiple` (the devices the rows are split over). Once the last rows are all that is
    left, a quarter of the slots (or fewer) are busy; a narrower batch then does the same work in cheaper
    steps instead of stepping idle slots until the longest row ends."""
    widths = [slots]
    while True:
        narrower = max(multiple, -(-(widths[-1] // 4) // multiple) * multiple)
        if narrower >= widths[-1]:
            return tuple(widths)
        widths.append(narrower)


def row_shards(mesh) -> int:
    """The devices a batch's rows are split over (`act_bt`'s first axis); 1 without a mesh."""
    if mesh is None:
        return 1
    spec = sharding.ACTIVATION_SPECS["act_bt"][0]
    axes = spec if isinstance(spec, tuple) else (spec,)
    return int(np.prod([mesh.shape[a] for a in axes if a is not None]))


def _by_group(fn, groups: int, axes: tuple[int | None, ...], *arrays) -> jax.Array:
    """`fn` on each row group's block of every array (array i's axis axes[i], slots or rows or prompts, split
    into [groups, n / groups]; None: the whole array, to every group), the results joined back at axes[0]. A
    device's block in, its block out: XLA partitions the per-group gathers and scatters this makes along the
    groups, with no collective."""
    split = [x if a is None else x.reshape(x.shape[:a] + (groups, x.shape[a] // groups) + x.shape[a + 1:])
             for x, a in zip(arrays, axes, strict=True)]
    out = jax.vmap(fn, in_axes=axes, out_axes=axes[0])(*split)
    return out.reshape(out.shape[:axes[0]] + (-1,) + out.shape[axes[0] + 2:])


def keep_width(narrower: int, state: SamplingState) -> jax.Array:
    """The loop's condition at the current width; `narrower` is the next width (0: none), each group's share
    of it the most busy slots a group may have for the loop to narrow."""
    groups = state.next_row.shape[0]
    busy = jnp.sum(~state.free.reshape(groups, -1), axis=1)
    waiting = jnp.any(state.next_row < state.tokens.shape[0] // groups)
    return ((jnp.any(busy > 0)                               # a slot is still decoding
             | waiting)                                      # or a row has not started yet
            & (waiting | jnp.any(busy > narrower // groups)))  # and the rows left need this many slots


def refill(samples: int, prompts: PromptCache, state: SamplingState) -> SamplingState:
    """Free slots take the next waiting rows of their group, in slot order: each gets its prompt's cache and
    logits, from its group's block of prompts."""
    groups = state.next_row.shape[0]
    b, rows, tp = state.row.shape[0] // groups, state.tokens.shape[0] // groups, prompts.mask.shape[1]
    free = state.free.reshape(groups, b)
    local = state.next_row[:, None] + jnp.cumsum(free, axis=1) - 1   # [D, B/D] row within the group's block
    take = free & (local < rows)
    new_row = (jnp.arange(groups)[:, None] * rows + local).reshape(-1)
    dest = jnp.where(take, jnp.arange(b), b).reshape(-1)  # slots that take nothing write out of range: dropped
    # the prompt within the group's block of prompts, or among all of them when the groups do not split them
    blocks = prompts.mask.shape[0] % groups == 0
    prompt = jnp.where(take.reshape(-1), (local if blocks else new_row.reshape(groups, b)).reshape(-1), 0)
    prompt = prompt // samples
    p_axis = 0 if blocks else None
    take = take.reshape(-1)
    cache = state.cache
    if cache.per_layer:  # the prompt lies in each layer's head (`_init_state`), keys slots last
        k = tuple((_by_group(lambda s, p, d, i: s.at[d, :, :, :tp].set(p[i].swapaxes(-1, -2), mode="drop"),
                             groups, (0, p_axis, 0, 0), head, prompts.k[n], dest, prompt), *tail)
                  for n, (head, *tail) in enumerate(cache.k))
        v = tuple((_by_group(lambda s, p, d, i: s.at[d, :, :tp].set(p[i], mode="drop"),
                             groups, (0, p_axis, 0, 0), head, prompts.v[n], dest, prompt), *tail)
                  for n, (head, *tail) in enumerate(cache.v))
    else:
        k, v = (_by_group(lambda s, p, d, i: s.at[:, d, :, :tp].set(p[:, i], mode="drop"),
                          groups, (1, None if p_axis is None else 1, 0, 0), kv, new, dest, prompt)
                for kv, new in ((cache.k, prompts.k), (cache.v, prompts.v)))
    pad = ((0, 0), (0, cache.max_length - tp))
    mask = _by_group(lambda s, p, d, i: s.at[d].set(jnp.pad(p[i], pad), mode="drop"),
                     groups, (0, p_axis, 0, 0), cache.mask, prompts.mask, dest, prompt)
    logits = _by_group(lambda s, p, d, i: s.at[d].set(p[i], mode="drop"),
                       groups, (0, p_axis, 0, 0), state.logits, prompts.logits, dest, prompt)
    return dataclasses.replace(
        state, next_row=state.next_row + jnp.sum(take.reshape(groups, b), axis=1),
        row=jnp.where(take, new_row, state.row), length=jnp.where(take, 0, state.length), free=state.free & ~take,
        cache=dataclasses.replace(cache, k=k, v=v, mask=mask), logits=logits)


def shares_prompts(prompts: int, samples: int, widths: tuple[int, ...], mesh) -> bool:
    """Whether a call's rows read their prompts from one shared copy (`cache.Prefix`, `seat_all`): a static
    batch (every row seated once, row r in slot r, so each prompt's G samples are neighbours) of G > 1
    samples, whose prompts split over the devices as its rows do (D dividing P: a device's rows then
    continue its own prompts)."""
    return samples > 1 and widths == (prompts * samples,) and prompts % row_shards(mesh) == 0


def seat_all(samples: int, prompts: PromptCache, state: SamplingState, mesh, *, shared: bool = False
             ) -> SamplingState:
    """`refill` of an all-free cache with every row (row r in slot r), its cache built from the prompts' in one
    piece rather than written into zeros (the 1.5B sampler's TPU program, v5e:4x8: 6.0 -> 4.6 GiB a chip; with
    the refill `cond` in every step, as for slots, 7.0). A per-layer cache's heads are built so; its tails
    stay empty. shared (`shares_prompts`): the prompts' caches become the cache's `Prefix`, held once for
    their G rows, whose own slots (the cache's, all of them) are left for the responses."""
    g, tp = samples, prompts.mask.shape[1]
    cache = state.cache
    if shared:
        cache = dataclasses.replace(cache, prefix=kv_cache.as_prefix(prompts.k, prompts.v, prompts.mask, cache,
                                                                        mesh))
        return _seated(state, cache, jnp.repeat(prompts.logits, g, axis=0))

    def seated(x, like, name, keys_last=False):  # [(L,) P, K, Tp, H] -> [(L,) P·G, K, S', H] as `like` (S' slots)
        slots = like.shape[-1] if keys_last else like.shape[-2]
        x = jnp.pad(jnp.repeat(x, g, axis=-4), [(0, 0)] * (x.ndim - 2) + [(0, slots - tp), (0, 0)])
        x = (x.swapaxes(-1, -2) if keys_last else x).astype(like.dtype)
        return x if mesh is None else sharding.constrain(x, name, mesh)

    if cache.per_layer:  # keys slots last (`cache.Cache`)
        k = tuple((seated(prompts.k[n], head, "cache_bkhs", keys_last=True), *tail)
                  for n, (head, *tail) in enumerate(cache.k))
        v = tuple((seated(prompts.v[n], head, "cache_bksh"), *tail) for n, (head, *tail) in enumerate(cache.v))
    else:
        k, v = seated(prompts.k, cache.k, "cache_lbksh"), seated(prompts.v, cache.v, "cache_lbksh")
    mask = jnp.pad(jnp.repeat(prompts.mask, g, axis=0), ((0, 0), (0, cache.max_length - tp)))
    return _seated(state, dataclasses.replace(cache, k=k, v=v, mask=mask), jnp.repeat(prompts.logits, g, axis=0))


def _seated(state: SamplingState, cache: kv_cache.Cache, logits) -> SamplingState:
    """Every row in its slot (row r in slot r), none waiting."""
    rows, groups = state.row.shape[0], state.next_row.shape[0]
    return dataclasses.replace(state, next_row=jnp.full((groups,), rows // groups, jnp.int32),
                               row=jnp.arange(rows, dtype=jnp.int32), length=jnp.zeros_like(state.length),
                               free=jnp.zeros_like(state.free), cache=cache, logits=logits)


def narrow(state: SamplingState, width: int) -> SamplingState:
    """Keeps `width` slots, width / D of each group's, its busy ones first (all of them: the loop narrows only
    when no group has more left)."""
    groups = state.next_row.shape[0]
    keep = jnp.argsort(state.free.reshape(groups, -1), axis=1, stable=True)[:, :width // groups].reshape(-1)

    def kept(x, axis=0):  # each group's kept slots, from its own block
        return _by_group(lambda x, i: jnp.take(x, i, axis=axis), groups, (axis, 0), x, keep)

    cache = state.cache
    rows = ((lambda x: tuple(tuple(kept(part) for part in layer) for layer in x)) if cache.per_layer  # noqa: E731
            else (lambda x: kept(x, 1)))
    cache = dataclasses.replace(cache, k=rows(cache.k), v=rows(cache.v), mask=kept(cache.mask),
                                index=kept(cache.index))
    return dataclasses.replace(state, row=kept(state.row), length=kept(state.length), free=kept(state.free),
                               logits=kept(state.logits), cache=cache)
