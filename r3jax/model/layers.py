"""Qwen2 building blocks in Flax NNX: RMSNorm, rotary embedding, grouped-query attention, SwiGLU.

The softmax attention itself (training and cached) is `r3jax.model.attention`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from r3jax.model import attention_plan, sharding
from r3jax.model import cache as kv_cache
from r3jax.model.attention import attend_cached
from r3jax.model.config import ModelConfig


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

    def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, mesh, rngs: nnx.Rngs, query_block: int | None = None,
                 attention: str = "xla"):
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
        self.query_block = query_block
        self.attention = attention  # the causal self-attention backend (`attention_plan.BACKENDS`)

    def __call__(self, x_btd, rope_bt, mask_bts, kv=None, layer=None, index=None, bound=None, in_out=False,
                 prefix=None):
        """Attends causally over the new tokens alone (kv and prefix None; mask_bts is then the [B, T] mask of
        real tokens, and the backend is `attention`), after a prefix's keys and values (prefix: k, v
        [Q, K, P, H] for Q groups of B / Q rows in order; mask_bts is then (the prefixes' real slots [Q, P],
        the rows' real tokens [B, T])), or over layer `layer` of the full
        cache (k, v [L, B, K, S, H]), into which the new keys and values are first written at slot `index`;
        then only the cache's first `bound` slots are read, after the layer's keys and values of the cache's
        shared prefix if it has one (prefix: `cache.Prefix.layer`; mask_bts [B, T, P + S]). in_out: the
        weights are in the decode layout (`EQUATIONS`). Returns (out, kv): without a cache, kv is the new
        tokens' own keys and values ([B, K, T, H] each), which a later call can take as its prefix."""
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
            if prefix is None:
                out = attention_plan.self_attention(self.attention, q, *kv, mask_bts, mesh=self.mesh,
                                                    query_block=self.query_block)
            else:  # Q prefixes, each read by a group of B / Q rows; mask_bts: (prefix mask [Q, P], rows' [B, T])
                out = attention_plan.prefixed_attention(self.attention, q, *prefix, *kv, *mask_bts, mesh=self.mesh,
                                                        query_block=self.query_block)
        else:
            kv = kv_cache.write_layer(kv, layer, k, v, index)
            out = attend_cached(q, kv, layer, mask_bts, bound, prefix=prefix)
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

    def __init__(self, cfg: ModelConfig, *, param_dtype, dtype, mesh, rngs: nnx.Rngs, query_block: int | None = None,
                 attention: str = "xla"):
        kw = dict(param_dtype=param_dtype, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, mesh=mesh, rngs=rngs, query_block=query_block, attention=attention, **kw)
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
