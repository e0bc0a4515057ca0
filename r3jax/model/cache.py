"""The KV cache: an explicit value that the model takes and returns, never hidden module state."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from r3jax.model import sharding
from r3jax.model.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Cache:
    """Keys and values of every layer, plus which slots hold real tokens.

    k, v:   [L, B, K, S, H] (heads before slots: a decode step's attention then reads each head's
            keys as one contiguous [S, H] block, with no transpose of the cache)
    mask:   [B, S] bool, True where a slot holds a real (non-padding) token
    index:  [] int32, the next slot to write; every row writes at the same slot, so a left-padded
            prompt batch stays aligned and decoding writes one column per step. Or [B] int32: each row
            writes at its own slot (a sampler that refills finished rows mixes rows of different ages);
            a row whose index is past the end writes nothing.
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    index: jax.Array

    @property
    def max_length(self) -> int:
        return self.k.shape[3]


def init_cache(config: ModelConfig, batch: int, max_length: int, dtype=jnp.float32, mesh=None) -> Cache:
    """An empty cache of `max_length` slots (prompt plus new tokens), sharded like the activations."""
    shape = (config.num_hidden_layers, batch, config.num_key_value_heads, max_length, config.head_dim)
    kv_sharding = None if mesh is None else sharding.named(mesh, "cache_lbksh", shape)
    mask_sharding = None if mesh is None else sharding.named(mesh, "cache_bs", (batch, max_length))
    # k and v get buffers of their own: the cache is donated into jitted steps, and one buffer
    # cannot be donated twice.
    kv = [jnp.zeros(shape, dtype) for _ in range(2)]
    if kv_sharding is not None:
        kv = [jax.device_put(x, kv_sharding) for x in kv]
    mask = jnp.zeros((batch, max_length), bool)
    return Cache(
        k=kv[0],
        v=kv[1],
        mask=mask if mask_sharding is None else jax.device_put(mask, mask_sharding),
        index=jnp.zeros((), jnp.int32),
    )


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
    the new tokens' positions [B, T], and their attention mask over the cache [B, T, S].
    """
    b, t = mask_bt.shape
    positions = positions_from_mask(mask_bt, cache.mask.sum(-1))
    query_slot = _query_slots(cache.index, t)
    if cache.index.ndim == 0:
        new_mask = jax.lax.dynamic_update_slice(cache.mask, mask_bt.astype(bool), (0, cache.index))
    else:
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        new_mask = cache.mask.at[rows, query_slot].set(mask_bt.astype(bool), mode="drop")
    slot = jnp.arange(cache.max_length)
    attn = new_mask[:, None, :] & (slot[None, None, :] <= query_slot[:, :, None])
    return dataclasses.replace(cache, mask=new_mask, index=cache.index + t), positions, attn


def write_layer(kv: tuple[jax.Array, jax.Array], layer, k_btkh: jax.Array, v_btkh: jax.Array,
                index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Writes one layer's new keys and values [B, T, K, H] at (layer, slot `index`) of the full
    [L, B, K, S, H] cache, in place, and returns the full cache.

    Updating the whole stacked cache (rather than scanning over per-layer slices and restacking)
    lets XLA write in place: decoding never copies the cache. A per-row index [B] is a scatter of B
    rows (out-of-range slots dropped), also in place.
    """
    if index.ndim == 0:
        at = (layer, 0, 0, index, 0)
        new = lambda x, full: x.swapaxes(1, 2)[None].astype(full.dtype)  # noqa: E731  [1, B, K, T, H]
        k_full = jax.lax.dynamic_update_slice(kv[0], new(k_btkh, kv[0]), at)
        v_full = jax.lax.dynamic_update_slice(kv[1], new(v_btkh, kv[1]), at)
    else:
        b, t = k_btkh.shape[:2]
        rows, slots = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t)), _query_slots(index, t)
        # Advanced indices split by a slice: the update is laid out [B, T, K, H], as the new keys are.
        k_full = kv[0].at[layer, rows, :, slots, :].set(k_btkh.astype(kv[0].dtype), mode="drop")
        v_full = kv[1].at[layer, rows, :, slots, :].set(v_btkh.astype(kv[1].dtype), mode="drop")
    return k_full, v_full
