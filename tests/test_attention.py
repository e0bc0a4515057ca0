"""The XLA attention paths' hand-written gradients equal differentiating the softmax-attention formula
(`attention_reference`): causal blocks in bf16, a shared prefix read in causal blocks, and what "dots" remat keeps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import assert_prefixed_like_copies, causal, prefixed_inputs

from r3jax.model import attention


def causal_inputs(dtype, b=3, t=9, n=4, kh=2, h=8, seed=1):
    """Rows [padding | real | padding] and a cotangent that is 0 at padded positions."""
    rng = np.random.RandomState(seed)
    q, k, v = (jnp.asarray(rng.randn(*shape), dtype) for shape in ((b, t, n, h), (b, kh, t, h), (b, kh, t, h)))
    mask = np.ones((b, t), bool)
    mask[1, :3], mask[2, 7:] = False, False
    return q, k, v, jnp.asarray(mask), jnp.asarray(rng.randn(b, t, n, h) * mask[:, :, None, None], dtype)


def vjp(fn, q, k, v, mask, cotangent):
    out, pull = jax.vjp(lambda q, k, v: fn(q, k, v, mask), q, k, v)
    return out, pull(cotangent)


def test_causal_gradients_keep_the_inputs_dtype():
    """bf16 in, bf16 gradients out, close to the fp32 formula's (in causal blocks of 2 queries)."""
    q, k, v, mask, cotangent = causal_inputs(jnp.bfloat16)
    _, grads = jax.jit(vjp, static_argnums=0)(lambda *a: attention.attend_causal(*a, query_block=2), q, k, v, mask,
                                              cotangent)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, ref_grads = vjp(causal, *f32, mask, cotangent.astype(jnp.float32))
    for name, g, ref in zip("qkv", grads, ref_grads, strict=True):
        assert g.dtype == jnp.bfloat16, name
        np.testing.assert_allclose(np.asarray(g, np.float32), ref, atol=0.05, rtol=0.05, err_msg=f"d{name}")


@pytest.mark.parametrize("q_count, g, t, query_block", [(3, 2, 5, None), (2, 4, 5, None), (4, 1, 5, None),
                                                        (3, 2, 5, 2), (2, 2, 11, 4)],
                         ids=["3x2", "2x4", "one_row_each", "blocks_of_2", "long_rows_blocks_of_4"])
def test_a_shared_prefix_attends_like_per_row_copies(q_count, g, t, query_block):
    """`attend_shared_prefix` (each group's queries meet its prefix once, in causal blocks of queries) gives
    the formula's values and gradients at real positions over each row's own copy of its prefix under the
    joined causal mask, the prefix's gradient summed over its group."""
    assert_prefixed_like_copies(lambda *a: attention.attend_shared_prefix(*a, query_block),
                                prefixed_inputs(q_count, g, t), atol=2e-6)


def test_a_shared_prefix_needs_equal_groups():
    q, kp, vp, ko, vo, seen, own, _ = prefixed_inputs(3, 2)
    with pytest.raises(ValueError, match="6 rows cannot read 4 prefixes"):
        attention.attend_shared_prefix(q, *(jnp.concatenate([x, x[:1]]) for x in (kp, vp)), ko, vo, seen, own)


def _score_products(jaxpr, shape) -> int:
    """dot_general equations with output `shape`, in this jaxpr and every jaxpr nested in it (scan bodies,
    remat and custom-VJP rules)."""
    from jax.extend import core

    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and tuple(eqn.outvars[0].aval.shape) == shape:
            count += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub
                if isinstance(inner, core.Jaxpr):
                    count += _score_products(inner, shape)
    return count


def test_dots_remat_keeps_the_attention_output_so_its_forward_is_not_run_again():
    """The attention scores' products in a gradient's program: under "dots" as many as with nothing
    rematerialised (the forward's, and the attention backward's own recompute), under "full" one more (the
    backward runs the layer's forward again first). "dots" keeps the attention's output and statistics."""
    from flax import nnx

    from r3jax.model import qwen2
    from r3jax.rl import loss

    cfg = qwen2.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    tokens, mask = jnp.zeros((2, 6), jnp.int32), jnp.ones((2, 6), bool)

    def products(remat):
        graphdef, params = nnx.split(qwen2.init_model(cfg, remat=remat))
        objective = lambda p: jnp.sum(loss.sequence_logprobs(nnx.merge(graphdef, p), tokens, mask, mask)[0])  # noqa: E731
        return _score_products(jax.make_jaxpr(jax.grad(objective))(params).jaxpr, (2, 2, 2, 6, 6))  # [B, K, R, T, S]

    counts = {remat: products(remat) for remat in ("none", "dots", "full")}
    assert counts["dots"] == counts["none"] == counts["full"] - 1, counts
