"""A jitted KV-cache generator: one prefill per prompt, then a `lax.while_loop` of decode steps.

Every generated token comes with its log-prob and the entropy of the distribution it was drawn
from (R3-SPEC.md §6) at no extra pass: both fall out of the logits the step samples from.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from r3jax import hosts
from r3jax.model import attention_plan, sharding
from r3jax.model import cache as kv_cache
from r3jax.model.qwen2 import Qwen2
from r3jax.sampling import distributions
from r3jax.sampling import parts as split
from r3jax.sampling import slots as seating
from r3jax.sampling.rollout import Rollout, mask_after_end, response_mask
from r3jax.sampling.slots import PromptCache, SamplingState, loop_widths, schedule, slot_widths  # noqa: F401


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static knobs, closed over by the compiled loop (hashable: one executable per distinct config).

    temperature 0 decodes greedily; top_k 0 and top_p 1 disable truncation; valid_vocab masks
    logits of ids >= it (the 1.5B model has 151936 rows for 151665 tokenizer ids). unroll_layers:
    decode from per-layer weight copies sliced once before the loop (`Qwen2.unstack_layers`), which
    is faster on a CPU; False scans the stacked layers, which compiles faster for deep models (`generate`'s
    default: on a CPU only, `attention_plan.CpuMechanisms`). share_prompts: a
    static batch's G samples read their prompt from one copy where they can (`slots.shares_prompts`),
    which is faster; the rollout equals the copied one up to float rounding (the prompt is its own block
    of the attention's online softmax), so a draw whose number lands within ~1e-6 of a token's CDF
    boundary can flip. Off by default, so that a key gives the same rollout whatever `slots` and `parts` up
    to the rounding of a batch of another size (log-probs 1 ulp apart at most seen; a draw would have to land
    within that of a CDF boundary to flip); the training loop and eval.py turn it on.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_ids: tuple[int, ...] = ()
    num_samples: int = 1
    valid_vocab: int | None = None
    pad_id: int = 0
    unroll_layers: bool = True
    share_prompts: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")


# Response slots in the head of each layer's cache in the decode loop (`cache.Cache`): the prompt and this many
# response tokens are read where they are at every step; later tokens in blocks, each sliced out (copied) first.
# Measured on the decode_step bench (filled 64, 32 rows): a step at a 4,096 budget took 2.38 ms with a head of
# 256 response slots, 1.71 ms with 128, against 1.68 ms for a 128 budget (its whole cache one head).
HEAD_RESPONSE_SLOTS = 128
# Only on CPUs: XLA:CPU copies a slice out of a buffer before a matmul reads it, and per-layer buffers avoid
# that. Elsewhere the cache stays stacked, the form docs/memory_plans.jsonl compiles for TPU (the per-layer
# form's TPU memory and speed are not measured with the run's program).


def generate(model_or_params, prompt_tokens, prompt_mask, key, *, max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, eos_ids=(), num_samples: int = 1, valid_vocab: int | None = None,
             pad_id: int | None = None, unroll_layers: bool | None = None, slots: int | None = None,
             share_prompts: bool = False, parts: int | None = None) -> Rollout:
    """Samples `num_samples` responses for each prompt of a padded [P, Tp] batch.

    model_or_params: a `Qwen2` or its `(graphdef, params)`. Prompts may be left- or right-padded and
    ragged; each is prefilled once and its cache shared by its G samples. Returns a `Rollout` of
    N = P * G rows, prompt-major. slots: how many rows decode at once (default all N); when a row ends,
    the next row that has not started takes its slot, so no slot idles while rows are waiting. The same
    key gives the same samples whatever the slot count (each row draws from its own random numbers);
    the loop stops as soon as every row has produced an end token or max_new_tokens. share_prompts: see
    `SamplingConfig` (a static batch's samples read their prompt from one copy). parts: how many programs the
    prompts are split over, each run from a thread of its own, with the rollout of one program (tokens alike,
    log-probs within float rounding). None: `parts.auto_parts` for a static batch (on a CPU, one device), 1 with
    `slots`; with both, each part decodes slots / parts rows at once.

    Log-probs and entropies describe softmax(logits / temperature) before top-k/top-p truncation
    (R3-SPEC §6); with temperature 0 (greedy) they describe the model's softmax(logits).
    """
    return decode(model_or_params, prompt_tokens, prompt_mask, key, max_new_tokens=max_new_tokens,
                  temperature=temperature, top_p=top_p, top_k=top_k, eos_ids=eos_ids, num_samples=num_samples,
                  valid_vocab=valid_vocab, pad_id=pad_id, unroll_layers=unroll_layers, slots=slots,
                  share_prompts=share_prompts, parts=parts)[0]


def decode(model_or_params, prompt_tokens, prompt_mask, key, *, max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, top_k: int = 0, eos_ids=(), num_samples: int = 1, valid_vocab: int | None = None,
           pad_id: int | None = None, unroll_layers: bool | None = None, slots: int | None = None,
           share_prompts: bool = False, parts: int | None = None) -> tuple[Rollout, dict]:
    """`generate`, plus what the decoding cost: {"steps": decode steps, "slot_steps": the sum over steps of the
    slots decoded} ([] int32 each). Slot utilisation = generated tokens / slot_steps."""
    if isinstance(model_or_params, Qwen2):
        graphdef, params = nnx.split(model_or_params)
    elif isinstance(model_or_params, tuple) and len(model_or_params) == 2:
        graphdef, params = model_or_params
    else:
        raise TypeError(f"generate needs a Qwen2 model or its (graphdef, params), got {type(model_or_params).__name__}")
    model = nnx.merge(graphdef, params)  # the mesh and config are static model metadata; merging copies nothing
    mesh = model.mesh
    if unroll_layers is None:  # on a CPU only (`attention_plan.CpuMechanisms`)
        unroll_layers = attention_plan.cpu_mechanisms(mesh).unroll_layers
    eos_ids = (eos_ids,) if isinstance(eos_ids, int) else tuple(int(e) for e in eos_ids)
    cfg = SamplingConfig(max_new_tokens=int(max_new_tokens), temperature=float(temperature), top_p=float(top_p),
                         top_k=int(top_k), eos_ids=eos_ids, num_samples=int(num_samples),
                         valid_vocab=valid_vocab, pad_id=_pad_id(pad_id, eos_ids), unroll_layers=bool(unroll_layers),
                         share_prompts=bool(share_prompts))
    prompt_tokens, prompt_mask = _check_prompts(prompt_tokens, prompt_mask)
    if slots is not None and not 1 <= int(slots):
        raise ValueError(f"slots must be >= 1, got {slots}")
    parts = (split.auto_parts(prompt_tokens, params, model.config) if slots is None else 1) if parts is None else \
        split.check_parts(parts, prompt_tokens, params, slots)
    if parts > 1:
        widths, groups = schedule(prompt_tokens.shape[0] // parts, cfg.num_samples,
                                  None if slots is None else int(slots) // parts, mesh)
        program = functools.partial(_generate, graphdef, cfg, widths, groups)
        return split.run_in_parts(program, params, prompt_tokens, prompt_mask, key, parts, cfg.num_samples, mesh)
    widths, groups = schedule(prompt_tokens.shape[0], cfg.num_samples, slots, mesh)
    if mesh is not None:
        batch = sharding.named(mesh, "act_bt", prompt_tokens.shape)
        prompt_tokens, prompt_mask = hosts.put_rows(prompt_tokens, batch), hosts.put_rows(prompt_mask, batch)
    return _generate(graphdef, cfg, widths, groups, params, prompt_tokens, prompt_mask, key)


def _pad_id(pad_id, eos_ids) -> int:
    """What fills a row after its end: pad_id if given, else the first end token, else 0."""
    if pad_id is not None:
        return int(pad_id)
    return eos_ids[0] if eos_ids else 0


def _check_prompts(tokens, mask):
    tokens, mask = jnp.asarray(tokens, jnp.int32), jnp.asarray(mask).astype(bool)
    if tokens.ndim != 2 or mask.shape != tokens.shape or 0 in tokens.shape:
        raise ValueError(f"prompt_tokens {tokens.shape} and prompt_mask {mask.shape} must be the same [P, Tp], "
                         "with at least one prompt and one column")
    if not isinstance(mask, jax.core.Tracer):
        empty = np.flatnonzero(~np.asarray(mask).any(-1))
        if empty.size:
            raise ValueError(f"prompt rows {empty.tolist()} have no real token (all-False prompt_mask)")
    return tokens, mask


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 8))
def _generate(graphdef, cfg: SamplingConfig, widths: tuple[int, ...], groups: int, params, prompt_tokens,
              prompt_mask, key, table_rows: int | None = None, first_row=0) -> tuple[Rollout, dict]:
    """table_rows: the rows of a batch split over several programs (`parts.run_in_parts`), of which these
    prompts' rows are rows [first_row, first_row + rows) (first_row traced: one program for every block); they
    draw that block of the batch's random numbers."""
    model = nnx.merge(graphdef, params)
    prompts = _prefill(model, prompt_tokens, prompt_mask)
    # one static batch (no slots): every row takes its slot once, before the loop, which then has no refill;
    # its G samples of a prompt then read the prompt from one copy (`slots.shares_prompts`)
    shared = cfg.share_prompts and seating.shares_prompts(prompt_tokens.shape[0], cfg.num_samples, widths,
                                                          model.mesh)
    state = _init_state(model, cfg, widths[0], groups, prompts, key, shared, table_rows, first_row)
    layers = model.unstack_layers() if cfg.unroll_layers else None  # loop invariants: sliced once
    refills = widths != (prompt_tokens.shape[0] * cfg.num_samples,)
    if not refills:
        state = seating.seat_all(cfg.num_samples, prompts, state, model.mesh, shared=shared)
    step_fn = functools.partial(_decode_step, model, cfg, layers, prompts, refills=refills)
    for narrower in (*widths[1:], 0):
        state = jax.lax.while_loop(functools.partial(seating.keep_width, narrower), step_fn, state)
        if narrower:
            state = seating.narrow(state, narrower)
    return _finish(state, cfg, model.mesh), {"steps": state.step, "slot_steps": state.slot_steps}


def _prefill(model: Qwen2, tokens_pt, mask_pt) -> PromptCache:
    """Runs every prompt once (`Qwen2.prefill`: causal self-attention on the plan's backend); its G samples copy
    its cache and last logits when they take a slot."""
    t = tokens_pt.shape[1]
    hidden, cache = model.prefill(tokens_pt, mask_pt)
    last = t - 1 - jnp.argmax(mask_pt[:, ::-1], axis=-1)  # last real token (left or right padding)
    logits = model.logits(jnp.take_along_axis(hidden, last[:, None, None], axis=1))[:, 0]
    return PromptCache(k=cache.k, v=cache.v, mask=cache.mask, logits=logits)


def _init_state(model: Qwen2, cfg: SamplingConfig, slots: int, groups: int, prompts: PromptCache, key,
                shared: bool = False, table_rows: int | None = None, first_row=0) -> SamplingState:
    """Every slot free and every row waiting: the first refill (before the loop for one static batch, else
    in the first step) hands out the first B rows. shared: the prompts will be the cache's shared prefix
    (`slots.seat_all`), and a slot's own cache holds only its response."""
    n, (p, tp) = cfg.max_new_tokens, prompts.mask.shape
    rows, own = p * cfg.num_samples, (0 if shared else tp)  # own: the prompt slots each slot holds itself
    # per layer when the loop runs the layers unrolled on a CPU: each layer reads its own buffers, no copy out of
    # a stack, and its head (the prompt and the first HEAD_RESPONSE_SLOTS response tokens) where it is
    per_layer = cfg.unroll_layers and attention_plan.cpu_mechanisms(model.mesh).head_tail_cache
    head = own + HEAD_RESPONSE_SLOTS if per_layer else 0
    cache = kv_cache.init_cache(model.config, slots, own + n, model.dtype, model.mesh, per_layer=head)
    cache = dataclasses.replace(cache, index=jnp.full((slots,), own + n, jnp.int32))
    per_row = lambda x: x if model.mesh is None else sharding.constrain(x, "act_bt", model.mesh)  # noqa: E731
    return SamplingState(
        step=jnp.zeros((), jnp.int32), slot_steps=jnp.zeros((), jnp.int32), next_row=jnp.zeros((groups,), jnp.int32),
        row=jnp.full((slots,), rows, jnp.int32), length=jnp.zeros((slots,), jnp.int32),
        free=jnp.ones((slots,), bool), logits=jnp.zeros((slots, prompts.logits.shape[-1]), jnp.float32),
        cache=cache, tokens=per_row(jnp.full((rows, n), cfg.pad_id, jnp.int32)),
        logprobs=per_row(jnp.zeros((rows, n), jnp.float32)), entropies=per_row(jnp.zeros((rows, n), jnp.float32)),
        lengths=jnp.zeros((rows,), jnp.int32), ended=jnp.zeros((rows,), bool),
        uniforms=per_row(_uniforms(key, rows, n, table_rows, first_row)))


def _uniforms(key, rows: int, n: int, table_rows: int | None, first_row):
    """[rows, n]: each row's numbers for its draws; with table_rows, rows [first_row, first_row + rows) of the
    table_rows' table, so that a row draws the same numbers whichever program it is sampled in."""
    if table_rows is None:
        return jax.random.uniform(key, (rows, n), jnp.float32)
    table = jax.random.uniform(key, (table_rows, n), jnp.float32)
    return jax.lax.dynamic_slice_in_dim(table, first_row, rows)


def _decode_step(model: Qwen2, cfg: SamplingConfig, layers, prompts: PromptCache, state: SamplingState, *,
                 refills: bool = True) -> SamplingState:
    """Refills free slots (when `refills`), draws each live slot's next token, records it, and runs it through
    the model."""
    rows, n, tp = state.tokens.shape[0], cfg.max_new_tokens, prompts.mask.shape[1]
    if refills:
        groups = state.next_row.shape[0]  # a group with a free slot and a row waiting
        refill = jnp.any(jnp.any(state.free.reshape(groups, -1), axis=1) & (state.next_row < rows // groups))
        state = jax.lax.cond(refill, functools.partial(seating.refill, cfg.num_samples, prompts), lambda s: s, state)
    live = ~state.free
    at = (jnp.where(live, state.row, rows), state.length)  # out of range for idle slots: their writes drop
    token, logprob, entropy = distributions.sample(
        None, state.logits, uniform=state.uniforms.at[at].get(mode="fill", fill_value=0.5),
        temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, valid_vocab=cfg.valid_vocab)
    token = jnp.where(live, token, cfg.pad_id)
    ended = jnp.isin(token, jnp.asarray(cfg.eos_ids, jnp.int32)) if cfg.eos_ids else jnp.zeros_like(live)
    length = state.length + live.astype(jnp.int32)
    # An idle slot's index is past the cache: it writes nothing and its attention reads nothing extra.
    own = 0 if state.cache.prefix is not None else tp  # the prompt slots in the slot's own cache
    cache = dataclasses.replace(state.cache, index=jnp.where(live, own + state.length, own + n))
    hidden, cache = model.hidden_states(token[:, None], live[:, None], cache=cache, layers=layers)
    return dataclasses.replace(
        state, step=state.step + 1, slot_steps=state.slot_steps + live.shape[0], length=length,
        free=state.free | ended | (length >= n),
        logits=model.logits(hidden)[:, 0], cache=cache,
        tokens=state.tokens.at[at].set(token, mode="drop"),
        logprobs=state.logprobs.at[at].set(logprob, mode="drop"),
        entropies=state.entropies.at[at].set(entropy, mode="drop"),
        lengths=state.lengths.at[at[0]].set(length, mode="drop"),
        ended=state.ended.at[at[0]].set(ended, mode="drop"))


def _finish(state: SamplingState, cfg: SamplingConfig, mesh) -> Rollout:
    """The per-row outputs, masked after each end and split over the devices by row (as the prompts were)."""
    mask = response_mask(state.lengths, cfg.max_new_tokens)
    rows = lambda x: x if mesh is None else sharding.constrain(x, "act_bt" if x.ndim == 2 else "act_b", mesh)  # noqa: E731
    return jax.tree.map(rows, Rollout(tokens=mask_after_end(state.tokens, mask, cfg.pad_id),
                                      logprobs=mask_after_end(state.logprobs, mask, 0.0),
                                      entropies=mask_after_end(state.entropies, mask, 0.0),
                                      mask=mask, lengths=state.lengths, truncated=~state.ended))
