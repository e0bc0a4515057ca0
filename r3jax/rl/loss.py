"""The policy objective of R³ (Eq. 2), the teacher-forced log-probs it needs, gradient accumulation, the optimizer.

A training row is one [S] sequence, [prompt (left-padded) | response (right-padded)]: `attention_mask` marks
its real tokens, `response_mask` the response tokens whose log-probs enter the loss. Dimension letters: B
sequences, S prompt + response length, M micro-batches.

Gradient accumulation is exact because every loss here is a ratio `loss_sum / loss_count` whose denominator
(a token or sequence count) does not depend on the parameters: `policy_loss_sums` returns the two parts,
`micro_batch_grads` adds them up over micro-batches and divides once at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from r3jax.model import head
from r3jax.rl import batch as rl_batch
from r3jax.rl import masked

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


# --- log-probs -------------------------------------------------------------------------------------

def sequence_logprobs(model, tokens, attention_mask, response_mask, *, temperature: float = 1.0,
                      chunk_size: int = 512, valid_vocab: int | None = None):
    """Teacher-forced log-prob and entropy of every response token, (logprobs [B, S], entropies [B, S]) fp32.

    With z_s the logits after reading tokens[<= s] and π(· | tokens[< s]) = softmax(z_{s-1} / temperature)
    (the distribution the sampler draws from, before top-k/top-p):

        logprobs[b, s]  = log π(tokens[b, s] | tokens[b, < s])
        entropies[b, s] = -Σ_v π(v | tokens[b, < s]) log π(v | tokens[b, < s])

    where response_mask[b, s], else 0 (prompt, padding, and always position 0, which has no prefix).
    The head runs chunked (`head.token_logprobs_and_entropy`), so no [B, S, V] logits tensor is formed.
    """
    _check_temperature(temperature)
    tokens = jnp.asarray(tokens)
    hidden_bsd, _ = model.hidden_states(tokens, attention_mask)
    # The hidden state at s - 1 predicts the token at s.
    logp, ent = head.token_logprobs_and_entropy(hidden_bsd[:, :-1], tokens[:, 1:], model, chunk_size=chunk_size,
                                                temperature=temperature, valid_vocab=valid_vocab)
    keep = jnp.asarray(response_mask).astype(bool).at[:, 0].set(False)
    shift = lambda x: jnp.where(keep, jnp.pad(x, ((0, 0), (1, 0))), 0.0)
    return shift(logp), shift(ent)


def shared_prompt_logprobs(model, tokens, attention_mask, response_mask, prompt_ids, *, prompt_width: int,
                           num_prompts: int, temperature: float = 1.0, chunk_size: int = 512,
                           valid_vocab: int | None = None, group_size: int = 0):
    """`sequence_logprobs` of rows [prompt | response] that share prompts, each distinct prompt run once.

    The first `prompt_width` columns of every row are its prompt, and rows with the same prompt_ids [B] have
    the same prompt (a group's G responses, or a replayed response to the same question). At most
    `num_prompts` (static) distinct ids may occur. The prompts go through the model once each and the rows'
    remaining columns attend to their prompt's keys and values (`Qwen2.shared_prefix_hidden_states`): the
    same values as `sequence_logprobs` wherever response_mask is set, which must be in the last columns
    only, for a fraction of the work when prompts are long against the responses. Returns ([B, S], [B, S]).
    group_size (static, 0: any order): the rows are num_prompts groups of group_size consecutive rows, a
    group per prompt, in order (prompt_ids then only restate it: the caller guarantees it), and each group
    meets its prompt's keys in one product per head (`attention.attend_shared_prefix`).
    """
    _check_temperature(temperature)
    tokens, mask, ids = jnp.asarray(tokens), jnp.asarray(attention_mask).astype(bool), jnp.asarray(prompt_ids)
    b, s = tokens.shape
    if not 0 < prompt_width < s:
        raise ValueError(f"prompt_width must leave prompt and response columns in rows of {s}, got {prompt_width}")
    if group_size:  # reshapes and slices only: a mesh whose row shards hold whole groups moves no row
        if group_size * num_prompts != b:
            raise ValueError(f"group_size {group_size} x num_prompts {num_prompts} must be the {b} rows")
        slot = jnp.arange(b) // group_size
        first_rows = lambda x: x.reshape(num_prompts, group_size, s)[:, 0, :prompt_width]  # noqa: E731
        per_row = lambda x: jnp.repeat(x, group_size, axis=0)  # noqa: E731
    else:
        first = jnp.argmax(ids[:, None] == ids[None, :], axis=1)     # each row's first row with its prompt
        owner = first == jnp.arange(b)
        slot = (jnp.cumsum(owner) - 1)[first]                         # the prompt's row in the table
        (source,) = jnp.nonzero(owner, size=num_prompts, fill_value=0)
        first_rows = lambda x: x[source, :prompt_width]  # noqa: E731
        per_row = lambda x: x[slot]  # noqa: E731
    prompt_h, row_h = model.shared_prefix_hidden_states(first_rows(tokens), first_rows(mask), slot,
                                                        tokens[:, prompt_width:], mask[:, prompt_width:],
                                                        in_groups=bool(group_size))
    # the prompt's last position predicts the first response token; each response position the next one
    hidden = jnp.concatenate([per_row(prompt_h[:, -1:]), row_h[:, :-1]], axis=1)
    logp, ent = head.token_logprobs_and_entropy(hidden, tokens[:, prompt_width:], model, chunk_size=chunk_size,
                                                temperature=temperature, valid_vocab=valid_vocab)
    keep = jnp.asarray(response_mask).astype(bool)[:, prompt_width:]
    place = lambda x: rl_batch.response_positions(jnp.where(keep, x, 0.0), prompt_width)  # noqa: E731
    return place(logp), place(ent)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (log-probs of softmax(logits / temperature)), got {temperature}")


# --- Eq. 2 of R³ -------------------------------------------------------------------------------------

def clipped_surrogate(logprobs, old_logprobs, advantages, mask, *, eps_low: float, eps_high: float):
    """Per-token surrogate of Eq. 2 of R³ (PPO-clip with clip-higher), [B, S] each.

        r_t = exp(log π_θ(o_t) - log π_old(o_t))
        surrogate_t = min(r_t·A, clip(r_t, 1 - ε_low, 1 + ε_high)·A)

    A is the sequence's advantage ([B], broadcast over tokens; a [B, S] array is used as is). Returns
    (surrogate, ratio, clip_active) with clip_active where the clipped term is the strict minimum (the
    token then has no gradient). Off-mask entries are 0, 1 and False.
    """
    mask = jnp.asarray(mask).astype(bool)
    # The log-ratio is zeroed off the mask before exp: garbage there must neither overflow nor, through
    # the where's backward pass (0 * inf), poison the gradient.
    ratio = jnp.exp(jnp.where(mask, logprobs - old_logprobs, 0.0))
    adv = jnp.asarray(advantages)
    adv = adv[:, None] if adv.ndim == 1 else adv
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    return jnp.where(mask, jnp.minimum(unclipped, clipped), 0.0), ratio, mask & (clipped < unclipped)


def k3_kl(logprobs, ref_logprobs, mask):
    """Per-token k3 estimator of KL(π_θ || π_ref) (Schulman): exp(d) - d - 1 with d = log π_ref - log π_θ.

    Non-negative, unbiased under samples from π_θ; 0 off the mask."""
    d = jnp.where(jnp.asarray(mask).astype(bool), ref_logprobs - logprobs, 0.0)
    return jnp.exp(d) - d - 1.0


def aggregate_sums(x_bs, mask_bs, aggregation: str):
    """(numerator, denominator) of an aggregation agg(x) = numerator / max(denominator, 1).

        token-mean:           ( Σ_{b,s} m_bs x_bs ,                  Σ_{b,s} m_bs )
        seq-mean-token-mean:  ( Σ_{b: n_b>0} Σ_s m_bs x_bs / n_b ,   #{b : n_b > 0} ),  n_b = Σ_s m_bs

    The denominators depend on the mask only, so sums over micro-batches give the full-batch value."""
    if aggregation == "token-mean":
        return masked.masked_sum(x_bs, mask_bs), masked.masked_count(mask_bs)
    seq_means = masked.masked_mean(x_bs, mask_bs, axis=1)  # 0 for a row without tokens
    return jnp.sum(seq_means), jnp.sum(masked.masked_count(mask_bs, axis=1) > 0).astype(jnp.float32)


def policy_loss_sums(logprobs, old_logprobs, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.28,
                     aggregation: str = "token-mean", ref_logprobs=None, beta: float = 0.0, entropies=None):
    """The loss of Eq. 2 of R³ as ((loss_sum, loss_count), metrics); the loss is loss_sum / max(loss_count, 1).

        loss = agg_t( -min(r_t·A, clip(r_t, 1 - ε_low, 1 + ε_high)·A) + β·k3_t )
             = -agg(surrogate) + β·agg(k3)

    with agg and its (sum, count) split from `aggregate_sums`. This is the form `micro_batch_grads` needs.
    When beta == 0 the reference is not used in the loss (ref_logprobs may be None); when given anyway it
    is still reported as `policy/kl`. Metrics are token means over the mask, under stop_gradient.
    """
    _check_loss_args(logprobs, old_logprobs, advantages, mask, aggregation, eps_low, eps_high, beta, ref_logprobs)
    mask = jnp.asarray(mask).astype(bool)
    surrogate, ratio, clip_active = clipped_surrogate(logprobs, old_logprobs, advantages, mask,
                                                      eps_low=eps_low, eps_high=eps_high)
    kl = None if ref_logprobs is None else k3_kl(logprobs, ref_logprobs, mask)
    per_token = -surrogate if beta == 0 else beta * kl - surrogate
    metrics = _policy_metrics(logprobs, old_logprobs, ratio, clip_active, kl, mask, entropies)
    return aggregate_sums(per_token, mask, aggregation), metrics


def policy_loss(logprobs, old_logprobs, advantages, mask, *, eps_low: float = 0.2, eps_high: float = 0.28,
                aggregation: str = "token-mean", ref_logprobs=None, beta: float = 0.0, entropies=None):
    """Eq. 2 of R³ for one batch: (loss scalar, metrics). See `policy_loss_sums` for the math.

    logprobs, old_logprobs, mask, ref_logprobs, entropies: [B, S]; advantages: [B] (or [B, S]).
    Metrics: policy/clipfrac (share of tokens whose clip is active), policy/kl (mean k3, 0 without a
    reference), policy/ratio_mean, policy/approx_kl (mean ½(log π_θ - log π_old)²), policy/entropy
    (when entropies are given)."""
    (loss_sum, loss_count), metrics = policy_loss_sums(
        logprobs, old_logprobs, advantages, mask, eps_low=eps_low, eps_high=eps_high, aggregation=aggregation,
        ref_logprobs=ref_logprobs, beta=beta, entropies=entropies)
    return loss_sum / jnp.maximum(loss_count, 1.0), metrics


def _policy_metrics(logprobs, old_logprobs, ratio, clip_active, kl, mask, entropies):
    mean = lambda x: masked.masked_mean(x, mask)
    log_ratio = jnp.where(mask, logprobs - old_logprobs, 0.0)
    metrics = {
        "policy/clipfrac": mean(clip_active.astype(jnp.float32)),
        "policy/kl": jnp.zeros((), jnp.float32) if kl is None else mean(kl),
        "policy/ratio_mean": mean(ratio),
        "policy/approx_kl": mean(0.5 * log_ratio * log_ratio),
        "policy/tokens": masked.masked_count(mask),  # also the weight of these means across micro-batches
    }
    if entropies is not None:
        metrics["policy/entropy"] = mean(entropies)
    return jax.tree.map(jax.lax.stop_gradient, metrics)


def _check_loss_args(logprobs, old_logprobs, advantages, mask, aggregation, eps_low, eps_high, beta, ref_logprobs):
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1) so that the lower clip 1 - eps_low is positive, got {eps_low}")
    if not eps_high >= 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    if not beta >= 0.0:
        raise ValueError(f"beta (the KL coefficient) must be >= 0, got {beta}")
    if beta > 0 and ref_logprobs is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logprobs (log-probs under the frozen reference policy); "
                         "use beta=0 to train without a KL penalty")
    shape = jnp.shape(logprobs)
    if len(shape) != 2 or jnp.shape(old_logprobs) != shape or jnp.shape(mask) != shape:
        raise ValueError(f"logprobs, old_logprobs and mask must share one [B, S] shape, got {shape}, "
                         f"{jnp.shape(old_logprobs)}, {jnp.shape(mask)}")
    if jnp.shape(advantages) not in (shape[:1], shape):
        raise ValueError(f"advantages must be [B] or [B, S] for logprobs {shape}, got {jnp.shape(advantages)}")


# --- gradient accumulation -----------------------------------------------------------------------------

def split_micro_batches(batch, num_micro_batches: int):
    """Reshapes every array of `batch` from [B, ...] to [M, B / M, ...] (row i goes to micro-batch i // (B/M))."""
    leaves = jax.tree.leaves(batch)
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"every array in the batch needs the same leading batch axis, got sizes {sizes}")
    (size,) = sizes
    if num_micro_batches < 1 or size % num_micro_batches:
        raise ValueError(f"batch size {size} is not divisible into {num_micro_batches} micro-batches")
    m = num_micro_batches
    return jax.tree.map(lambda x: jnp.reshape(x, (m, size // m, *jnp.shape(x)[1:])), batch)


def micro_batch_grads(loss_fn, params, batch, num_micro_batches: int):
    """Full-batch loss and gradient accumulated over M micro-batches with one `lax.scan`.

    loss_fn(params, micro_batch) -> ((loss_sum, loss_count), metrics), the loss being loss_sum / loss_count
    with loss_count independent of params (as `policy_loss_sums` returns). Then, exactly,

        loss = Σ_m loss_sum_m / Σ_m loss_count_m,     ∇loss = Σ_m ∇loss_sum_m / Σ_m loss_count_m

    which the mean of per-micro-batch means is not when micro-batches hold different numbers of tokens
    (token-mean) or of non-empty sequences (seq-mean-token-mean). Gradients accumulate in fp32 and are
    returned in each parameter's dtype.
    Returns (loss, grads, metrics); token-mean metrics are weighted by each micro-batch's `policy/tokens`.
    """
    return segment_grads(params, [(loss_fn, batch, num_micro_batches)])


def segment_grads(params, segments):
    """`micro_batch_grads` over segments of rows of different shapes (prompt widths, say): `segments` is a
    sequence of (loss_fn, batch, num_micro_batches), each scanned over its own micro-batches. The loss sums,
    counts and gradients add up over all micro-batches of all segments before the one division, so the result
    is the loss and gradient of all rows together, exactly as for one segment. Returns (loss, grads, metrics)."""
    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    carry = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    per_micro_batch = []
    for loss_fn, batch, num_micro_batches in segments:
        sum_and_grad = jax.value_and_grad(lambda p, mb, f=loss_fn: _sum_with_aux(f(p, mb)), has_aux=True)

        def body(carry, micro_batch, sum_and_grad=sum_and_grad):
            grads_acc, sum_acc, count_acc = carry
            (loss_sum, (loss_count, metrics)), grads = sum_and_grad(params, micro_batch)
            grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
            return (grads_acc, sum_acc + loss_sum, count_acc + loss_count), metrics

        carry, metrics = jax.lax.scan(body, carry, split_micro_batches(batch, num_micro_batches))
        per_micro_batch.append(metrics)
    grads, loss_sum, loss_count = carry
    denominator = jnp.maximum(loss_count, 1.0)
    grads = jax.tree.map(lambda g, p: (g / denominator).astype(jnp.result_type(p)), grads, params)
    metrics = jax.tree.map(lambda *m: jnp.concatenate(m), *per_micro_batch)
    return loss_sum / denominator, grads, _combine_metrics(metrics)


def _combine_metrics(metrics):
    """Per-micro-batch metrics [M] -> one value each: token means weighted by `policy/tokens` (so a
    micro-batch without tokens counts for nothing), plain means for any metric without that weight."""
    weights = metrics.get("policy/tokens")
    if weights is None:
        return jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
    total = jnp.sum(weights)
    out = {k: jnp.sum(v * weights) / jnp.maximum(total, 1.0) for k, v in metrics.items() if k != "policy/tokens"}
    return {**out, "policy/tokens": total}


def _sum_with_aux(out):
    (loss_sum, loss_count), metrics = out
    return loss_sum.astype(jnp.float32), (jax.lax.stop_gradient(jnp.asarray(loss_count, jnp.float32)), metrics)


# --- optimizer -------------------------------------------------------------------------------------

def learning_rate_schedule(learning_rate: float, *, warmup_steps: int, total_steps: int | None = None):
    """lr(t) = learning_rate · t / warmup_steps for t < warmup_steps, then constant, or, when total_steps is
    given, learning_rate · ½(1 + cos(π (t - warmup) / (total_steps - warmup))) down to 0 at total_steps.

    t counts optimizer updates from 0, so the first update has lr 0 (as optax's and Hugging Face's warmups;
    Adam's moments still take in that step's gradient)."""
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps is not None:
        if total_steps <= warmup_steps:
            raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})")
        return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps, total_steps, end_value=0.0)
    if warmup_steps == 0:
        return optax.constant_schedule(learning_rate)
    return optax.linear_schedule(0.0, learning_rate, warmup_steps)  # holds learning_rate after warmup


def make_optimizer(learning_rate: float, *, warmup_steps: int, total_steps: int | None = None,
                   weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   max_grad_norm: float | None = 1.0) -> optax.GradientTransformation:
    """clip_by_global_norm(max_grad_norm) then AdamW under `learning_rate_schedule`.

    Clipping: g ← g · min(1, max_grad_norm / ‖g‖₂) over all parameters together. max_grad_norm=None skips
    it (the chain keeps its shape, so optimizer states stay interchangeable). Weight decay (default 0:
    it would move params even on a step whose advantages are all 0) applies to every parameter. Log
    `grad_norm(grads)` (before clipping) next to the update."""
    schedule = learning_rate_schedule(learning_rate, warmup_steps=warmup_steps, total_steps=total_steps)
    clip = optax.identity() if max_grad_norm is None else optax.clip_by_global_norm(max_grad_norm)
    return optax.chain(clip, optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))


def grad_norm(grads) -> jax.Array:
    """‖g‖₂ over all leaves (`optax.tree.norm`, formerly `optax.global_norm`): what clipping compares with."""
    return optax.tree.norm(grads)
