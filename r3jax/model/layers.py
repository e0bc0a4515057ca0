"""Qwen2 building blocks in Flax NNX: RMSNorm, rotary embedding, grouped-query attention, SwiGLU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from r3jax.model import cache as kv_cache
from r3jax.model import sharding
from r3jax.model.config import ModelConfig

# A large finite negative instead of -inf: a query row with no visible key (left padding) then gets
# a uniform softmax instead of NaN, and NaN never leaks into gradients.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
# Cache slots a cached attention reads per block (`attend_cached`): decoding pays for ceil(filled / 256)
# blocks. Small enough that a short response reads little of a long budget, large enough that the loop over
# blocks costs little per step.
CACHE_BLOCK = 256
# Queries a training attention (`attend`) takes at a time: its [T, S] scores, probabilities and their
# gradients exist for one block of queries at once. At the 1.5B model's 9,216 positions a whole [T, S] fp32
# block is 1.9 GiB a chip (v5e:4x8); shorter sequences run in one block, with no loop.
QUERY_BLOCK = 1024


def _init(rngs: nnx.Rngs, shape, dtype, std: float = 0.02):
    return std * jax.random.normal(rngs.params(), shape, dtype)


class RMSNorm(nnx.Module):
    """y = scale * x / sqrt(mean(x^2) + eps), statistics in fp32 (as Hugging Face's Qwen2RMSNorm)."""

    def __init__(self, dim: int, eps: float, *, param_dtype, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * x32.astype(self.dtype)


def rope_tables(positions_bt: jax.Array, head_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, T, 1, H] of the rotary angles, computed once per forward and shared by all layers."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def rope(x_btnh: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotary embedding in the rotate-half convention: the first and second half of H form pairs."""
    cos, sin = tables
    x1, x2 = jnp.split(x_btnh, 2, axis=-1)
    return x_btnh * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def attend(q_btnh, k_bksh, v_bksh, mask_bts, query_block: int | None = None) -> jax.Array:
    """Softmax attention with K KV heads shared by groups of R = N / K query heads (fp32 scores).

    Its gradient is written out (`_softmax_attention`): the same values as differentiating the formula, in
    fewer passes over the [T, S] scores. Queries are taken `query_block` at a time (default `QUERY_BLOCK`),
    so no [T, S] temporary is ever larger than [query_block, S], forward or backward."""
    b, t, n, h = q_btnh.shape
    k = k_bksh.shape[1]
    q_bkrth = q_btnh.reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
    out = _softmax_attention(q_bkrth, k_bksh, v_bksh, mask_bts, query_block or QUERY_BLOCK)  # [B, K, R, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _scores(q_bkrth, k_bksh, mask_bts):
    """Scaled fp32 scores [B, K, R, T, S], masked keys at _MASKED."""
    scores = jnp.einsum("bkrth,bksh->bkrts", q_bkrth, k_bksh, preferred_element_type=jnp.float32)
    return jnp.where(mask_bts[:, None, None], scores * q_bkrth.shape[-1] ** -0.5, _MASKED)


def _query_blocks(x, axis: int, block: int):
    """x with its query axis cut into [n, block] (zero-padded at the end), the n blocks leading."""
    t = x.shape[axis]
    n = -(-t // block)
    x = jnp.pad(x, [(0, n * block - t) if a == axis else (0, 0) for a in range(x.ndim)])
    return jnp.moveaxis(x.reshape(*x.shape[:axis], n, block, *x.shape[axis + 1:]), axis, 0)


def _join_blocks(x, axis: int, t: int):
    """Inverse of `_query_blocks`: the blocks back on `axis`, the first t queries."""
    x = jnp.moveaxis(x, 0, axis)
    return jax.lax.slice_in_dim(x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:]), 0, t, axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _softmax_attention(q_bkrth, k_bksh, v_bksh, mask_bts, block: int):
    """softmax(scores) @ v, normalised after the product: out = (exp(scores - m) @ v) / l with the row max m
    and sum l. A query with no visible key gets the uniform softmax (every score is _MASKED)."""
    return _softmax_attention_fwd(q_bkrth, k_bksh, v_bksh, mask_bts, block)[0]


def _forward_block(q_bkrth, k_bksh, v_bksh, mask_bts):
    scores = _scores(q_bkrth, k_bksh, mask_bts)
    m = scores.max(-1, keepdims=True)
    e = jnp.exp(scores - m)
    inv_l = 1.0 / e.sum(-1, keepdims=True)
    pv = jnp.einsum("bkrts,bksh->bkrth", e.astype(v_bksh.dtype), v_bksh, preferred_element_type=jnp.float32)
    return (pv * inv_l).astype(v_bksh.dtype), m, inv_l


def _softmax_attention_fwd(q_bkrth, k_bksh, v_bksh, mask_bts, block: int):
    t = q_bkrth.shape[3]
    if t <= block:
        out, m, inv_l = _forward_block(q_bkrth, k_bksh, v_bksh, mask_bts)
    else:  # padded queries see no key; their rows are cut off again
        blocks = jax.lax.map(lambda x: _forward_block(x[0], k_bksh, v_bksh, x[1]),
                             (_query_blocks(q_bkrth, 3, block), _query_blocks(mask_bts, 1, block)))
        out, m, inv_l = (_join_blocks(x, 3, t) for x in blocks)
    return out, (q_bkrth, k_bksh, v_bksh, mask_bts, out, m, inv_l)


def _backward_block(q, k, v, mask, out, m, inv_l, g_bkrth):
    """One block of queries' share of the gradient, the scores recomputed from q and k rather than stored:
    p = exp(scores - m) / l, dscores = p * (g @ v^T - sum(g * out)), then the three products (fp32 dk, dv)."""
    acc32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)  # fp32 sums of products
    p = jnp.exp(_scores(q, k, mask) - m) * inv_l
    dv = acc32("bkrts,bkrth->bksh", p.astype(v.dtype), g_bkrth)
    dp = jnp.einsum("bkrth,bksh->bkrts", g_bkrth, v)  # [T, S] in the operands' dtype, as autodiff's would be
    row = jnp.sum(g_bkrth.astype(jnp.float32) * out.astype(jnp.float32), -1, keepdims=True)
    ds = jnp.where(mask[:, None, None], p * (dp - row) * q.shape[-1] ** -0.5, 0.0).astype(q.dtype)
    return acc32("bkrts,bksh->bkrth", ds, k).astype(q.dtype), acc32("bkrts,bkrth->bksh", ds, q), dv


def _softmax_attention_bwd(block: int, residuals, g_bkrth):
    q, k, v, mask, out, m, inv_l = residuals
    t = q.shape[3]
    if t <= block:
        dq, dk, dv = _backward_block(q, k, v, mask, out, m, inv_l, g_bkrth)
    else:  # dk and dv add up over the blocks of queries
        def one(carry, x):
            q_c, mask_c, out_c, m_c, inv_l_c, g_c = x
            dq_c, dk_c, dv_c = _backward_block(q_c, k, v, mask_c, out_c, m_c, inv_l_c, g_c)
            return (carry[0] + dk_c, carry[1] + dv_c), dq_c

        zeros = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
        blocks = tuple(_query_blocks(x, 1 if x is mask else 3, block) for x in (q, mask, out, m, inv_l, g_bkrth))
        (dk, dv), dq = jax.lax.scan(one, zeros, blocks)
        dq = _join_blocks(dq, 3, t)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None


_softmax_attention.defvjp(_softmax_attention_fwd, _softmax_attention_bwd)


def attend_cached(q_btnh, kv, layer, mask_bts, bound, block: int | None = None) -> jax.Array:
    """`attend` of T new queries over layer `layer` of the cache (k, v [L, B, K, S, H], or per layer, in parts
    with keys [B, K, H, S']: `cache.Cache`), reading only the slots below `bound` ([] int32), `block` slots
    at a time (default `CACHE_BLOCK`).

    A decode step then costs what the cache holds, not what it could hold: at token 100 of an 8K budget it
    reads one block, not 8K slots. The blocks are combined by the online softmax (a running max m, sum l
    and unnormalised output per query): after block j, out = acc / l with acc = sum_s exp(score_s - m) v_s,
    rescaled by exp(m_old - m_new) whenever the max grows. A block that is all masked adds exp(-huge) = 0
    exactly, so reading further than needed never changes a value. The last block is moved back to end
    at S; the slots it shares with the block before are masked out of it. A per-layer cache's head is read
    whole, where it is, and its tail in blocks.
    """
    k_full, v_full = kv
    block = block or CACHE_BLOCK
    t, n, h = q_btnh.shape[1], q_btnh.shape[2], q_btnh.shape[3]
    b, kh = mask_bts.shape[0], (v_full[layer][0] if isinstance(v_full, tuple) else v_full).shape[-3]
    q_bkrth = q_btnh.reshape(b, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4)
    stats = jnp.full(q_bkrth.shape[:-1], _MASKED, jnp.float32)
    carry = (stats, jnp.zeros_like(stats), jnp.zeros(q_bkrth.shape, jnp.float32))
    if isinstance(k_full, tuple):  # per layer: (head,) or (head, tail), keys [B, K, H, S']
        one = functools.partial(_online_block, q_bkrth, "bkrth,bkhs->bkrts")
        (k_head, *k_tail), (v_head, *v_tail) = k_full[layer], v_full[layer]
        offset = v_head.shape[2]
        carry = one(carry, k_head, v_head, mask_bts[:, :, :offset])
        if k_tail:
            carry = _blocks(one, carry, k_tail[0], v_tail[0], mask_bts, offset, bound, block, key_slots=3)
    else:
        one = functools.partial(_online_block, q_bkrth, "bkrth,bksh->bkrts")
        carry = _blocks(one, carry, k_full, v_full, mask_bts, 0, bound, block, layer=layer, key_slots=2)
    _, total, acc = carry
    out = (acc / total[..., None]).astype(q_btnh.dtype)  # [B, K, R, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _blocks(one, carry, keys, v_bksh, mask_bts, offset: int, bound, block: int, *, key_slots: int, layer=None):
    """`one` over the blocks of keys (slots on axis `key_slots`) and values [B, K, S', H] (or of layer `layer`
    of stacked [L, ...] ones) that hold cache slots [offset, offset + S') below `bound`, in a loop. Each block
    is one slice (of the layer and the slots together)."""
    s = v_bksh.shape[-2]
    width = min(block, s)

    def read(full, start, axis):
        if layer is None:
            return jax.lax.dynamic_slice_in_dim(full, start, width, axis=axis)
        at, size = [layer] + [0] * (full.ndim - 1), list(full.shape)
        at[axis + 1], size[0], size[axis + 1] = start, 1, width
        return jax.lax.dynamic_slice(full, at, size)[0]

    def body(j, carry):
        first = j * width
        start = jnp.minimum(first, s - width)
        visible = jax.lax.dynamic_slice_in_dim(mask_bts, offset + start, width, axis=2)
        visible &= (start + jnp.arange(width) >= first)[None, None, :]
        return one(carry, read(keys, start, key_slots), read(v_bksh, start, 2), visible)

    return jax.lax.fori_loop(0, (bound - offset + width - 1) // width, body, carry)


def _online_block(q_bkrth, equation: str, carry, keys, v_bksh, visible_bts):
    """The online softmax's update (`attend_cached`) with one block of keys (in the layout `equation` reads)
    and values."""
    m, total, acc = carry  # [B, K, R, T], [B, K, R, T], [B, K, R, T, H]
    h = q_bkrth.shape[-1]
    scores = jnp.einsum(equation, q_bkrth, keys.astype(q_bkrth.dtype), preferred_element_type=jnp.float32)
    scores = jnp.where(visible_bts[:, None, None], scores * h**-0.5, _MASKED)
    m_new = jnp.maximum(m, scores.max(-1))
    p, rescale = jnp.exp(scores - m_new[..., None]), jnp.exp(m - m_new)
    v = v_bksh.astype(q_bkrth.dtype)
    pv = jnp.einsum("bkrts,bksh->bkrth", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, total * rescale + p.sum(-1), acc * rescale[..., None] + pv


# The projections' einsums for the two weight layouts. Stored (checkpoints, training): Hugging Face's
# [out, in]. Decode (`Qwen2.unstack_layers`): [in, out], transposed once before the loop, and the attention
# weights used as 2-D matrices ([D, N·H], [N·H, D]). XLA:CPU's matmul kernels read a skinny [B, in] x [in, out]
# product fastest (measured: 1.84 vs 2.77 ms for [16, 1536] x [1536, 8960]); with [out, in], or with 3-D head
# weights, it also copied the attention weights into another order at every decode step.
EQUATIONS = {
    False: dict(q="td,nhd->tnh", kv="td,khd->tkh", o="tnh,dnh->td", up="td,fd->tf", down="tf,df->td"),
    True: dict(q="td,df->tf", kv="td,df->tf", o="tf,fd->td", up="td,df->tf", down="tf,fd->td"),
}
# Each stored weight to its decode layout (moveaxis(source, destination) of one layer's weight): the order
# EQUATIONS[True] reads.
DECODE_ORDER = {"q_proj": (-1, 0), "k_proj": (-1, 0), "v_proj": (-1, 0), "o_proj": (0, -1),
                "gate_proj": (0, 1), "up_proj": (0, 1), "down_proj": (0, 1)}


def project(x_bt_, equation: str, w):
    """`einsum(equation, x, w)` with the batch and time axes of x folded into one ("td,fd->tf" on [B, T, D]).

    Same values as the batched einsum, but its gradient with respect to w is one plain matmul contracting
    B·T rows: XLA:CPU ran the two-axis contraction of "btf,btd->fd" 2-5x slower than the folded one."""
    b, t = x_bt_.shape[:2]
    out = jnp.einsum(equation, x_bt_.reshape(b * t, *x_bt_.shape[2:]), w)
    return out.reshape(b, t, *out.shape[1:])


class Attention(nnx.Module):
    """Grouped-query self-attention with q/k/v biases and no output bias."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, mesh, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # Weights are stored in Hugging Face's [out, in] order; decode loops use a transposed copy (EQUATIONS).
        self.q_proj = nnx.Param(_init(rngs, (n, h, d), param_dtype))
        self.q_bias = nnx.Param(jnp.zeros((n, h), param_dtype))
        self.k_proj = nnx.Param(_init(rngs, (k, h, d), param_dtype))
        self.k_bias = nnx.Param(jnp.zeros((k, h), param_dtype))
        self.v_proj = nnx.Param(_init(rngs, (k, h, d), param_dtype))
        self.v_bias = nnx.Param(jnp.zeros((k, h), param_dtype))
        self.o_proj = nnx.Param(_init(rngs, (d, n, h), param_dtype))
        self.dtype = dtype
        self.mesh = mesh

    def __call__(self, x_btd, rope_bt, mask_bts, kv=None, layer=None, index=None, bound=None, in_out=False,
                 prefix=None):
        """Attends over the new tokens alone (kv None), after a prefix's keys and values (prefix: k, v
        [B, K, P, H]; mask_bts [B, T, P + T] then covers [prefix | new]), or over layer `layer` of the full
        cache (k, v [L, B, K, S, H]), into which the new keys and values are first written at slot `index`;
        then only the cache's first `bound` slots are read. in_out: the weights are in the decode layout
        (`EQUATIONS`). Returns (out, kv): without a cache, kv is the new tokens' own keys and values
        ([B, K, T, H] each), which a later call can take as its prefix."""
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        eq = EQUATIONS[in_out]
        b, t, d = x_btd.shape

        def heads(equation, p):
            if not in_out:
                return project(x_btd, equation, w(p))
            weight = w(p)  # [D, heads, H], used as a [D, heads·H] matrix; the output split into heads again
            return project(x_btd, equation, weight.reshape(d, -1)).reshape(b, t, *weight.shape[1:])

        q = heads(eq["q"], self.q_proj) + w(self.q_bias)
        k = heads(eq["kv"], self.k_proj) + w(self.k_bias)
        v = heads(eq["kv"], self.v_proj) + w(self.v_bias)
        q = sharding.constrain(rope(q, rope_bt), "act_btnh", self.mesh)
        k = sharding.constrain(rope(k, rope_bt), "act_btkh", self.mesh)
        if kv is None:
            kv = k.swapaxes(1, 2), v.swapaxes(1, 2)  # keys [B, K, T, H]
            keys, values = kv if prefix is None else [jnp.concatenate(x, axis=2) for x in zip(prefix, kv, strict=True)]
            out = attend(q, keys, values, mask_bts)
        else:
            kv = kv_cache.write_layer(kv, layer, k, v, index)
            out = attend_cached(q, kv, layer, mask_bts, bound)
        out = sharding.constrain(out, "act_btnh", self.mesh)
        if in_out:  # [heads, H, D] as an [N·H, D] matrix
            return project(out.reshape(b, t, -1), eq["o"], w(self.o_proj).reshape(-1, d)), kv
        return project(out, eq["o"], w(self.o_proj)), kv


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, mesh, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nnx.Param(_init(rngs, (f, d), param_dtype))  # [out, in], as in Attention
        self.up_proj = nnx.Param(_init(rngs, (f, d), param_dtype))
        self.down_proj = nnx.Param(_init(rngs, (d, f), param_dtype))
        self.dtype = dtype
        self.mesh = mesh

    def __call__(self, x_btd, in_out=False):
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        eq = EQUATIONS[in_out]
        gate = project(x_btd, eq["up"], w(self.gate_proj))
        up = project(x_btd, eq["up"], w(self.up_proj))
        hidden = sharding.constrain(jax.nn.silu(gate) * up, "act_btf", self.mesh)
        return project(hidden, eq["down"], w(self.down_proj))


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, mesh, rngs: nnx.Rngs):
        kw = dict(param_dtype=param_dtype, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, mesh=mesh, rngs=rngs, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, mesh=mesh, rngs=rngs, **kw)
        self.mesh = mesh

    def __call__(self, x_btd, rope_bt, mask_bts, kv=None, layer=None, index=None, bound=None, in_out=False,
                 prefix=None):
        attn, kv = self.self_attn(self.input_layernorm(x_btd), rope_bt, mask_bts, kv, layer, index, bound, in_out,
                                  prefix)
        x_btd = sharding.constrain(x_btd + attn, "act_btd", self.mesh)
        x_btd = sharding.constrain(x_btd + self.mlp(self.post_attention_layernorm(x_btd), in_out), "act_btd",
                                   self.mesh)
        return x_btd, kv
