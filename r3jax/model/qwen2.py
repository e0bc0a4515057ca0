"""The Qwen2 decoder: embedding, a scanned stack of layers, final norm and (tied or untied) head.

Public call: `logits = model(tokens, attention_mask=mask)` on a [B, T] int batch, right- or
left-padded. Positions come from the mask, so padding never changes the logits of real tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from r3jax.model import attention_plan, sharding
from r3jax.model import cache as kv_cache
from r3jax.model.attention import OUTPUT_NAME
from r3jax.model.config import ModelConfig
from r3jax.model.layers import DECODE_ORDER, DecoderLayer, RMSNorm, _init, rope_tables

# What a layer keeps for its backward. none: everything; full: only its input (the backward runs the layer
# again); dots: the projections' outputs and the attention's output and softmax statistics, so the backward
# recomputes only elementwise work and, in the attention's own backward, the scores once.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                                                            jax.checkpoint_policies.save_only_these_names(OUTPUT_NAME)),
}


class Qwen2(nnx.Module):
    """Qwen2ForCausalLM in Flax NNX.

    param_dtype: dtype the weights are stored in. dtype: dtype of the computation (weights are cast
    per use; norms, softmax and the head's accumulation stay fp32). remat: per-layer
    rematerialisation, one of REMAT_POLICIES. mesh: when set, activations are pinned to their
    `sharding.ACTIVATION_SPECS` entries on it. query_block: queries a causal attention takes at a time
    on the XLA backend (default and most `attention.CAUSAL_BLOCK`): the largest [T, S] temporary is
    [query_block, S]. attention: the backend of causal self-attention in forwards without a cache
    (`attention_plan.BACKENDS`; "auto": the platform's, that of the mesh's devices or JAX's default backend).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32,
                 remat: str = "none", mesh=None, query_block: int | None = None, attention: str = "auto"):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
        if query_block is not None and (isinstance(query_block, bool) or not isinstance(query_block, int)
                                        or query_block < 1):
            raise ValueError(f"query_block must be a positive int (queries per attention block), got {query_block!r}")
        param_dtype, dtype = jnp.dtype(param_dtype), jnp.dtype(dtype)
        self.config = config
        self.dtype = dtype
        self.remat = remat
        self.mesh = mesh
        self.attention = attention_plan.resolve_backend(attention, attention_plan.platform_of(mesh))
        v, d = config.vocab_size, config.hidden_size
        self.embed_tokens = nnx.Param(_init(rngs, (v, d), param_dtype))
        kw = dict(param_dtype=param_dtype, dtype=dtype, mesh=mesh, query_block=query_block, attention=self.attention)

        @nnx.split_rngs(splits=config.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(layer_rngs):
            return DecoderLayer(config, rngs=layer_rngs, **kw)

        self.layers = stack(rngs)  # every parameter carries a leading L axis
        self.norm = RMSNorm(d, config.rms_norm_eps, param_dtype=param_dtype, dtype=dtype)
        self.lm_head = None if config.tie_word_embeddings else nnx.Param(_init(rngs, (v, d), param_dtype))

    # --- public ------------------------------------------------------------------------------------

    def __call__(self, tokens_bt: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """Full forward. Returns fp32 logits [B, T, V]."""
        hidden, _ = self.hidden_states(tokens_bt, attention_mask)
        return self.logits(hidden)

    def head_weight(self) -> jax.Array:
        """The output projection [V, D] (the embedding when tied), in the compute dtype."""
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        return w[...].astype(self.dtype)

    def logits(self, hidden_btd: jax.Array) -> jax.Array:
        logits = jnp.einsum("btd,vd->btv", hidden_btd, self.head_weight(), preferred_element_type=jnp.float32)
        return sharding.constrain(logits, "act_btv", self.mesh)

    def hidden_states(self, tokens_bt, attention_mask=None, *, cache: kv_cache.Cache | None = None,
                      layers: list | None = None):
        """Final-normed hidden states [B, T, D] and the updated cache (None when none was given).

        Without a cache the T tokens attend causally among themselves. With one, they are written at
        slot `cache.index` and attend to every real token already cached plus those before them.
        layers: the output of `unstack_layers()`; the layers then run unrolled from those per-layer
        weights (in the decode layout) instead of scanned over the stack (see `unstack_layers`).
        Always compiled (one cached executable per shape), also when called outside `jax.jit`.
        """
        graphdef, state = nnx.split(self)
        return _hidden_states_jit(graphdef, state, tokens_bt, attention_mask, cache, layers)

    def prefill(self, tokens_bt, attention_mask) -> tuple[jax.Array, kv_cache.Cache]:
        """Final-normed hidden states [B, T, D] of a prompt batch and a cache of exactly its T slots, filled: the
        values `hidden_states` gives with an empty T-slot cache, at real tokens. The prompt runs as a forward
        without a cache (its causal self-attention on the plan's backend: splash on TPU, cuDNN on GPU) that keeps
        every layer's keys and values, rather than through the cache's online softmax."""
        graphdef, state = nnx.split(self)
        return _prefill_jit(graphdef, state, tokens_bt, attention_mask)

    def _prefill(self, tokens_bt, attention_mask):
        mask_bt = jnp.asarray(attention_mask).astype(bool)
        tables = rope_tables(kv_cache.positions_from_mask(mask_bt), self.config.head_dim, self.config.rope_theta,
                             self.dtype)
        x, _, (k, v) = self._scan_layers(self._embed(jnp.asarray(tokens_bt)), tables, mask_bt, None, None, None,
                                         emit=True)                                   # k, v [L, B, K, T, H]
        k, v = (sharding.constrain(x, "cache_lbksh", self.mesh) for x in (k, v))
        mask_bt = sharding.constrain(mask_bt, "cache_bs", self.mesh)
        return self.norm(x), kv_cache.Cache(k=k, v=v, mask=mask_bt, index=jnp.asarray(mask_bt.shape[1], jnp.int32))

    def unstack_layers(self) -> list:
        """The stacked layer weights as L per-layer trees in the decode layout, for decode loops.

        Inside a `lax.while_loop`, scanning over the stack slices every layer's weights out of it
        again at every step, and XLA materialises those slices (on CPU a decode step then moves its
        weights through memory twice). Slicing once before the loop makes the per-layer weights
        loop invariants. The projections are also transposed to [in, out] once here (`layers.EQUATIONS`:
        the order a skinny decode matmul reads fastest, where [out, in] made XLA:CPU copy the attention
        weights at every step). The price: the decode step's compile time grows with depth."""
        _, stacked = nnx.split(self.layers)

        def layer(i):
            def one(path, x):  # path: (..., DictKey(parameter name), GetAttrKey("value"))
                name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
                return jnp.moveaxis(x[i], *DECODE_ORDER[name]) if name in DECODE_ORDER else x[i]
            return jax.tree_util.tree_map_with_path(one, stacked)

        return [layer(i) for i in range(self.config.num_hidden_layers)]

    def _hidden_states(self, tokens_bt, attention_mask, cache, layers=None):
        tokens_bt = jnp.asarray(tokens_bt)
        if tokens_bt.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tokens_bt.shape}")
        mask_bt = (jnp.ones(tokens_bt.shape, bool) if attention_mask is None
                   else jnp.asarray(attention_mask).astype(bool))
        if mask_bt.shape != tokens_bt.shape:
            raise ValueError(f"attention_mask shape {mask_bt.shape} != tokens shape {tokens_bt.shape}")
        if cache is None:
            positions, mask_bts = kv_cache.positions_from_mask(mask_bt), mask_bt  # causal within the attention
            index = kv = bound = None
        else:
            index, kv, bound = cache.index, (cache.k, cache.v), kv_cache.filled(cache, tokens_bt.shape[1])
            cache, positions, mask_bts = kv_cache.write(cache, mask_bt)
        tables = rope_tables(positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        x = self._embed(tokens_bt)
        prefix = None if cache is None else cache.prefix  # a shared prefix each group of rows reads first
        if layers is None:
            x, kv, _ = self._scan_layers(x, tables, mask_bts, kv, index, bound,
                                         prefix=None if prefix is None else (prefix.k, prefix.v))
        else:
            layer_graphdef = nnx.graphdef(self.layers)
            for i, params in enumerate(layers):
                x, new = nnx.merge(layer_graphdef, params)(x, tables, mask_bts, kv, i, index, bound, in_out=True,
                                                           prefix=None if prefix is None else prefix.layer(i))
                kv = new if cache is not None else None  # without a cache: the layer's own keys, not a cache
        if cache is not None:
            cache = dataclasses.replace(cache, k=kv[0], v=kv[1])
        return self.norm(x), cache

    def shared_prefix_hidden_states(self, prefix_tokens, prefix_mask, row_prefix, tokens_bt, attention_mask, *,
                                    in_groups: bool = False):
        """Hidden states of B rows that each continue one of Q prefixes, each prefix run once.

        prefix_tokens, prefix_mask [Q, P]; row_prefix [B] int (which prefix row b continues); tokens_bt,
        attention_mask [B, T]. Returns (prefix hidden [Q, P, D], row hidden [B, T, D]): the values that
        `hidden_states` gives for [prefix_tokens[row_prefix[b]] | tokens_bt[b]], its first P and its last T
        positions, with the same masks and positions (at real tokens: a left pad with no real token before
        it has a value of its own, which reaches no real token), but every layer computes a prefix's keys
        and values once, and the rows attend to them ([prefix | own tokens]). This is how GRPO's G responses to one
        prompt train on one pass over that prompt; gradients reach the prefix from every row that reads it.
        in_groups (static): the rows are Q groups of B / Q in prefix order (row_prefix[b] = b // (B / Q), which
        the caller guarantees); the attention then meets each prefix once per group
        (`attention.attend_shared_prefix`) instead of each row reading a gathered copy.
        """
        graphdef, state = nnx.split(self)
        return _shared_prefix_jit(graphdef, state, prefix_tokens, prefix_mask, row_prefix, tokens_bt, attention_mask,
                                  in_groups)

    def _shared_prefix_hidden_states(self, prefix_tokens, prefix_mask, row_prefix, tokens_bt, attention_mask,
                                     in_groups: bool = False):
        prefix_tokens, tokens_bt, row_prefix = map(jnp.asarray, (prefix_tokens, tokens_bt, row_prefix))
        prefix_mask, mask_bt = jnp.asarray(prefix_mask).astype(bool), jnp.asarray(attention_mask).astype(bool)
        for name, x, m in (("prefix", prefix_tokens, prefix_mask), ("row", tokens_bt, mask_bt)):
            if x.ndim != 2 or m.shape != x.shape:
                raise ValueError(f"{name} tokens must be [rows, T] with a mask of the same shape, got {x.shape} "
                                 f"and {m.shape}")
        if row_prefix.shape != tokens_bt.shape[:1]:
            raise ValueError(f"row_prefix must be [B] = [{tokens_bt.shape[0]}], got shape {row_prefix.shape}")
        if in_groups and tokens_bt.shape[0] % prefix_tokens.shape[0]:
            raise ValueError(f"in_groups needs the {tokens_bt.shape[0]} rows in equal groups over the "
                             f"{prefix_tokens.shape[0]} prefixes")
        cfg = self.config
        tables = rope_tables(kv_cache.positions_from_mask(prefix_mask), cfg.head_dim, cfg.rope_theta, self.dtype)
        prefix, _, (k, v) = self._scan_layers(self._embed(prefix_tokens), tables, prefix_mask, None, None, None,
                                              emit=True)              # k, v [L, Q, K, P, H]
        b, q = tokens_bt.shape[0], prefix_tokens.shape[0]
        seen = jnp.repeat(prefix_mask, b // q, axis=0) if in_groups else prefix_mask[row_prefix]  # [B, P]
        # positions continue the prefix's (as `positions_from_mask` of the joined row gives them)
        positions = jnp.maximum(seen.sum(-1, dtype=jnp.int32)[:, None] + jnp.cumsum(mask_bt, -1, dtype=jnp.int32) - 1,
                                0)
        tables = rope_tables(positions, cfg.head_dim, cfg.rope_theta, self.dtype)
        masks = (prefix_mask if in_groups else seen, mask_bt)  # each row's prefix's real slots, its own tokens
        x, _, _ = self._scan_layers(self._embed(tokens_bt), tables, masks, None, None, None, prefix=(k, v),
                                    prefix_rows=None if in_groups else row_prefix)
        return self.norm(prefix), self.norm(x)

    def _embed(self, tokens_bt):
        table = sharding.constrain(self.embed_tokens[...].astype(self.dtype), "emb_lookup_vd", self.mesh)
        return sharding.constrain(jnp.take(table, tokens_bt, axis=0), "act_btd", self.mesh)

    # --- internals ---------------------------------------------------------------------------------

    def _scan_layers(self, x, tables, mask_bts, kv, index, bound, *, prefix=None, prefix_rows=None,
                     emit: bool = False):
        """Runs the L stacked layers with one `lax.scan`, so compile time does not grow with depth.

        The full [L, B, K, S, H] cache rides in the carry and each layer writes its slab in place. Without a
        cache, prefix (k, v [L, Q, K, P, H]) gives each layer the keys and values its tokens attend to first
        (row b those of prefix prefix_rows[b], gathered inside the layer: no [L, B, ...] copy, nor its
        gradient, is ever formed; without prefix_rows, the B rows are Q groups in prefix order, which the
        layer's attention reads as such); with one, it is the cache's shared prefix (`cache.Prefix`). emit returns
        every layer's own (k, v [L, B, K, T, H]). Returns (x, kv, emitted or None)."""
        graphdef, layer_params = nnx.split(self.layers)

        def body(carry, per_layer):
            x, kv = carry
            params, layer, layer_prefix = per_layer
            if layer_prefix is not None and prefix_rows is not None:
                layer_prefix = tuple(jnp.take(p, prefix_rows, axis=0) for p in layer_prefix)
            x, new = nnx.merge(graphdef, params)(x, tables, mask_bts, kv, layer, index, bound, prefix=layer_prefix)
            if kv is not None:
                return (x, new), None
            return (x, None), (new if emit else None)

        if self.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        layers = jnp.arange(self.config.num_hidden_layers)
        (x, kv), emitted = jax.lax.scan(body, (x, kv), (layer_params, layers, prefix))
        return x, kv, emitted


@functools.partial(jax.jit, static_argnums=0)
def _hidden_states_jit(graphdef, state, tokens_bt, attention_mask, cache, layers):
    return nnx.merge(graphdef, state)._hidden_states(tokens_bt, attention_mask, cache, layers)


@functools.partial(jax.jit, static_argnums=0)
def _prefill_jit(graphdef, state, tokens_bt, attention_mask):
    return nnx.merge(graphdef, state)._prefill(tokens_bt, attention_mask)


@functools.partial(jax.jit, static_argnums=(0, 7))
def _shared_prefix_jit(graphdef, state, prefix_tokens, prefix_mask, row_prefix, tokens_bt, attention_mask, in_groups):
    return nnx.merge(graphdef, state)._shared_prefix_hidden_states(prefix_tokens, prefix_mask, row_prefix, tokens_bt,
                                                                   attention_mask, in_groups)


def init_model(config: ModelConfig, seed: int = 0, **kwargs) -> Qwen2:
    """A randomly initialised model (std 0.02 normal weights, unit norms, zero biases).

    The initialisers run as one compiled program (op-by-op they take seconds even for tiny models)."""
    graphdef, _ = nnx.split(abstract_model(config, **kwargs))
    state = _init_state(config, tuple(sorted(kwargs.items())), jax.random.key(seed, impl="rbg"))
    return nnx.merge(graphdef, state)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_state(config, kwargs, key):
    # An rbg key: its initialisers compile in a fraction of threefry's time.
    return nnx.split(Qwen2(config, rngs=nnx.Rngs(key), **dict(kwargs)))[1]


def abstract_model(config: ModelConfig, **kwargs) -> Qwen2:
    """The model with ShapeDtypeStructs for parameters: shapes and dtypes, nothing allocated."""
    return nnx.eval_shape(lambda: Qwen2(config, rngs=nnx.Rngs(0), **kwargs))


def split_params(model: Qwen2) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, params) with params a plain nested dict of arrays, for passing through `jax.jit`."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def merge_params(graphdef: nnx.GraphDef, params: dict) -> Qwen2:
    """Inverse of `split_params`; works on tracers inside jitted functions."""
    return nnx.merge(graphdef, params)
