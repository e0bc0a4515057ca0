"""Every causal self-attention backend (`attention_plan.BACKENDS`) gives the formula's values and gradients under
`cache.causal_mask` (`attention_reference.causal`) at real positions: XLA's causal block skipping, Pallas
splash (run by Pallas' interpreter on this CPU; also its form for rows that continue a shared prefix) and the
cuDNN path's rotations (run with
`jax.nn.dot_product_attention`'s XLA implementation here)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import assert_prefixed_like_copies, causal, prefixed_inputs

from r3jax.model import attention, cudnn, splash


def rows(b=3, t=37, n=4, kh=2, h=16, seed=0):
    """q, k, v, the real-token mask (row 0 full, row 1 left-padded, row 2 left- and right-padded: a training row's
    [padding | prompt | response | padding]) and a cotangent that is 0 at padded positions."""
    rng = np.random.RandomState(seed)
    q, k, v = (jnp.asarray(rng.randn(*shape), jnp.float32) for shape in ((b, t, n, h), (b, kh, t, h), (b, kh, t, h)))
    mask = np.ones((b, t), bool)
    mask[1, :5] = False
    mask[2, :3], mask[2, t - 7:] = False, False
    cotangent = jnp.asarray(rng.randn(b, t, n, h), jnp.float32) * mask[:, :, None, None]
    return q, k, v, jnp.asarray(mask), cotangent


@functools.partial(jax.jit, static_argnums=0)
def value_and_grads(fn, q, k, v, mask, cotangent):
    out, pull = jax.vjp(lambda q, k, v: fn(q, k, v, mask), q, k, v)
    return out, pull(cotangent)


def assert_equal_at_real_positions(fn, inputs, atol=2e-5):
    q, k, v, mask, cotangent = inputs
    want, want_grads = value_and_grads(causal, *inputs)
    got, got_grads = value_and_grads(fn, *inputs)
    assert bool(jnp.isfinite(got).all()), "a padded query's output is not finite"
    real = np.asarray(mask)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=atol)
    for name, a, b in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=atol, err_msg=f"d{name}")


@pytest.mark.parametrize("block", [8, 64], ids=["blocks_of_8", "one_block"])
def test_causal_block_skipping_equals_dense_attention(block):
    assert_equal_at_real_positions(functools.partial(attention.attend_causal, query_block=block), rows())


def test_causal_blocks_read_only_keys_up_to_their_diagonal():
    spans = attention._causal_spans(37, 16)
    assert spans == [(0, 16), (16, 32), (32, 37)]
    read = sum((end - first) * end for first, end in spans)
    assert read < 37 * 37 * 0.75  # of the [T, T] scores, the blocks compute well under all


def test_splash_equals_dense_attention_in_the_pallas_interpreter():
    # 200 positions in blocks of 128: two query blocks, the second also reading the first's keys, the first
    # skipping the second's; T padded to 256 with padding as its own segment
    inputs = rows(t=200, n=4, kh=2, h=32)
    assert_equal_at_real_positions(functools.partial(splash.attend_causal, block=128, interpret=True), inputs)


@pytest.mark.parametrize("q_count, g, t, p", [(3, 2, 5, 7), (2, 2, 200, 130)], ids=["short", "blocks_of_128"])
def test_splash_reads_a_shared_prefix_like_per_row_copies_in_the_pallas_interpreter(q_count, g, t, p):
    # "blocks_of_128": the prefix padded to 256 slots and the rows to 256 positions, two query blocks each
    # reading both prefix blocks and its own keys up to its diagonal
    fn = functools.partial(splash.attend_prefixed, block=128, interpret=True)
    assert_prefixed_like_copies(fn, prefixed_inputs(q_count, g, t, p), atol=2e-5)


def test_a_splash_kernel_first_built_inside_one_program_serves_another():
    # the kernel (and its block tables) is cached per shape: made inside the first trace, it must hold no tracer
    # that a second program (the sampler's prefill after the train step, fp32 after bf16) would meet
    q, k, v, mask, _ = rows(t=16)
    first = jax.jit(lambda q, k, v: splash.attend_causal(q, k, v, mask, interpret=True))(q, k, v)
    cast = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    second = jax.jit(lambda q, k, v: 2 * splash.attend_causal(q, k, v, mask, interpret=True))(*cast)
    np.testing.assert_allclose(np.asarray(second, np.float32), 2 * np.asarray(first), atol=0.1)


def test_cudnn_rotations_equal_dense_attention():
    assert_equal_at_real_positions(functools.partial(cudnn.attend_causal, implementation="xla"), rows())


def test_cudnn_path_takes_xla_for_rows_with_holes():
    q, k, v, mask, cotangent = rows()
    holes = mask.at[0, 10:13].set(False)  # real tokens on both sides of a gap: not one span
    assert_equal_at_real_positions(functools.partial(cudnn.attend_causal, implementation="xla"),
                                   (q, k, v, holes, cotangent * holes[:, :, None, None]))


def test_a_row_without_real_tokens_stays_finite_on_every_backend():
    q, k, v, mask, _ = rows(t=16)
    empty = jnp.zeros_like(mask)
    for fn in (attention.attend_causal, functools.partial(cudnn.attend_causal, implementation="xla")):
        assert bool(jnp.isfinite(jax.jit(fn)(q, k, v, empty)).all())


def test_splash_refuses_rows_that_cannot_read_their_prefixes_in_equal_groups():
    q, kp, vp, ko, vo, seen, own, _ = prefixed_inputs(3, 2)
    with pytest.raises(ValueError, match="6 rows cannot read 4 prefixes"):
        splash.attend_prefixed(q, *(jnp.concatenate([x, x[:1]]) for x in (kp, vp)), ko, vo, seen, own,
                               interpret=True)
