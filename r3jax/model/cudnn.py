"""The GPU backend of causal self-attention: cuDNN's fused flash attention through
`jax.nn.dot_product_attention(..., implementation="cudnn")` (`attention_plan`'s "cudnn").

cuDNN skips the blocks above the diagonal and never writes [T, S] scores to memory, but it knows padding only
as a row's trailing positions (`query_seq_lengths`, `key_value_seq_lengths`). A training row is
[left padding | prompt | response | right padding]: its real tokens are one contiguous span. Each row is
therefore rotated so that its span starts at position 0, attended with causal + padding masks, and rotated
back; attention depends on the keys' order only through the causal mask, which the rotation keeps among real
tokens. A batch whose real tokens are not one span per row (holes) takes `attention.attend_causal` instead
(`lax.cond`: the check is on values, both programs are compiled). Padded queries return what cuDNN gives them
(zeros); real positions equal `attention.attend_causal`'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from r3jax.model import attention


def attend_causal(q_btnh, k_bksh, v_bksh, mask_bt, *, implementation: str | None = "cudnn") -> jax.Array:
    """Causal self-attention of [B, T, N, H] queries over [B, K, T, H] keys and values, real tokens marked by
    mask_bt [B, T]. implementation: `jax.nn.dot_product_attention`'s ("cudnn"; "xla" runs the same rotations
    on any platform, for tests)."""
    mask_bt = jnp.asarray(mask_bt).astype(bool)
    t = mask_bt.shape[1]
    lengths = mask_bt.sum(-1, dtype=jnp.int32)
    start = jnp.where(lengths > 0, jnp.argmax(mask_bt, axis=-1), 0).astype(jnp.int32)
    last = t - 1 - jnp.argmax(mask_bt[:, ::-1], axis=-1)
    one_span = jnp.all((lengths == 0) | (last - start + 1 == lengths))
    spans = functools.partial(_spans_from_zero, start=start, lengths=jnp.maximum(lengths, 1),
                              implementation=implementation)
    holes = functools.partial(attention.attend_causal, mask_bt=mask_bt)
    return jax.lax.cond(one_span, spans, holes, q_btnh, k_bksh, v_bksh)


def _spans_from_zero(q_btnh, k_bksh, v_bksh, *, start, lengths, implementation):
    t = q_btnh.shape[1]
    order = (jnp.arange(t)[None, :] + start[:, None]) % t        # row b's position i reads position start_b + i
    rotate = lambda x, idx: jnp.take_along_axis(x, idx.reshape(*idx.shape, *[1] * (x.ndim - 2)), axis=1)  # noqa: E731
    q, k, v = rotate(q_btnh, order), rotate(k_bksh.swapaxes(1, 2), order), rotate(v_bksh.swapaxes(1, 2), order)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                       key_value_seq_lengths=lengths, implementation=implementation)
    back = (jnp.arange(t)[None, :] - start[:, None]) % t
    return rotate(out, back)
