"""Softmax attention with grouped KV heads, on XLA: `attend_causal` for forwards without a cache (training's,
the prefill's: causal query blocks, the gradient written out), `attend_shared_prefix` for rows that continue a
prompt held once per group, and `attend_cached` for decoding (cache slots in blocks, an online softmax)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# A large finite negative instead of -inf: a query row with no visible key (left padding) then gets
# a uniform softmax instead of NaN, and NaN never leaks into gradients.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
# Cache slots a cached attention reads per block (`attend_cached`): decoding pays for ceil(filled / 256)
# blocks. Small enough that a short response reads little of a long budget, large enough that the loop over
# blocks costs little per step.
CACHE_BLOCK = 256
# The name of a training attention's output and softmax statistics (the residuals its backward reads besides
# q, k and v), for remat policies that keep them: the backward then recomputes the scores once, in its own
# pass, and the forward is not run a second time (`qwen2.REMAT_POLICIES["dots"]`).
OUTPUT_NAME = "attention_output"
# Queries a causal attention (`attend_causal`) takes at a time: block i reads keys [0, (i + 1)·block) only, so
# smaller blocks skip more of the upper triangle, and each block is one more step of an unrolled loop.
CAUSAL_BLOCK = 512


def attend_causal(q_btnh, k_bksh, v_bksh, mask_bt, query_block: int | None = None) -> jax.Array:
    """Causal self-attention of a row's tokens among themselves (S = T), the XLA backend of
    `attention_plan`: query t sees key s where s <= t and mask_bt[s] (its real tokens), and a padded query
    also itself (so that it has a key whatever the blocks; its value never reaches a real query).

    The values and gradients at real positions of softmax attention under `cache.causal_mask(mask_bt)` (the
    prefixed attention with no prefix slots: the softmax gradient written out), with the keys past the diagonal
    skipped: queries run `query_block` at a time (default `CAUSAL_BLOCK`), and block i reads only keys
    [0, (i + 1)·query_block), forward and backward; no [B, T, T] mask is formed. At T = 2,048 in blocks of 512
    the four blocks read 5/8 of the [T, T] scores. Every position's value is the same whatever the block size."""
    empty = lambda x: x[:, :, :0]  # noqa: E731  an empty prefix per row: the prefixed attention's own part alone
    return attend_shared_prefix(q_btnh, empty(k_bksh), empty(v_bksh), k_bksh, v_bksh, mask_bt[:, :0], mask_bt,
                                query_block)


def _causal_spans(t: int, block: int) -> list[tuple[int, int]]:
    """(first query, keys read) of each query block: block i's queries see keys up to its last query."""
    return [(i, min(i + block, t)) for i in range(0, t, block)]


def _causal_block_mask(mask_bt, first: int, end: int):
    """[B, end - first, end]: query t = first + i sees key s where s <= t and mask_bt[s], and itself (which
    changes only padded queries: none is left without a key, and none reaches a real query)."""
    keys, queries = jnp.arange(end)[None, :], jnp.arange(first, end)[:, None]
    return (keys <= queries)[None] & (mask_bt[:, None, :end] | (keys == queries)[None])


def _group_heads(q_btnh, kv_heads: int):
    """[B, T, N, H] -> [B, K, R, T, H]: the R = N / K query heads that share each KV head together."""
    b, t, n, h = q_btnh.shape
    return q_btnh.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)


def _ungroup_heads(out_bkrth):
    """Inverse of `_group_heads`."""
    b, k, r, t, h = out_bkrth.shape
    return out_bkrth.transpose(0, 3, 1, 2, 4).reshape(b, t, k * r, h)


def _scores(q_bkrth, keys, mask_bts, equation: str = "bkrth,bksh->bkrts"):
    """Scaled fp32 scores [B, K, R, T, S] of the keys (in the layout `equation` reads), masked keys at _MASKED."""
    scores = jnp.einsum(equation, q_bkrth, keys, preferred_element_type=jnp.float32)
    return jnp.where(mask_bts[:, None, None], scores * q_bkrth.shape[-1] ** -0.5, _MASKED)


def _by_prefix(x, prefixes: int):
    """[B, K, R, T, ...] -> [Q, K, G·R·T, ...]: the rows' queries (or their stats) with the G = B / Q rows that
    read one prefix side by side, per KV head."""
    b, k, r, t = x.shape[:4]
    g = b // prefixes
    x = x.reshape(prefixes, g, *x.shape[1:]).swapaxes(1, 2)
    return x.reshape(prefixes, k, g * r * t, *x.shape[5:])


def _by_row(x, rows_like):
    """Inverse of `_by_prefix`, back to the [B, K, R, T] of `rows_like`."""
    b, k, r, t = rows_like.shape[:4]
    x = x.reshape(x.shape[0], k, b // x.shape[0], r, t, *x.shape[3:]).swapaxes(1, 2)
    return x.reshape(b, k, r, t, *x.shape[5:])


def causal_block(query_block: int | None) -> int:
    """Queries a causal attention takes at a time: `query_block`, at most `CAUSAL_BLOCK` (default)."""
    return min(query_block or CAUSAL_BLOCK, CAUSAL_BLOCK)


def attend_shared_prefix(q_btnh, prefix_k, prefix_v, k_bksh, v_bksh, prefix_mask, mask_bt,
                         query_block: int | None = None):
    """Causal attention of rows that continue a shared prefix: row b attends to the real slots of prefix b // G
    (prefix_mask [Q, P]), then causally to its own real tokens (mask_bt [B, T], as `attend_causal`; a padded
    query also sees itself). prefix_k, prefix_v [Q, K, P, H] hold each prefix once; the B rows are Q groups of
    G = B / Q in order (a GRPO group's responses to one prompt; G = 1: each row its own prefix).

    The values and gradients at real positions of attention over each row's own copy of its prefix, in fewer
    passes: per KV head a group's G·R queries of a block meet the prefix in one [G·R·T, H] x [H, P] product,
    forward and backward (the GRPO bench's loss, 8 groups of 8 rows, 128 prompt and 64 response tokens:
    24.5 ms a layer's forward + backward against 30.6 ms over gathered copies), and no [B, K, P, H] copy is
    gathered, nor its gradient scattered back. Queries run `query_block` at a time (default `CAUSAL_BLOCK`),
    block i reading the prefix and its own keys up to its diagonal, so responses of any length share their
    prompt and no [T, P + T] mask is formed."""
    check_prefixed(q_btnh, prefix_k, prefix_mask, mask_bt)
    q_bkrth = _group_heads(q_btnh, k_bksh.shape[1])
    out = _prefixed_attention(q_bkrth, prefix_k, prefix_v, k_bksh, v_bksh, prefix_mask, mask_bt,
                              query_block or CAUSAL_BLOCK)
    return _ungroup_heads(out)


def check_prefixed(q_btnh, prefix_k, prefix_mask, mask_bt) -> None:
    """B rows of T queries can read Q prefixes of P slots (prefix_k [Q, K, P, H], prefix_mask [Q, P]) in equal
    groups, their own tokens marked by mask_bt [B, T]; else a ValueError naming the shapes."""
    q_count, p = prefix_k.shape[0], prefix_k.shape[2]
    b, t = q_btnh.shape[:2]
    if b % q_count or prefix_mask.shape != (q_count, p) or mask_bt.shape != (b, t):
        raise ValueError(f"{b} rows cannot read {q_count} prefixes of {p} slots in equal groups with masks of "
                         f"shapes {prefix_mask.shape} (prefix) and {mask_bt.shape} (rows)")


def _shared_scores(q_bkrth, keys, visible_qtp, equation: str = "qkmh,qksh->qkms"):
    """Scaled fp32 scores [Q, K, G·R·T, P] of each group's queries against its prefix's keys (in the layout
    `equation` reads), masked where the group's rows do not see the slot (visible [Q, T, P])."""
    scores = jnp.einsum(equation, _by_prefix(q_bkrth, keys.shape[0]), keys.astype(q_bkrth.dtype),
                        preferred_element_type=jnp.float32)
    return _mask_shared(scores * q_bkrth.shape[-1] ** -0.5, visible_qtp, _MASKED)


def _mask_shared(x_qkms, visible_qtp, fill):
    """x [Q, K, G·R·T, P] where the group's queries see the prefix slot (visible [Q, T, P]), else fill."""
    q_count, k, m, p = x_qkms.shape
    t = visible_qtp.shape[1]
    x = x_qkms.reshape(q_count, k, m // t, t, p)  # G·R query rows of T positions each
    return jnp.where(visible_qtp[:, None, None], x, fill).reshape(x_qkms.shape)


def _prefixed_visible(prefix_mask_qp, mask_bt, first: int, end: int):
    """The masks of queries [first, end): the prefix slots their group sees ([Q, end - first, P]) and their own
    keys [0, end) (`_causal_block_mask`)."""
    q_count, p = prefix_mask_qp.shape
    return (jnp.broadcast_to(prefix_mask_qp[:, None], (q_count, end - first, p)),
            _causal_block_mask(mask_bt, first, end))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _prefixed_attention(q_bkrth, prefix_k, prefix_v, k_bksh, v_bksh, prefix_mask_qp, mask_bt, block: int):
    """softmax over [prefix | own keys] @ [prefix | own values], one softmax over both parts: with the row max
    m and sum l over both, out = (exp(s_prefix - m) @ v_prefix + exp(s_own - m) @ v_own) / l; queries in
    causal blocks (`_causal_spans`)."""
    return _prefixed_attention_fwd(q_bkrth, prefix_k, prefix_v, k_bksh, v_bksh, prefix_mask_qp, mask_bt, block)[0]


def _prefixed_forward_block(q_bkrth, prefix_k, prefix_v, k_bksh, v_bksh, visible_qtp, visible_btt):
    """One block of queries, normalised after the products: out = acc / l, with the row max m and 1 / l, which
    the backward reads. A query with no visible key gets the uniform softmax. With no prefix slots (plain causal
    attention) the prefix's terms are not in the program at all."""
    acc32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)  # products in the values' dtype
    own = _scores(q_bkrth, k_bksh, visible_btt)
    m = own.max(-1)
    if prefix_k.shape[2]:
        shared = _shared_scores(q_bkrth, prefix_k, visible_qtp)
        m = jnp.maximum(_by_row(shared.max(-1), q_bkrth), m)
    m = m[..., None]                                                                      # [B, K, R, T, 1]
    e_own = jnp.exp(own - m)
    total, acc = e_own.sum(-1, keepdims=True), acc32("bkrts,bksh->bkrth", e_own.astype(v_bksh.dtype), v_bksh)
    if prefix_k.shape[2]:
        e_shared = jnp.exp(shared - _by_prefix(m, prefix_k.shape[0]))
        total = total + _by_row(e_shared.sum(-1, keepdims=True), q_bkrth)
        acc = acc + _by_row(acc32("qkms,qksh->qkmh", e_shared.astype(prefix_v.dtype), prefix_v), q_bkrth)
    inv_l = 1.0 / total
    return (acc * inv_l).astype(v_bksh.dtype), m, inv_l


def _prefixed_attention_fwd(q_bkrth, prefix_k, prefix_v, k_bksh, v_bksh, prefix_mask_qp, mask_bt, block: int):
    parts = [_prefixed_forward_block(q_bkrth[:, :, :, first:end], prefix_k, prefix_v, k_bksh[:, :, :end],
                                     v_bksh[:, :, :end], *_prefixed_visible(prefix_mask_qp, mask_bt, first, end))
             for first, end in _causal_spans(q_bkrth.shape[3], block)]
    out, m, inv_l = (checkpoint_name(jnp.concatenate(x, axis=3), OUTPUT_NAME) for x in zip(*parts, strict=True))
    return out, (q_bkrth, prefix_k, prefix_v, k_bksh, v_bksh, prefix_mask_qp, mask_bt, out, m, inv_l)


def _prefixed_backward_block(q, prefix_k, prefix_v, k_bksh, v_bksh, visible_qtp, visible_btt, out, m, inv_l, g_bkrth):
    """One block of queries' share of the gradient, the scores recomputed from q and k rather than stored, for
    both parts: p = exp(s - m) / l, ds = p * (g @ v^T - sum(g * out)), then the products (fp32 dk, dv), the
    prefix's dk and dv summed over its group's queries by the grouped products themselves."""
    q_count, h = prefix_k.shape[0], prefix_k.shape[-1]
    acc32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
    p_own = jnp.exp(_scores(q, k_bksh, visible_btt) - m) * inv_l
    row = jnp.sum(g_bkrth.astype(jnp.float32) * out.astype(jnp.float32), -1, keepdims=True)
    ds_own = jnp.where(visible_btt[:, None, None], p_own * (jnp.einsum("bkrth,bksh->bkrts", g_bkrth, v_bksh) - row)
                       * h ** -0.5, 0.0).astype(q.dtype)  # the products in the operands' dtype
    dq = acc32("bkrts,bksh->bkrth", ds_own, k_bksh)
    own = acc32("bkrts,bkrth->bksh", ds_own, q), acc32("bkrts,bkrth->bksh", p_own.astype(v_bksh.dtype), g_bkrth)
    if not prefix_k.shape[2]:
        return dq.astype(q.dtype), jnp.zeros(prefix_k.shape, jnp.float32), jnp.zeros(prefix_v.shape, jnp.float32), *own
    p_shared = jnp.exp(_shared_scores(q, prefix_k, visible_qtp) - _by_prefix(m, q_count)) * _by_prefix(inv_l, q_count)
    g_shared, q_shared = _by_prefix(g_bkrth, q_count), _by_prefix(q, q_count)
    ds_shared = p_shared * (jnp.einsum("qkmh,qksh->qkms", g_shared, prefix_v) - _by_prefix(row, q_count)) * h ** -0.5
    ds_shared = _mask_shared(ds_shared, visible_qtp, 0.0).astype(q.dtype)
    dq = dq + _by_row(acc32("qkms,qksh->qkmh", ds_shared, prefix_k), q)
    return (dq.astype(q.dtype), acc32("qkms,qkmh->qksh", ds_shared, q_shared),
            acc32("qkms,qkmh->qksh", p_shared.astype(prefix_v.dtype), g_shared), *own)


def _prefixed_attention_bwd(block: int, residuals, g_bkrth):
    q, prefix_k, prefix_v, k, v, prefix_mask_qp, mask_bt, out, m, inv_l = residuals
    t = q.shape[3]
    dq, sums = [], [jnp.zeros(x.shape, jnp.float32) for x in (prefix_k, prefix_v, k, v)]
    for first, end in _causal_spans(t, block):
        q_i, out_i, m_i, inv_l_i, g_i = (x[:, :, :, first:end] for x in (q, out, m, inv_l, g_bkrth))
        dq_i, *parts = _prefixed_backward_block(q_i, prefix_k, prefix_v, k[:, :, :end], v[:, :, :end],
                                                *_prefixed_visible(prefix_mask_qp, mask_bt, first, end),
                                                out_i, m_i, inv_l_i, g_i)
        dq.append(dq_i)
        pad = [(0, 0), (0, 0), (0, t - end), (0, 0)]
        parts[2:] = [jnp.pad(x, pad) for x in parts[2:]]  # own keys [0, end) of T
        sums = [total + part for total, part in zip(sums, parts, strict=True)]
    grads = [total.astype(x.dtype) for total, x in zip(sums, (prefix_k, prefix_v, k, v), strict=True)]
    return jnp.concatenate(dq, axis=3), *grads, None, None


_prefixed_attention.defvjp(_prefixed_attention_fwd, _prefixed_attention_bwd)


def attend_cached(q_btnh, kv, layer, mask_bts, bound, block: int | None = None, prefix=None) -> jax.Array:
    """Softmax attention of T new queries over layer `layer` of the cache (k, v [L, B, K, S, H], or per layer, in parts
    with keys [B, K, H, S']: `cache.Cache`), reading only the slots below `bound` ([] int32), `block` slots
    at a time (default `CACHE_BLOCK`).

    A decode step then costs what the cache holds, not what it could hold: at token 100 of an 8K budget it
    reads one block, not 8K slots. The blocks are combined by the online softmax (a running max m, sum l
    and unnormalised output per query): after block j, out = acc / l with acc = sum_s exp(score_s - m) v_s,
    rescaled by exp(m_old - m_new) whenever the max grows. A block that is all masked adds exp(-huge) = 0
    exactly, so reading further than needed never changes a value. The last block is moved back to end
    at S; the slots it shares with the block before are masked out of it. A per-layer cache's head is read
    whole, where it is, and its tail in blocks.

    prefix: the layer's (keys, values) of a `cache.Prefix` ([Q, K, P, H] each, or keys [Q, K, H, P] with a
    per-layer cache), which each group of B / Q rows reads first; mask_bts is then [B, T, P + S]. It is the
    first block, read once per group, with the group's queries together (`_prefix_block`).
    """
    k_full, v_full = kv
    block = block or CACHE_BLOCK
    per_layer = isinstance(k_full, tuple)
    q_bkrth = _group_heads(q_btnh, (v_full[layer][0] if per_layer else v_full).shape[-3])
    if prefix is None:
        stats = jnp.full(q_bkrth.shape[:-1], _MASKED, jnp.float32)
        carry = (stats, jnp.zeros_like(stats), jnp.zeros(q_bkrth.shape, jnp.float32))
    else:
        p_slots = prefix[1].shape[-2]
        carry = _prefix_block(q_bkrth, *prefix, mask_bts[:, :, :p_slots], keys_last=per_layer)
        mask_bts = mask_bts[:, :, p_slots:]
    if per_layer:  # per layer: (head,) or (head, tail), keys [B, K, H, S']
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
    return _ungroup_heads((acc / total[..., None]).astype(q_btnh.dtype))


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


def _prefix_block(q_bkrth, keys, v_qksh, visible_bts, *, keys_last: bool):
    """The online softmax's carry (`attend_cached`) after the first block: a prefix shared by each group of
    G = B / Q rows. A group's G·R·T queries per KV head are one [G·R·T, H] x [H, P] product against its
    prefix's keys, held once, instead of G products of [R·T, H] (the sampler's 8 samples of a prompt, 64
    rows, 128 prompt slots: 0.25 ms a layer against 0.41 for the same attention over per-row copies). Rows
    within a group see the same prefix slots (`cache.write`), so the group's first row's mask stands for all."""
    g = q_bkrth.shape[0] // v_qksh.shape[0]
    scores = _shared_scores(q_bkrth, keys, visible_bts[::g], "qkmh,qkhs->qkms" if keys_last else "qkmh,qksh->qkms")
    m = scores.max(-1)
    probs = jnp.exp(scores - m[..., None])
    v = v_qksh.astype(q_bkrth.dtype)
    pv = jnp.einsum("qkms,qksh->qkmh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    per_row = functools.partial(_by_row, rows_like=q_bkrth)
    return per_row(m), per_row(probs.sum(-1)), per_row(pv)


def _online_block(q_bkrth, equation: str, carry, keys, v_bksh, visible_bts):
    """The online softmax's update (`attend_cached`) with one block of keys (in the layout `equation` reads)
    and values."""
    m, total, acc = carry  # [B, K, R, T], [B, K, R, T], [B, K, R, T, H]
    scores = _scores(q_bkrth, keys.astype(q_bkrth.dtype), visible_bts, equation)
    m_new = jnp.maximum(m, scores.max(-1))
    p, rescale = jnp.exp(scores - m_new[..., None]), jnp.exp(m - m_new)
    v = v_bksh.astype(q_bkrth.dtype)
    pv = jnp.einsum("bkrts,bksh->bkrth", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, total * rescale + p.sum(-1), acc * rescale[..., None] + pv
