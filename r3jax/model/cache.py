"""The KV cache: an explicit value that the model takes and returns, never hidden module state."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from r3jax.model import sharding
from r3jax.model.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """Keys and values that every row of a group attends to first, held once per group: the G samples of one
    prompt share their prompt's. Rows are group-major (rows [g·G, (g + 1)·G) continue prefix g).

    k, v:   [L, Q, K, P, H] (stacked, as a stacked `Cache`), or per layer (as a per-layer `Cache`) tuples over
            the L layers: keys [Q, K, H, P] (slots last), values [Q, K, P, H]
    mask:   [Q, P] bool, True where a slot holds a real token
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array

    def layer(self, layer) -> tuple[jax.Array, jax.Array]:
        """Layer `layer`'s (keys, values), in the layout of the cache they go with."""
        return self.k[layer], self.v[layer]

    def real_tokens(self, rows: int) -> jax.Array:
        """[rows] int32: the real tokens of each row's prefix (rows group-major)."""
        return jnp.repeat(self.mask.sum(-1, dtype=jnp.int32), rows // self.mask.shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Cache:
    """Keys and values of every layer, plus which slots hold real tokens.

    k, v:   [L, B, K, S, H] (heads before slots: a step's attention reads each head's keys and values as one
            contiguous [S, H] block, with no transpose of the cache)
            Or, per layer (`init_cache(per_layer=...)`, for decode loops on a CPU that run the layers
            unrolled): k and v are tuples over the L layers of their parts, each its own buffer: (head,) or
            (head, tail), the head the first `per_layer` slots, the tail the rest; keys [B, K, H, S'] (slots
            last: the scores are then a [R, H] x [H, S'] product per row and head, which XLA:CPU ran at 0.15
            ms a layer against 0.38 for [R, H] x [S', H]^T at 64 rows, 192 slots), values [B, K, S', H].
            Every step reads the head where it is (out of a stacked cache, or a slice of a longer one,
            XLA:CPU copies it out first, at every step: ~0.3 ms a layer there) and only the filled blocks of
            the tail.
    mask:   [B, S] bool, True where a slot holds a real (non-padding) token
    index:  [] int32, the next slot to write; every row writes at the same slot, so a left-padded
            prompt batch stays aligned and decoding writes one column per step. Or [B] int32: each row
            writes at its own slot (a sampler that refills finished rows mixes rows of different ages);
            a row whose index is past the end writes nothing.
    prefix: None, or a `Prefix` that each group of rows attends to before its own slots (its keys and values
            held once, not copied into every row: the sampler's G samples of a prompt). The slots above then
            hold only what follows it, and positions continue from the prefix's real tokens.
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    index: jax.Array
    prefix: Prefix | None = None

    @property
    def max_length(self) -> int:
        if self.per_layer:
            return sum(part.shape[2] for part in self.v[0])
        return self.v.shape[3]

    @property
    def per_layer(self) -> bool:
        return isinstance(self.v, tuple)


def init_cache(config: ModelConfig, batch: int, max_length: int, dtype=jnp.float32, mesh=None, *,
               per_layer: int = 0) -> Cache:
    """An empty cache of `max_length` slots (prompt plus new tokens), sharded like the activations; per_layer
    > 0: k and v per layer, the first `per_layer` slots a head of their own (`Cache`)."""
    n, kh, h = config.num_hidden_layers, config.num_key_value_heads, config.head_dim

    def zeros(name, shape):  # every array its own buffer: a cache is donated, and no buffer twice
        x = jnp.zeros(shape, dtype)
        return x if mesh is None else jax.device_put(x, sharding.named(mesh, name, shape))

    if per_layer:
        lengths = (max_length,) if max_length <= per_layer else (per_layer, max_length - per_layer)
        kv = [tuple(tuple(zeros("cache_bkhs", (batch, kh, h, s)) for s in lengths) for _ in range(n)),
              tuple(tuple(zeros("cache_bksh", (batch, kh, s, h)) for s in lengths) for _ in range(n))]
    else:
        kv = [zeros("cache_lbksh", (n, batch, kh, max_length, h)) for _ in range(2)]
    mask_sharding = None if mesh is None else sharding.named(mesh, "cache_bs", (batch, max_length))
    mask = jnp.zeros((batch, max_length), bool)
    return Cache(
        k=kv[0],
        v=kv[1],
        mask=mask if mask_sharding is None else jax.device_put(mask, mask_sharding),
        index=jnp.zeros((), jnp.int32),
    )


def as_prefix(k, v, mask, like: Cache, mesh=None) -> Prefix:
    """Stacked keys and values [L, Q, K, P, H] and mask [Q, P] (a prompt batch's own cache) as a `Prefix` in
    the layout of the cache `like` (per layer: tuples, keys slots last), in its dtype and sharding."""
    def put(x, like_x, name):
        x = x.astype(like_x.dtype)
        return x if mesh is None else sharding.constrain(x, name, mesh)

    if like.per_layer:
        layers = range(len(like.k))
        return Prefix(k=tuple(put(k[i].swapaxes(-1, -2), like.k[i][0], "cache_bkhs") for i in layers),
                      v=tuple(put(v[i], like.v[i][0], "cache_bksh") for i in layers), mask=mask)
    return Prefix(k=put(k, like.k, "cache_lbksh"), v=put(v, like.v, "cache_lbksh"), mask=mask)


def positions_from_mask(mask_bt: jax.Array, offset_b: jax.Array | int = 0) -> jax.Array:
    """RoPE positions: each real token's index among the real tokens of its row (+ offset).

    Padding gets the position of the real token before it (0 at the left edge); its value never
    reaches a real token, because padding is masked out of every attention.
    """
    pos = jnp.cumsum(mask_bt.astype(jnp.int32), axis=-1) - 1
    return jnp.maximum(pos, 0) + jnp.asarray(offset_b, jnp.int32).reshape(-1, 1)


def causal_mask(mask_bt: jax.Array) -> jax.Array:
    """[B, T, T] attention mask of a full forward: key is real and not after the query."""
    t = mask_bt.shape[1]
    return jnp.tril(jnp.ones((t, t), bool))[None] & mask_bt[:, None, :]


def _query_slots(index: jax.Array, t: int) -> jax.Array:
    """[B or 1, T] the slots that T new tokens are written to."""
    return jnp.reshape(index, (-1, 1)) + jnp.arange(t)


def filled(cache: Cache, t: int) -> jax.Array:
    """[] int32: how many leading slots T new tokens (written at `cache.index`) can see at most; attention
    reads no further, so its cost follows what is filled rather than what is allocated."""
    index = jnp.where(cache.index < cache.max_length, cache.index, 0)  # rows past the end write nothing
    return jnp.minimum(jnp.max(index) + t, cache.max_length)


def write(cache: Cache, mask_bt: jax.Array) -> tuple[Cache, jax.Array, jax.Array]:
    """Reserves slots [index, index + T) for T new tokens.

    Returns the cache with its mask and index advanced (k and v are written layer by layer later),
    the new tokens' positions [B, T], and their attention mask over the cache [B, T, S] (with a prefix,
    [B, T, P + S]: its P slots first, every one of a row's real prefix tokens visible to all T).
    """
    b, t = mask_bt.shape
    before = cache.mask.sum(-1) if cache.prefix is None else cache.mask.sum(-1) + cache.prefix.real_tokens(b)
    positions = positions_from_mask(mask_bt, before)
    query_slot = _query_slots(cache.index, t)
    if cache.index.ndim == 0:
        new_mask = jax.lax.dynamic_update_slice(cache.mask, mask_bt.astype(bool), (0, cache.index))
    else:
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        new_mask = cache.mask.at[rows, query_slot].set(mask_bt.astype(bool), mode="drop")
    slot = jnp.arange(cache.max_length)
    attn = new_mask[:, None, :] & (slot[None, None, :] <= query_slot[:, :, None])
    if cache.prefix is not None:
        seen = jnp.repeat(cache.prefix.mask, b // cache.prefix.mask.shape[0], axis=0)  # [B, P]
        attn = jnp.concatenate([jnp.broadcast_to(seen[:, None], (b, t, seen.shape[1])), attn], axis=-1)
    return dataclasses.replace(cache, mask=new_mask, index=cache.index + t), positions, attn


def write_layer(kv: tuple, layer, k_btkh: jax.Array, v_btkh: jax.Array, index: jax.Array) -> tuple:
    """Writes one layer's new keys and values [B, T, K, H] at (layer, slot `index`) of the full cache
    (k, v [L, B, K, S, H], or per-layer parts with `layer` a Python int: `Cache`), in place, and returns
    the full cache.

    Updating the whole stacked cache (rather than scanning over per-layer slices and restacking)
    lets XLA write in place: decoding never copies the cache. A per-row index [B] is a scatter of B
    rows (out-of-range slots dropped), also in place.
    """
    if isinstance(kv[0], tuple):
        k_parts, v_parts, offset = [], [], 0
        rows_index = jnp.broadcast_to(jnp.asarray(index), k_btkh.shape[:1])
        for k, v in zip(kv[0][layer], kv[1][layer], strict=True):  # each part takes the slots it holds
            k, v = _write((k, v), (), k_btkh, v_btkh, rows_index, offset, keys_last=True)
            k_parts.append(k)
            v_parts.append(v)
            offset += v.shape[2]
        put = lambda full, new: (*full[:layer], tuple(new), *full[layer + 1:])  # noqa: E731
        return put(kv[0], k_parts), put(kv[1], v_parts)
    return _write(kv, (layer,), k_btkh, v_btkh, index)


def _write(kv, lead: tuple, k_btkh, v_btkh, index, offset: int = 0, keys_last: bool = False):
    """`write_layer` into k and v [*lead, B, K, S, H] (keys_last: k [*lead, B, K, H, S]) at the leading indices
    `lead`; with a per-row index, into the part of a cache that holds slots [offset, offset + S) (other slots
    are dropped)."""
    k_order = (0, 2, 3, 1) if keys_last else (0, 2, 1, 3)  # [B, T, K, H] -> [B, K, H, T] or [B, K, T, H]
    if index.ndim == 0:
        k_new = k_btkh.transpose(k_order)[(None,) * len(lead)].astype(kv[0].dtype)
        v_new = v_btkh.swapaxes(1, 2)[(None,) * len(lead)].astype(kv[1].dtype)  # [*, B, K, T, H]
        k_at = (*lead, 0, 0, 0, index) if keys_last else (*lead, 0, 0, index, 0)
        return (jax.lax.dynamic_update_slice(kv[0], k_new, k_at),
                jax.lax.dynamic_update_slice(kv[1], v_new, (*lead, 0, 0, index, 0)))
    b, t = k_btkh.shape[:2]
    n = kv[1].shape[-2]
    slots = _query_slots(index, t) - offset
    rows, slots = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t)), jnp.where((slots >= 0) & (slots < n), slots, n)
    every = slice(None)
    k_at = (*lead, rows, every, every, slots) if keys_last else (*lead, rows, every, slots, every)
    # Advanced indices split by slices: the update is laid out [B, T, K, H], as the new keys are.
    return (kv[0].at[k_at].set(k_btkh.astype(kv[0].dtype), mode="drop"),
            kv[1].at[(*lead, rows, every, slots, every)].set(v_btkh.astype(kv[1].dtype), mode="drop"))
