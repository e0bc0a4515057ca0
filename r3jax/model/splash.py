"""The TPU backend of causal self-attention: Pallas splash attention (`attention_plan`'s "splash").

Splash attention computes softmax attention block by block in VMEM: no [T, S] scores reach HBM, and blocks
above the diagonal, or between different segments, are skipped before they are loaded. Padding is a segment
of its own (segment id 0, the real tokens 1), so a real query sees exactly the real keys not after it, as
`attention.attend_causal` does; a padded query sees the padding before it (itself at least: finite). Grouped
KV heads are read in place (the kernel maps query head n to KV head n // (N / K)), never repeated.

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
from r3jax.model.attention import OUTPUT_NAME

# Queries and keys a kernel block holds (both). 512 is what MaxText's TPU configs use for long sequences; a
# sequence shorter than that runs in one block of its length rounded up to the TPU's 128 lanes.
BLOCK = 512
LANES = 128


def attend_causal(q_btnh, k_bksh, v_bksh, mask_bt, *, mesh=None, block: int = BLOCK,
                  interpret: bool = False) -> jax.Array:
    """Causal self-attention of [B, T, N, H] queries over [B, K, T, H] keys and values, real tokens marked by
    mask_bt [B, T]: `attention.attend_causal`'s values at real positions. T is padded up to a whole number of
    blocks (padding: segment 0). interpret: run the kernel in Pallas' interpreter (any platform; tests)."""
    b, t, n, h = q_btnh.shape
    width = min(block, _round_up(t, LANES))
    padded = _round_up(t, width)
    run = functools.partial(_attend, heads=n, length=padded, block=width, interpret=interpret)
    pad = lambda x, axis: jnp.pad(x, [(0, padded - t) if a == axis else (0, 0) for a in range(x.ndim)])  # noqa: E731
    args = (pad(q_btnh, 1), pad(k_bksh, 2), pad(v_bksh, 2), pad(jnp.asarray(mask_bt).astype(jnp.int32), 1))
    if mesh is not None:
        rows = sharding.fit_spec(P(sharding.BATCH), (b,), mesh)[0]
        run = jax.shard_map(run, mesh=mesh, in_specs=(P(rows), P(rows), P(rows), P(rows)), out_specs=P(rows),
                            check_vma=False)
    return run(*args)[:, :t]


def _attend(q_btnh, k_bksh, v_bksh, segments_bt, *, heads: int, length: int, block: int, interpret: bool):
    kernel = _kernel(heads, length, block, interpret)
    q_bnth = (q_btnh * q_btnh.shape[-1] ** -0.5).astype(q_btnh.dtype).swapaxes(1, 2)  # the kernel does not scale
    out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=kernel_lib.SegmentIds(q=s, kv=s)))(
        q_bnth, k_bksh, v_bksh, segments_bt)
    return out.swapaxes(1, 2)


@functools.lru_cache(maxsize=32)
def _kernel(heads: int, length: int, block: int, interpret: bool):
    """One kernel (and its block-sparsity tables, built on the host) per shape."""
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length)) for _ in range(heads)])
    sizes = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                  block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # the residuals the backward reads (output, log-sum-exp) carry the name remat policies keep (`qwen2.REMAT_POLICIES`)
    return kernel_lib.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret,
                                                    residual_checkpoint_name=OUTPUT_NAME)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
