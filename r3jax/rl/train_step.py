"""One R³ training step: a single pure function from (state, graded rollouts) to (state, metrics).

`train_step` reads like Algorithm 1 of R³ (R3-SPEC §7, step 4); helpers below do the work, each
testable alone. `make_train_step` jits it with in/out shardings and the state donated; the loss's `Layout`
(response columns and replay rows, bucketed by the host: `layout.py`) is static, one program per layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from r3jax.model import attention_plan, sharding
from r3jax.rewards import reward as r3_reward
from r3jax.rl import advantages, dapo, loss, masked, metrics, replay, serr
from r3jax.rl import batch as rl_batch
from r3jax.rl import layout as rl_layout
from r3jax.rl.algorithm import RLConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    params: dict                       # the policy's pure-dict params
    opt_state: optax.OptState
    buffer: replay.SampleBuffer | None  # R³ only (CCR and ISR read it)
    step: jax.Array                    # [] int32 optimizer updates so far
    key: jax.Array                     # randomness of step s = fold_in(key, s)
    ref_params: dict | None            # frozen initial params, only when beta > 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Groups:
    """Every group after R³: G on-policy responses then k replay slots (M = G + k; k = 0 without CCR), in the
    W response columns of the step's layout."""

    tokens: jax.Array   # [P, M, W]
    mask: jax.Array     # [P, M, W]
    rewards: jax.Array  # [P, M]
    valid: jax.Array    # [P, M]
    mixed: jax.Array    # [P] received replayed responses


def train_step(graphdef, cfg: RLConfig, tx: optax.GradientTransformation, state: TrainState,
               batch: rl_batch.RolloutBatch, layout: rl_layout.Layout | None = None, *, row_shards: int = 1):
    """One iteration of Algorithm 1 on graded rollouts, in the loss layout the host chose for them (W of the T
    response columns, R replay rows; None: the padded layout, T columns and k replay rows per group);
    row_shards: the devices a mesh splits the loss rows over (`shared_prompts`):

    1. rewards: the grader's R³ rewards (+ DAPO's overlong shaping when on)
    2. SERR: rank truncated failures of all-wrong groups by their entropy curves (§6)
    3. CCR: append stored opposite-correctness responses to all-wrong / all-correct groups (§4)
    4. advantages: Eq. 3 in mixed groups, Eq. 1 elsewhere
    5. loss (Eq. 2) and gradients over micro-batches, one optimizer update (skipped, params and
       optimizer state kept, when the loss or the gradient norm is not finite)
    6. write the step's on-policy responses and their counts into the buffer (Algorithm 1, line 11)
    """
    layout = layout or rl_layout.full(cfg, batch)
    _check_shapes(cfg, state, batch, layout)
    key = jax.random.fold_in(state.key, state.step)
    stored, batch = batch, rl_batch.narrow(batch, layout.width)  # the buffer keeps all T columns
    valid = batch.group_valid[:, None] & (batch.lengths > 0)                       # [P, G]
    rewards = shaped_rewards(cfg, batch)                                           # 1
    rewards, scored = ranking_rewards(cfg, batch, rewards, valid)                  # 2
    groups = replayed_groups(cfg, state.buffer, batch, rewards, valid, key, layout.replay_rows)  # 3
    adv = advantages.group_advantages(groups.rewards, groups.valid, groups.mixed,  # 4
                                      alpha=cfg.r3.alpha, lam=cfg.r3.lam, eps=cfg.adv_eps)
    seqs = loss_inputs(batch, groups, adv, layout)
    loss_value, grads, policy = loss.segment_grads(state.params, loss_segments(graphdef, cfg, state, batch, seqs,  # 5
                                                                               layout, row_shards))
    grad_norm = loss.grad_norm(grads)
    params, opt_state, skipped = finite_update(tx, state, grads, jnp.isfinite(loss_value) & jnp.isfinite(grad_norm))
    buffer = store_responses(cfg, state.buffer, stored, valid, state.step)         # 6

    zero_before = advantages.zero_advantage_groups(  # Eq. 1 on the rewards before SERR and CCR
        advantages.group_advantages(shaped_rewards(cfg, batch), valid, jnp.zeros_like(batch.group_valid)), valid,
        batch.group_valid)
    zero_after = advantages.zero_advantage_groups(adv, groups.valid, batch.group_valid)
    mismatch = policy.pop("_mismatch_per_token") / jnp.maximum(policy.pop("_on_policy_per_token"), 1e-30)
    out = {**metrics.rollout_metrics(batch, valid, scored, zero_before, zero_after,
                                     groups.valid[:, batch.tokens.shape[1]:].sum(axis=1)),
           **policy, "policy/loss": loss_value, "policy/grad_norm": grad_norm,
           "policy/logprob_mismatch": mismatch, "policy/skipped": skipped}
    return dataclasses.replace(state, params=params, opt_state=opt_state, buffer=buffer, step=state.step + 1), out


def finite_update(tx: optax.GradientTransformation, state: TrainState, grads, finite):
    """(params, opt_state, skipped): the optimizer's update, or the state's own params and optimizer
    state when `finite` is False (a NaN/inf loss or gradient must not poison Adam's moments)."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    return (jax.tree.map(keep, params, state.params), jax.tree.map(keep, opt_state, state.opt_state),
            1.0 - finite.astype(jnp.float32))


def _check_shapes(cfg: RLConfig, state: TrainState, batch, layout: rl_layout.Layout) -> None:
    """Shape errors at trace time, naming the numbers (not deep inside a reshape)."""
    p, g, t = batch.tokens.shape
    if state.buffer is not None and t != state.buffer.correct.tokens.shape[2]:
        raise ValueError(f"rollouts have T = {t} response tokens but the buffer stores "
                         f"{state.buffer.correct.tokens.shape[2]} (cfg.max_response_tokens): they must match")
    padded = rl_layout.full(cfg, batch)
    prompt_columns = batch.prompt_tokens.shape[1]
    if not (1 <= layout.width <= t and 0 <= layout.replay_rows <= padded.replay_rows
            and 1 <= (layout.prompt_width or prompt_columns) <= prompt_columns and 1 <= (layout.groups or p) <= p):
        raise ValueError(f"{layout} does not fit rollouts of P = {p} groups, T = {t} columns, {prompt_columns} "
                         f"prompt columns and {padded.replay_rows} replay slots")
    groups = layout.groups or p
    rows = groups * g + layout.replay_rows
    how = (f"P * (G + k) = {p} * ({g} + {layout.replay_rows // p})" if layout.replay_rows == padded.replay_rows
           and groups == p else f"groups * G + R = {groups} * {g} + {layout.replay_rows}")
    if rows % cfg.num_micro_batches:
        raise ValueError(f"the loss has {how} = {rows} rows, not divisible into "
                         f"num_micro_batches = {cfg.num_micro_batches}")
    if layout.narrow_groups and not (layout.narrow_groups <= groups and 1 <= layout.narrow_prompt_width
                                     <= (layout.prompt_width or prompt_columns)):
        raise ValueError(f"{layout}: its narrow segment ({layout.narrow_groups} groups at "
                         f"{layout.narrow_prompt_width} prompt columns) does not fit {groups} groups and "
                         f"{layout.prompt_width or prompt_columns} prompt columns")
    for seg in segments(cfg, batch, layout):
        if seg.rows % seg.micro_batches:
            raise ValueError(f"{layout}: the segment of {seg.rows} loss rows from row {seg.start} is not divisible "
                             f"into its {seg.micro_batches} micro-batches")


def shaped_rewards(cfg: RLConfig, batch):
    """The grader's rewards, plus DAPO's soft overlong penalty when `overlong_buffer` > 0."""
    penalty = dapo.overlong_penalty(batch.lengths, cfg.max_response_tokens, cfg.overlong_buffer)
    return batch.rewards + penalty if cfg.overlong_buffer else batch.rewards


def ranking_rewards(cfg: RLConfig, batch, rewards, valid):
    """SERR rewards replace the 0 of ranked failures (R3-SPEC §6). Returns (rewards, ranked [P, G]):
    the in-scope responses of groups with at least two of them (a lone one is in scope but gets 0)."""
    if not cfg.uses_ranking:
        return rewards, jnp.zeros_like(valid)
    serr_r, scored = serr.serr_rewards(batch.entropies, batch.mask, batch.correct, batch.truncated, valid,
                                       p=cfg.r3.serr_p, r_max=cfg.r3.serr_r_max, scope=cfg.r3.serr_scope)
    ranked = scored & (scored.sum(axis=1, keepdims=True) >= 2)
    return jnp.where(scored, serr_r, rewards), ranked


def replayed_groups(cfg: RLConfig, buffer, batch, rewards, valid, key, replay_rows: int | None = None) -> Groups:
    """CCR (R3-SPEC §4): k replay slots per group, filled for collapsed groups from the buffer. No slots when
    the layout has no replay rows: the host found nothing to replay (`layout.choose`), and the step then
    neither reads the buffer nor carries empty slots."""
    if not cfg.uses_replay or replay_rows == 0:
        return Groups(batch.tokens, batch.mask & valid[..., None], rewards, valid, jnp.zeros_like(batch.group_valid))
    rep = replay.cross_context_replay(buffer, batch.qids, batch.correct, valid, batch.group_valid, cfg.r3.replay_k,
                                      key)
    t = batch.tokens.shape[2]
    rep_tokens = jnp.pad(rep.tokens, ((0, 0), (0, 0), (0, max(0, t - rep.tokens.shape[2]))))[:, :, :t]
    rep_mask = (jnp.arange(t) < rep.lengths[..., None]) & rep.valid[..., None]
    rep_rewards = r3_reward.r3_reward(rep.correct, rep.lengths, cfg.max_length_reward, xp=jnp)
    if cfg.overlong_buffer:  # the same shaping as the on-policy rewards they are compared with
        rep_rewards = rep_rewards + dapo.overlong_penalty(rep.lengths, cfg.max_response_tokens, cfg.overlong_buffer)
    rep_rewards = jnp.where(rep.valid, rep_rewards, 0.0)
    return Groups(tokens=jnp.concatenate([batch.tokens, rep_tokens], axis=1),
                  mask=jnp.concatenate([batch.mask & valid[..., None], rep_mask], axis=1),
                  rewards=jnp.concatenate([rewards, rep_rewards], axis=1),
                  valid=jnp.concatenate([valid, rep.valid], axis=1), mixed=rep.appended > 0)


def loss_inputs(batch, groups: Groups, adv, layout: rl_layout.Layout) -> rl_batch.Sequences:
    """The loss's rows: [prompt | response] for the on-policy responses of the layout's first `groups` groups
    (all P by default), then `replay_rows` rows for the filled replay slots (`replay_picks`), with the
    sampler's log-probs on on-policy tokens; the prompts' last `prompt_width` columns. Prompts are
    left-aligned here too: a hand-built batch with right-padded prompts would put padding between prompt and
    response, and the loss would look fine while its gradients are wrong. π_ref's log-probs (β > 0) are
    zeros here: `segment_rows` computes them for each segment's rows."""
    prompt_tokens, prompt_mask = rl_batch.left_align(batch.prompt_tokens, batch.prompt_mask)
    if layout.prompt_width:
        prompt_tokens, prompt_mask = prompt_tokens[:, -layout.prompt_width:], prompt_mask[:, -layout.prompt_width:]
    p, g, _ = batch.tokens.shape
    m = groups.tokens.shape[1]
    pick = replay_picks(groups.valid[:, g:], layout.replay_rows)
    rows = functools.partial(_loss_rows, g=g, pick=pick, groups=layout.groups or p)
    per_slot = lambda x: jnp.broadcast_to(x[:, None], (p, m, *x.shape[1:]))  # noqa: E731  a group's prompt
    tokens, attention, response = rl_batch.to_sequences(rows(per_slot(prompt_tokens)), rows(per_slot(prompt_mask)),
                                                        rows(groups.tokens), rows(groups.mask))
    on_policy = response & (jnp.arange(tokens.shape[0]) < (layout.groups or p) * g)[:, None]
    sampler = rl_batch.response_positions(rows(jnp.pad(batch.logprobs, ((0, 0), (0, m - g), (0, 0)))),
                                          prompt_tokens.shape[1])
    return rl_batch.Sequences(tokens=tokens, attention=attention, response=response, on_policy=on_policy,
                              advantages=rows(adv), sampler_logprobs=jnp.where(on_policy, sampler, 0.0),
                              ref_logprobs=jnp.zeros(tokens.shape, jnp.float32),
                              prompt_ids=rows(per_slot(jnp.arange(p))))


def loss_segments(graphdef, cfg: RLConfig, state: TrainState, batch, seqs: rl_batch.Sequences,
                  layout: rl_layout.Layout, row_shards: int = 1) -> list:
    """(micro-batch loss, rows, micro-batches) for each of the loss's segments: what `loss.segment_grads` runs."""
    prompt_width = layout.prompt_width or batch.prompt_tokens.shape[1]
    return [(functools.partial(_micro_batch_loss, graphdef, cfg, shared_prompts(cfg, seg, row_shards)),
             segment_rows(graphdef, cfg, state, seqs, seg, prompt_width, row_shards), seg.micro_batches)
            for seg in segments(cfg, batch, layout)]


def segments(cfg: RLConfig, batch, layout: rl_layout.Layout) -> tuple[rl_layout.Segment, ...]:
    """The loss rows' segments (`layout.segments`): one, or the narrow-prompt rows apart from the rest."""
    p, g, _ = batch.tokens.shape
    return rl_layout.segments(layout, cfg.num_micro_batches, p, g, batch.prompt_tokens.shape[1])


def segment_rows(graphdef, cfg: RLConfig, state: TrainState, seqs: rl_batch.Sequences,
                 seg: rl_layout.Segment, prompt_width: int, row_shards: int = 1) -> rl_batch.Sequences:
    """The segment's rows of `loss_inputs` (whose rows have `prompt_width` prompt columns), with only its own
    last `seg.prompt_width` prompt columns (the rows' prompts fit: `layout.choose`), and π_ref's log-probs
    (β > 0 only: the one extra forward pass, which shares prompts as the policy's does)."""
    rows = slice(seg.start, seg.start + seg.rows)
    part = jax.tree.map(lambda x: x[rows, prompt_width - seg.prompt_width:] if x.ndim == 2 else x[rows], seqs)
    if cfg.beta > 0:
        ref = _no_grad_logprobs(graphdef, cfg, shared_prompts(cfg, seg, row_shards), seg.micro_batches,
                                state.ref_params, (part.tokens, part.attention, part.response, part.prompt_ids))
        part = dataclasses.replace(part, ref_logprobs=ref)
    return part


def replay_picks(replay_valid, replay_rows: int):
    """[R] indices into the P·k replay slots (flattened [P, k] `replay_valid`) that get a loss row: the filled
    ones first, in group order (R counts at least those: `layout.choose`), then spare empty ones."""
    return jnp.argsort(~replay_valid.reshape(-1), stable=True)[:replay_rows]


def _loss_rows(x_pm, *, g: int, pick, groups: int):
    """[P, M, ...] per slot -> [groups·G + R, ...] loss rows: the first `groups` groups' on-policy slots in group
    order (a reshape, which keeps the rows' sharding, when groups = P), then the picked replay slots."""
    p, m = x_pm.shape[:2]
    on_policy = x_pm[:groups, :g].reshape(groups * g, *x_pm.shape[2:])
    replayed = x_pm[:, g:].reshape(p * (m - g), *x_pm.shape[2:])[pick]
    return jnp.concatenate([on_policy, replayed])


def store_responses(cfg: RLConfig, buffer, batch, valid, step):
    """Every graded on-policy response (plain and reflection) goes into its question's rings."""
    if buffer is None:
        return None
    p, g, t = batch.tokens.shape
    flat = lambda x: x.reshape(p * g, *x.shape[2:])  # noqa: E731
    return replay.insert(buffer, jnp.repeat(batch.qids, g), flat(batch.tokens), flat(batch.lengths),
                         flat(batch.correct), flat(valid), step)


def shared_prompts(cfg: RLConfig, seg: rl_layout.Segment, row_shards: int = 1) -> tuple[int, int, int] | None:
    """(prompt columns, distinct prompts per micro-batch at most, rows per prompt when the micro-batches are
    whole groups in order, else 0: `Segment.group_rows`) when the segment's loss runs each micro-batch's prompts
    once (`loss.shared_prompt_logprobs`), None when every row runs its own (`rl.share_prompts` off, or no
    micro-batch would hold fewer prompts than rows). On a mesh that splits a micro-batch's rows over
    `row_shards` > 1 devices, only where each device's share is whole groups in order: every shard then runs its
    own groups' prompts, and no row, prompt or key crosses shards. Static: part of the layout's program."""
    if not (cfg.share_prompts and seg.shared_prompts):
        return None
    if row_shards > 1 and not rl_layout.reads_by_group(seg, row_shards):
        return None
    return seg.prompt_width, seg.shared_prompts, seg.group_rows


def _micro_batch_loss(graphdef, cfg: RLConfig, shared: tuple[int, int, int] | None, params,
                      seqs: rl_batch.Sequences):
    """Eq. 2 on one micro-batch. π_old is recomputed by the trainer before the update (R3-SPEC §2): with
    one update per batch that is this very forward pass, under stop_gradient (so every ratio is 1), and
    no second pass is needed. With old_logprobs="sampler", on-policy tokens take the sampler's instead
    (replayed ones always recompute). The same forward feeds the sampler/trainer mismatch meter. `shared`
    (`shared_prompts`): each distinct prompt of the micro-batch runs once, its rows attend to it."""
    model = nnx.merge(graphdef, params)
    logp, ent = _logprobs(cfg, shared, model, seqs.tokens, seqs.attention, seqs.response, seqs.prompt_ids)
    trainer = jax.lax.stop_gradient(logp)
    old = jnp.where(seqs.on_policy, seqs.sampler_logprobs, trainer) if cfg.old_logprobs == "sampler" else trainer
    (loss_sum, loss_count), policy = loss.policy_loss_sums(
        logp, old, seqs.advantages, seqs.response, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
        aggregation=cfg.aggregation, ref_logprobs=seqs.ref_logprobs if cfg.beta > 0 else None, beta=cfg.beta,
        entropies=ent)
    # per response token, so that the token-weighted combination over micro-batches stays exact
    tokens = jnp.maximum(policy["policy/tokens"], 1.0)
    policy["_mismatch_per_token"] = masked.masked_sum(jnp.abs(seqs.sampler_logprobs - trainer), seqs.on_policy) / tokens
    policy["_on_policy_per_token"] = masked.masked_count(seqs.on_policy) / tokens
    return (loss_sum, loss_count), policy


def _logprobs(cfg: RLConfig, shared, model, tokens, attention, response, prompt_ids):
    """(log-probs, entropies) of a micro-batch's rows, each distinct prompt run once when `shared` is set."""
    kw = dict(temperature=cfg.temperature, chunk_size=cfg.chunk_size, valid_vocab=cfg.valid_vocab)
    if shared is None:
        return loss.sequence_logprobs(model, tokens, attention, response, **kw)
    return loss.shared_prompt_logprobs(model, tokens, attention, response, prompt_ids, prompt_width=shared[0],
                                       num_prompts=shared[1], group_size=shared[2], **kw)


def _no_grad_logprobs(graphdef, cfg: RLConfig, shared, num_micro_batches: int, params, rows):
    """Teacher-forced log-probs of rows (tokens, attention, response, prompt ids), micro-batch by micro-batch,
    without gradients."""
    micro = loss.split_micro_batches(rows, num_micro_batches)

    def one(mb):
        model = nnx.merge(graphdef, jax.lax.stop_gradient(params))
        return _logprobs(cfg, shared, model, *mb)[0]

    out = jax.lax.map(one, micro)
    return out.reshape(-1, out.shape[-1])


# --- state and the jitted step -----------------------------------------------------------------------

def init_train_state(params, cfg: RLConfig, tx: optax.GradientTransformation, *, num_questions: int, seed: int = 0,
                     mesh=None) -> TrainState:
    """The step-0 state: optimizer state, an empty buffer (R³ only), a reference copy (β > 0 only).

    With a mesh, every array is placed by the sharding table (`state_shardings`), and the buffer gets
    num_questions rounded up to a multiple of the device count, so that it splits evenly along Q (the
    extra rows are never written)."""
    if cfg.algorithm == "r3" and mesh is not None:
        num_questions = -(-num_questions // mesh.devices.size) * mesh.devices.size

    def build(params):  # new buffers: the step donates its state, and the caller's model stays usable
        buffer = None
        if cfg.algorithm == "r3":
            buffer = replay.init_buffer(num_questions, cfg.max_response_tokens, slots_correct=cfg.r3.slots_correct,
                                        slots_wrong=cfg.r3.slots_wrong)
        return TrainState(params=jax.tree.map(jnp.copy, params), opt_state=tx.init(params), buffer=buffer,
                          step=jnp.zeros((), jnp.int32), key=jax.random.key(seed),
                          ref_params=jax.tree.map(jnp.copy, params) if cfg.beta > 0 else None)

    # built by one program straight into its shardings: every host makes only its own shards
    out = None if mesh is None else state_shardings(jax.eval_shape(build, params), tx, mesh)
    return jax.jit(build, out_shardings=out)(params)


def state_shardings(state: TrainState, tx: optax.GradientTransformation, mesh) -> TrainState:
    """Where each part of the state lives: params by the model's train sharding, optimizer moments like
    their params, the buffer along its question axis, the rest replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    params = sharding.param_shardings(state.params, mesh, "train")
    opt = optax.tree_map_params(tx, lambda _, s: s, state.opt_state, params,
                                transform_non_params=lambda _: replicated)
    return TrainState(params=params, opt_state=opt,
                      buffer=None if state.buffer is None else replay.buffer_shardings(state.buffer, mesh),
                      step=replicated, key=replicated, ref_params=None if state.ref_params is None else params)


def make_train_step(graphdef, cfg: RLConfig, tx: optax.GradientTransformation, state: TrainState,
                    batch: rl_batch.RolloutBatch, mesh=None):
    """`train_step` jitted: `step(state, batch[, layout])`, the state donated and coming back with its input
    shardings; each `layout` (static, hashable) compiles once. On a mesh that splits the loss rows over several
    devices, rows share prompts only where every device holds whole groups (`shared_prompts`): the by-id form
    gathers rows across shards, which libtpu 0.0.42.1 aborts compiling (a CHECK failure in its
    AllGatherDynamicSliceCancellation pass). Beside cuDNN attention rows do not share prompts at all
    (`attention_plan.shares_prompts`)."""
    if cfg.share_prompts and not attention_plan.shares_prompts(nnx.merge(graphdef, state.params).attention):
        cfg = dataclasses.replace(cfg, share_prompts=False)  # cuDNN keeps whole rows (`attention_plan`)
    row_shards = 1 if mesh is None else sharding.batch_devices(mesh)
    step = functools.partial(train_step, graphdef, cfg, tx, row_shards=row_shards)
    if mesh is None:
        return jax.jit(step, donate_argnums=0, static_argnums=2)
    shardings = state_shardings(state, tx, mesh)
    return jax.jit(step, in_shardings=(shardings, rl_batch.batch_shardings(batch, mesh)),
                   out_shardings=(shardings, None), donate_argnums=0, static_argnums=2)


def optimizer(cfg: RLConfig) -> optax.GradientTransformation:
    """AdamW with clipping and warmup from the config's fields (`loss.make_optimizer`)."""
    return loss.make_optimizer(cfg.learning_rate, warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps,
                               weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm)
