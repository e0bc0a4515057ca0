"""Softmax attention written plainly, the formula the attention paths are checked against (autodiff gives its
gradients), and the check of a prefixed attention against each row's own copy of its prefix."""

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


def prefixed_inputs(q_count=3, g=2, t=5, p=7, n=4, kh=2, h=8, dtype=jnp.float32, seed=2):
    """Q prefixes (left-padded; the second with no real slot) read by Q groups of G rows with T own tokens
    each: the first row's last token is padding, and the second group's first row starts with one (a query with
    no real key to see). Returns q, prefix k and v, own k and v, the prefix mask [Q, P], the rows' [B, T] and a
    cotangent that is 0 at padded queries (whose output reaches nothing)."""
    rng = np.random.RandomState(seed)
    b = q_count * g
    q, kp, vp, ko, vo = (jnp.asarray(rng.randn(*shape), dtype) for shape in
                         ((b, t, n, h), (q_count, kh, p, h), (q_count, kh, p, h), (b, kh, t, h), (b, kh, t, h)))
    seen = np.ones((q_count, p), bool)
    seen[0, :3] = False
    seen[1] = False
    own = np.ones((b, t), bool)
    own[0, t - 1] = False
    own[g, 0] = False
    cotangent = jnp.asarray(rng.randn(b, t, n, h) * own[:, :, None, None], dtype)
    return q, kp, vp, ko, vo, jnp.asarray(seen), jnp.asarray(own), cotangent


def assert_prefixed_like_copies(fn, inputs, atol):
    """fn(q, prefix k, prefix v, k, v, prefix mask, mask) gives the formula's values and gradients at real
    positions over each row's own copy of its group's prefix under the joined causal mask, the prefix's gradient
    summed over its group."""
    q, kp, vp, ko, vo, seen, own, cotangent = inputs
    b, t, q_count = q.shape[0], q.shape[1], kp.shape[0]
    rows = np.repeat(np.arange(q_count), b // q_count)
    mask = jnp.concatenate([jnp.broadcast_to(seen[rows][:, None], (b, t, seen.shape[1])), cache.causal_mask(own)],
                           axis=2)

    def copies(q, kp, vp, ko, vo):
        return formula(q, *(jnp.concatenate([x[rows], o], axis=2) for x, o in ((kp, ko), (vp, vo))), mask)

    out, pull = jax.vjp(jax.jit(lambda *a: fn(*a, seen, own)), q, kp, vp, ko, vo)
    ref, ref_pull = jax.vjp(copies, q, kp, vp, ko, vo)
    assert np.isfinite(out).all(), "a padded query's output is not finite"
    real = own[:, :, None, None]
    np.testing.assert_allclose(jnp.where(real, out, 0.0), jnp.where(real, ref, 0.0), atol=atol)
    for name, a, b in zip(["q", "prefix k", "prefix v", "k", "v"], pull(cotangent), ref_pull(cotangent), strict=True):
        np.testing.assert_allclose(a, b, atol=atol, err_msg=f"d{name}")
