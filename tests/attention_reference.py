"""Softmax attention written plainly, the formula the attention paths are checked against (autodiff gives its
gradients)."""

import jax
import jax.numpy as jnp
import numpy as np

from r3jax.model import attention, cache


def formula(q_btnh, k_bksh, v_bksh, mask_bts):
    """Grouped-query softmax attention over [B, K, S, H] keys and values, mask_bts [B, T, S] (a query with no
    visible key: the uniform softmax, as `attention._MASKED` gives)."""
    n, kh = q_btnh.shape[2], k_bksh.shape[1]
    k = jnp.repeat(k_bksh, n // kh, axis=1)  # query head j reads KV head j // (N / K)
    v = jnp.repeat(v_bksh, n // kh, axis=1)
    scores = jnp.einsum("btnh,bnsh->bnts", q_btnh, k) / np.sqrt(q_btnh.shape[-1])
    scores = jnp.where(mask_bts[:, None], scores, attention._MASKED)
    return jnp.einsum("bnts,bnsh->btnh", jax.nn.softmax(scores, axis=-1), v)


def causal(q_btnh, k_bksh, v_bksh, mask_bt):
    """`formula` under `cache.causal_mask(mask_bt)`: query t sees the real keys up to t."""
    return formula(q_btnh, k_bksh, v_bksh, cache.causal_mask(mask_bt))
