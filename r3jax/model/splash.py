"""The TPU backend of causal self-attention: Pallas splash attention (`attention_plan`'s "splash").

Splash attention computes softmax attention block by block in VMEM: no [T, S] scores reach HBM, and blocks
above the diagonal, or between different segments, are skipped before they are loaded. Padding is a segment
of its own (segment id 0, the real tokens 1), so a real query sees exactly the real keys not after it, as
`attention.attend_causal` does; a padded query sees the padding before it (itself at least: finite). Grouped
KV heads are read in place (the kernel maps query head n to KV head n // (N / K)), never repeated. Rows that
continue a prompt held once per group (`attend_prefixed`) are the same kernel over keys [prompt | own], the
diagonal moved past the prompt; plain causal attention is that with an empty prompt.

With a mesh, the kernel runs per shard of the rows (`shard_map` over the mesh's batch axes; heads stay whole
within a shard), since a Pallas call is not partitioned by XLA itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jax.sharding import PartitionSpec as P

from r3jax.model import sharding
from r3jax.model.attention import OUTPUT_NAME, check_prefixed

# Queries and keys a kernel block holds (both). 512 is what MaxText's TPU configs use for long sequences; a
# sequence shorter than that runs in one block of its length rounded up to the TPU's 128 lanes.
BLOCK = 512
LANES = 128


def attend_causal(q_btnh, k_bksh, v_bksh, mask_bt, *, mesh=None, block: int = BLOCK,
                  interpret: bool = False) -> jax.Array:
    """Causal self-attention of [B, T, N, H] queries over [B, K, T, H] keys and values, real tokens marked by
    mask_bt [B, T]: `attention.attend_causal`'s values at real positions. T is padded up to a whole number of
    blocks (padding: segment 0). interpret: run the kernel in Pallas' interpreter (any platform; tests)."""
    none = lambda x: x[:, :, :0]  # noqa: E731  an empty prefix per row
    return attend_prefixed(q_btnh, none(k_bksh), none(v_bksh), k_bksh, v_bksh, mask_bt[:, :0], mask_bt, mesh=mesh,
                           block=block, interpret=interpret)


def attend_prefixed(q_btnh, prefix_k, prefix_v, k_bksh, v_bksh, prefix_mask, mask_bt, *, mesh=None,
                    block: int = BLOCK, interpret: bool = False) -> jax.Array:
    """Rows that continue a prefix held once per group: row b attends to the real slots of prefix b // G
    (prefix_k, prefix_v [Q, K, P, H], prefix_mask [Q, P]; G = B / Q), then causally to its own real tokens
    (mask_bt [B, T]): `attention.attend_shared_prefix`'s values at real positions.

    One kernel call over keys [prefix | own] per row, the causal diagonal moved P slots right: the prompt's
    forward still runs once per group (its keys and values are this call's inputs); only its [B, K, P, H] keys
    and values are repeated per row, their gradients summed back over the group by the repeat's transpose. P
    and T are each padded to whole blocks (padding: segment 0)."""
    check_prefixed(q_btnh, prefix_k, prefix_mask, mask_bt)
    b, t, n, h = q_btnh.shape
    q_count, p = prefix_mask.shape
    width = min(block, _round_up(t, LANES))
    t_pad, p_pad = _round_up(t, width), _round_up(p, width)
    per_row = lambda x: jnp.repeat(_pad(x, 2, p_pad), b // q_count, axis=0)  # noqa: E731  [Q, ., P] -> [B, ., P']
    k, v = (jnp.concatenate([per_row(x), _pad(y, 2, t_pad)], axis=2) for x, y in ((prefix_k, k_bksh),
                                                                                   (prefix_v, v_bksh)))
    own = _pad(jnp.asarray(mask_bt).astype(jnp.int32), 1, t_pad)
    segments = jnp.concatenate([per_row(jnp.asarray(prefix_mask).astype(jnp.int32)[:, None])[:, 0], own], axis=1)
    run = functools.partial(_attend, heads=n, length=t_pad, offset=p_pad, block=width, interpret=interpret)
    return _per_shard(run, b, mesh)(_pad(q_btnh, 1, t_pad), k, v, own, segments)[:, :t]


def _pad(x, axis: int, length: int):
    """x with zeros appended along `axis` up to `length`."""
    return jnp.pad(x, [(0, length - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])


def _per_shard(run, rows: int, mesh):
    """`run` per shard of the rows over the mesh's batch axes (every argument and the output row-major)."""
    if mesh is None:
        return run
    spec = P(sharding.fit_spec(P(sharding.BATCH), (rows,), mesh)[0])
    return jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)


def _attend(q_btnh, k_bksh, v_bksh, q_segments, kv_segments, *, heads: int, length: int, offset: int, block: int,
            interpret: bool):
    kernel = _kernel(heads, length, offset, block, interpret)
    q_bnth = (q_btnh * q_btnh.shape[-1] ** -0.5).astype(q_btnh.dtype).swapaxes(1, 2)  # the kernel does not scale
    out = jax.vmap(lambda q, k, v, sq, skv: kernel(q, k, v, segment_ids=kernel_lib.SegmentIds(q=sq, kv=skv)))(
        q_bnth, k_bksh, v_bksh, q_segments, kv_segments)
    return out.swapaxes(1, 2)


@functools.lru_cache(maxsize=32)
def _kernel(heads: int, length: int, offset: int, block: int, interpret: bool):
    """One kernel (and its block-sparsity tables, built on the host) per shape: `length` queries over
    `offset` + `length` keys, query t seeing keys up to offset + t."""
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, offset + length), offset=offset)
                                   for _ in range(heads)])
    sizes = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                  block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # the residuals the backward reads (output, log-sum-exp) carry the name remat policies keep
    # (`qwen2.REMAT_POLICIES`); the tables are made concrete even when the first call is traced, so that a later
    # trace can reuse them
    with jax.ensure_compile_time_eval():
        return kernel_lib.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret,
                                                        residual_checkpoint_name=OUTPUT_NAME)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
