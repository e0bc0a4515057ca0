"""Eq. 2 of R³ against a NumPy transcription, teacher-forced log-probs against a full forward, exact gradient
accumulation, and the optimizer's schedule and clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from r3jax.model import config, qwen2
from r3jax.rl import loss

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def numpy_policy_loss(logp, old, adv, mask, *, eps_low, eps_high, aggregation, ref=None, beta=0.0):
    """Eq. 2 of R³ written out in float64: returns (loss, clipfrac, kl)."""
    logp, old, adv, mask = np.float64(logp), np.float64(old), np.float64(adv), np.asarray(mask, bool)
    ratio = np.exp(logp - old)
    a = adv[:, None]
    unclipped, clipped = ratio * a, np.clip(ratio, 1 - eps_low, 1 + eps_high) * a
    per_token = -np.minimum(unclipped, clipped)
    kl = np.zeros_like(logp)
    if ref is not None:
        d = np.float64(ref) - logp
        kl = np.exp(d) - d - 1
    per_token = per_token + beta * kl
    if aggregation == "token-mean":
        value = per_token[mask].mean()
    else:
        value = np.mean([per_token[b][mask[b]].mean() for b in range(len(mask)) if mask[b].any()])
    return value, (clipped < unclipped)[mask].mean(), kl[mask].mean()


@pytest.fixture
def arrays():
    """B = 6 rows of S = 9 tokens; ratios well outside [0.8, 1.28]; row 4 has no tokens; garbage off the mask."""
    rng = np.random.RandomState(0)
    b, s = 6, 9
    old = rng.uniform(-4, -0.1, (b, s)).astype(np.float32)
    logp = (old + rng.normal(0, 0.4, (b, s))).astype(np.float32)
    ref = (old + rng.normal(0, 0.2, (b, s))).astype(np.float32)
    adv = np.array([1.3, -0.7, 0.4, -1.9, 2.0, 0.8], np.float32)
    mask = rng.rand(b, s) < 0.7
    mask[4] = False
    mask[5, 1:] = False
    logp[~mask] = 50.0  # exp(50 - old) overflows unless the loss ignores off-mask entries
    return logp, old, adv, mask, ref


def test_fixture_clips_on_both_sides(arrays):
    logp, old, adv, mask, _ = arrays
    ratio = np.exp(logp - old)
    assert (mask & (ratio > 1.28) & (adv[:, None] > 0)).any()  # upper clip active
    assert (mask & (ratio < 0.8) & (adv[:, None] < 0)).any()  # lower clip active


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_policy_loss_matches_numpy(arrays, aggregation, beta):
    logp, old, adv, mask, ref = arrays
    value, metrics = loss.policy_loss(logp, old, adv, mask, aggregation=aggregation, ref_logprobs=ref, beta=beta)
    expected, clipfrac, kl = numpy_policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28,
                                               aggregation=aggregation, ref=ref, beta=beta)
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["policy/clipfrac"], clipfrac, rtol=1e-6)
    np.testing.assert_allclose(metrics["policy/kl"], kl, rtol=1e-5)
    assert 0 < clipfrac < 1


def test_policy_metrics_match_numpy(arrays):
    logp, old, adv, mask, _ = arrays
    entropies = np.random.RandomState(1).uniform(0, 3, logp.shape).astype(np.float32)
    _, metrics = loss.policy_loss(logp, old, adv, mask, entropies=entropies)
    d = np.float64(logp - old)[mask]
    np.testing.assert_allclose(metrics["policy/ratio_mean"], np.exp(d).mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["policy/approx_kl"], (0.5 * d * d).mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["policy/entropy"], entropies[mask].mean(), rtol=1e-5)
    assert metrics["policy/kl"] == 0  # no reference given


@pytest.mark.parametrize("aggregation, expected", [("token-mean", -1 / 3), ("seq-mean-token-mean", 0.0)])
def test_on_policy_loss_is_minus_mean_advantage(aggregation, expected):
    """r = 1: loss = -agg(A). Row 0 has two tokens with A = 1, row 1 one token with A = -1, row 2 none."""
    mask = np.array([[0, 1, 1], [0, 0, 1], [0, 0, 0]], bool)
    logp = np.full((3, 3), -1.0, np.float32)
    value, metrics = loss.policy_loss(logp, logp, np.array([1.0, -1.0, 5.0], np.float32), mask,
                                      aggregation=aggregation)
    np.testing.assert_allclose(value, expected, atol=1e-7)
    assert metrics["policy/clipfrac"] == 0 and metrics["policy/ratio_mean"] == 1


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_all_equal_group_gives_zero_loss_and_gradient(arrays, aggregation):
    logp, old, _, mask, _ = arrays
    grad = jax.grad(lambda lp: loss.policy_loss(lp, old, np.zeros(6, np.float32), mask,
                                                aggregation=aggregation)[0])(logp)
    assert loss.policy_loss(logp, old, np.zeros(6, np.float32), mask, aggregation=aggregation)[0] == 0
    assert not np.any(grad)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gradient_zero_off_mask_and_nonzero_on_replayed_sample(arrays, aggregation, beta):
    """A replayed sample (row 0: old log-probs recomputed, so r = 1; A ≠ 0) is trained as on-policy."""
    logp, old, adv, mask, ref = arrays
    old = old.copy()
    old[0] = logp[0]
    grad = jax.grad(lambda lp: loss.policy_loss(lp, old, adv, mask, aggregation=aggregation,
                                                ref_logprobs=ref, beta=beta)[0])(logp)
    grad = np.asarray(grad)
    assert np.all(np.isfinite(grad))
    assert np.all(grad[~mask] == 0)
    assert np.all(grad[0][mask[0]] != 0)
    if beta == 0:  # d(-r·A)/d logp = -r·A at r = 1, over the normaliser
        n = mask.sum() if aggregation == "token-mean" else mask[0].sum() * (mask.any(1)).sum()
        np.testing.assert_allclose(grad[0][mask[0]], -adv[0] / n, rtol=1e-6)


@pytest.mark.parametrize("kwargs", [
    dict(aggregation="seq-mean"),
    dict(eps_low=1.0),
    dict(eps_low=-0.1),
    dict(eps_high=-0.01),
    dict(eps_high=float("nan")),
    dict(beta=-0.1, ref_logprobs=np.zeros((2, 3), np.float32)),
    dict(beta=0.04),  # no reference
])
def test_bad_arguments_raise(kwargs):
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError):
        loss.policy_loss(x, x, np.ones(2, np.float32), np.ones((2, 3), bool), **kwargs)


def test_bad_shapes_and_micro_batch_count_raise():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="advantages"):
        loss.policy_loss(x, x, np.ones(3, np.float32), np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="not divisible"):
        loss.split_micro_batches({"a": np.zeros((6, 2))}, 4)
    with pytest.raises(ValueError, match="leading batch axis"):
        loss.split_micro_batches({"a": np.zeros((6, 2)), "b": np.zeros(4)}, 2)


# --- log-probs through a tiny model --------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    """A 2-layer random Qwen2 (V 64, D 32) with weights scaled up so that logits spread over several nats."""
    graphdef, params = qwen2.split_params(qwen2.init_model(
        config.tiny(vocab_size=64, hidden_size=32, intermediate_size=64), seed=0))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x if "norm" in jax.tree_util.keystr(path) else 10 * x, params)
    return graphdef, params


def make_rows(prompt_lens, response_lens, prompt_width, response_width, seed=0):
    """[prompt (left-padded) | response (right-padded)] rows: (tokens, attention_mask, response_mask) [B, S]."""
    b = len(prompt_lens)
    tokens = np.random.RandomState(seed).randint(0, 64, (b, prompt_width + response_width)).astype(np.int32)
    attention = np.zeros(tokens.shape, bool)
    response = np.zeros(tokens.shape, bool)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        attention[i, prompt_width - p:prompt_width + r] = True
        response[i, prompt_width:prompt_width + r] = True
    return tokens, attention, response


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sequence_logprobs_match_full_forward(model, temperature):
    graphdef, params = model
    m = qwen2.merge_params(graphdef, params)
    tokens, attention, response = make_rows([5, 3, 1], [6, 4, 2], prompt_width=5, response_width=6)
    logp, ent = loss.sequence_logprobs(m, tokens, attention, response, temperature=temperature, chunk_size=4)
    logits = np.float64(m(tokens, attention)) / temperature  # [B, S, V]
    logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = np.zeros(tokens.shape)
    expected[:, 1:] = np.take_along_axis(logp_all[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    expected_ent = np.zeros(tokens.shape)
    expected_ent[:, 1:] = -(np.exp(logp_all) * logp_all).sum(-1)[:, :-1]
    np.testing.assert_allclose(logp, np.where(response, expected, 0), atol=1e-5)
    np.testing.assert_allclose(ent, np.where(response, expected_ent, 0), atol=1e-5)
    assert np.ptp(expected[response]) > 2  # the model is not near-uniform


@pytest.fixture(scope="module")
def rollout_batch(model):
    """Micro-batch 0 (rows 0-1) holds 13 response tokens, micro-batch 1 holds 2 in one row and an empty row."""
    graphdef, params = model
    tokens, attention, response = make_rows([4, 2, 3, 1], [7, 6, 2, 0], prompt_width=4, response_width=7)
    logp, _ = loss.sequence_logprobs(qwen2.merge_params(graphdef, params), tokens, attention, response)
    old = np.where(response, logp + np.random.RandomState(1).normal(0, 0.3, tokens.shape), 0)
    return dict(tokens=tokens, attention_mask=attention, response_mask=response,
                old_logprobs=old.astype(np.float32), advantages=np.array([0.9, -1.2, 1.5, 0.3], np.float32))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batch_grads_equal_full_batch_grads(model, rollout_batch, aggregation):
    graphdef, params = model
    batch = rollout_batch

    def loss_sums(p, mb):
        logp, ent = loss.sequence_logprobs(qwen2.merge_params(graphdef, p), mb["tokens"], mb["attention_mask"],
                                           mb["response_mask"], chunk_size=4)
        return loss.policy_loss_sums(logp, mb["old_logprobs"], mb["advantages"], mb["response_mask"],
                                     aggregation=aggregation, entropies=ent)

    def full_loss(p):
        (s, n), _ = loss_sums(p, batch)
        return s / n

    full_value, full_grads = jax.jit(jax.value_and_grad(full_loss))(params)
    value, grads, metrics = jax.jit(lambda p, b: loss.micro_batch_grads(loss_sums, p, b, 2))(params, batch)
    np.testing.assert_allclose(value, full_value, rtol=1e-6)
    for g, f in zip(jax.tree.leaves(grads), jax.tree.leaves(full_grads), strict=True):
        np.testing.assert_allclose(g, f, rtol=1e-6, atol=1e-6 * np.abs(f).max())
    assert set(metrics) == {"policy/clipfrac", "policy/kl", "policy/ratio_mean", "policy/approx_kl",
                            "policy/entropy", "policy/tokens"}
    _, full_metrics = jax.jit(loss_sums)(params, batch)  # token means over micro-batches of unequal sizes
    for key, value in full_metrics.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-5, err_msg=key)


def theta_loss(arrays, aggregation):
    """(batch, loss_sums) of a loss whose log-probs are logp + θ₀·x + θ₁·x² with θ the parameters."""
    logp, old, adv, mask, _ = arrays
    logp = np.where(mask, logp, old)
    x = np.random.RandomState(2).normal(0, 1, logp.shape).astype(np.float32)

    def loss_sums(theta, mb):
        return loss.policy_loss_sums(mb["logp"] + theta[0] * mb["x"] + theta[1] * mb["x"] ** 2, mb["old"],
                                     mb["adv"], mb["mask"], aggregation=aggregation)

    return dict(logp=logp, x=x, old=old, adv=adv, mask=mask), loss_sums


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batch_accumulation_is_not_a_mean_of_means(arrays, aggregation):
    """Log-probs logp + θ·x with θ the parameters: 3 micro-batches of 2 rows with 11, 5 and 1 tokens (row 4
    empty). Accumulation matches the full batch exactly; the mean of micro-batch losses would not."""
    batch, loss_sums = theta_loss(arrays, aggregation)

    def full_loss(theta, mb):
        (s, n), _ = loss_sums(theta, mb)
        return s / jnp.maximum(n, 1)

    theta = jnp.array([0.05, -0.02])
    value, grads, _ = loss.micro_batch_grads(loss_sums, theta, batch, 3)
    np.testing.assert_allclose(value, full_loss(theta, batch), rtol=1e-6)
    np.testing.assert_allclose(grads, jax.grad(full_loss)(theta, batch), rtol=1e-6)
    micro = [jax.tree.map(lambda a, i=i: a[2 * i:2 * i + 2], batch) for i in range(3)]
    assert abs(np.mean([full_loss(theta, mb) for mb in micro]) - value) > 1e-2


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_segments_of_different_widths_accumulate_like_one_batch(arrays, aggregation):
    """`segment_grads`: rows 0-1 in one micro-batch, rows 2-5 with 3 more (masked) columns in two: the loss,
    gradients and token-weighted metrics of all six rows together."""
    batch, loss_sums = theta_loss(arrays, aggregation)

    wider = {k: v[2:] if v.ndim == 1 else np.pad(v[2:], ((0, 0), (0, 3))) for k, v in batch.items()}
    theta = jnp.array([0.05, -0.02])
    value, grads, metrics = loss.segment_grads(theta, [(loss_sums, {k: v[:2] for k, v in batch.items()}, 1),
                                                       (loss_sums, wider, 2)])
    want, want_grads, want_metrics = loss.micro_batch_grads(loss_sums, theta, batch, 1)
    np.testing.assert_allclose(value, want, rtol=1e-6)
    np.testing.assert_allclose(grads, want_grads, rtol=1e-6)
    for key, v in want_metrics.items():
        np.testing.assert_allclose(metrics[key], v, rtol=1e-5, err_msg=key)


# --- optimizer -------------------------------------------------------------------------------------

def test_warmup_schedule_values():
    schedule = loss.learning_rate_schedule(1e-3, warmup_steps=10)
    np.testing.assert_allclose([schedule(t) for t in (0, 5, 10, 50)], [0, 5e-4, 1e-3, 1e-3], rtol=1e-6)
    cosine = loss.learning_rate_schedule(1e-3, warmup_steps=10, total_steps=30)
    np.testing.assert_allclose([cosine(t) for t in (0, 5, 10, 20, 30)], [0, 5e-4, 1e-3, 5e-4, 0],
                               rtol=1e-6, atol=1e-9)


def test_optimizer_steps_follow_the_schedule():
    """A constant gradient makes Adam's m̂ / √v̂ exactly 1, so each update is -lr(t)."""
    opt = loss.make_optimizer(1e-3, warmup_steps=4, weight_decay=0.0)
    params = {"w": jnp.zeros(3)}
    state = opt.init(params)
    steps = []
    for _ in range(6):
        update, state = opt.update({"w": jnp.full(3, 0.1)}, state, params)
        steps.append(float(update["w"][0]))
    np.testing.assert_allclose(steps, [0, -2.5e-4, -5e-4, -7.5e-4, -1e-3, -1e-3], rtol=1e-5, atol=1e-12)


def test_clipping_limits_the_update_norm():
    """With eps ≫ |g|, AdamW's first update is ≈ -lr·g/eps, so its norm is ≤ lr·max_grad_norm/eps after clipping."""
    grads = {"w": jnp.full(100, 10.0)}  # ‖g‖ = 100
    params = {"w": jnp.zeros(100)}
    kw = dict(warmup_steps=0, weight_decay=0.0, eps=1e3)

    def first_update_norm(max_grad_norm):
        opt = loss.make_optimizer(1.0, max_grad_norm=max_grad_norm, **kw)
        return float(optax.tree.norm(opt.update(grads, opt.init(params), params)[0]))

    assert float(loss.grad_norm(grads)) == pytest.approx(100.0)
    assert first_update_norm(1.0) <= 1.0 / 1e3
    assert first_update_norm(None) > 50 * first_update_norm(1.0)
