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
from r3jax.model import cache as kv_cache
from r3jax.model import sharding
from r3jax.model.qwen2 import Qwen2
from r3jax.sampling import distributions
from r3jax.sampling.rollout import Rollout, mask_after_end, response_mask


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static knobs, closed over by the compiled loop (hashable: one executable per distinct config).

    temperature 0 decodes greedily; top_k 0 and top_p 1 disable truncation; valid_vocab masks
    logits of ids >= it (the 1.5B model has 151936 rows for 151665 tokenizer ids). unroll_layers:
    decode from per-layer weight copies sliced once before the loop (`Qwen2.unstack_layers`), which
    is faster; False scans the stacked layers, which compiles faster for deep models.
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingState:
    """The decode loop's carry. Token `step` is drawn from `logits`, the prediction after token step-1."""

    step: jax.Array       # [] int32
    tokens: jax.Array     # [B, T]
    logprobs: jax.Array   # [B, T]
    entropies: jax.Array  # [B, T]
    lengths: jax.Array    # [B] tokens generated so far, end token included
    done: jax.Array       # [B] an end token has been generated
    logits: jax.Array     # [B, V]
    cache: kv_cache.Cache
    uniforms: jax.Array   # [T, B] the random number each row's draw at each step inverts the CDF at


def generate(model_or_params, prompt_tokens, prompt_mask, key, *, max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, eos_ids=(), num_samples: int = 1, valid_vocab: int | None = None,
             pad_id: int | None = None, unroll_layers: bool = True) -> Rollout:
    """Samples `num_samples` responses for each prompt of a padded [P, Tp] batch.

    model_or_params: a `Qwen2` or its `(graphdef, params)`. Prompts may be left- or right-padded and
    ragged; each is prefilled once and its cache shared by its G samples. Returns a `Rollout` of
    B = P * G rows, prompt-major. The same key (and shapes) gives the same samples; the loop stops
    as soon as every row has produced an end token, or at max_new_tokens.

    Log-probs and entropies describe softmax(logits / temperature) before top-k/top-p truncation
    (R3-SPEC §6); with temperature 0 (greedy) they describe the model's softmax(logits).
    """
    eos_ids = (eos_ids,) if isinstance(eos_ids, int) else tuple(int(e) for e in eos_ids)
    cfg = SamplingConfig(max_new_tokens=int(max_new_tokens), temperature=float(temperature), top_p=float(top_p),
                         top_k=int(top_k), eos_ids=eos_ids, num_samples=int(num_samples),
                         valid_vocab=valid_vocab, pad_id=_pad_id(pad_id, eos_ids), unroll_layers=bool(unroll_layers))
    if isinstance(model_or_params, Qwen2):
        graphdef, params = nnx.split(model_or_params)
    elif isinstance(model_or_params, tuple) and len(model_or_params) == 2:
        graphdef, params = model_or_params
    else:
        raise TypeError(f"generate needs a Qwen2 model or its (graphdef, params), got {type(model_or_params).__name__}")
    prompt_tokens, prompt_mask = _check_prompts(prompt_tokens, prompt_mask)
    mesh = nnx.merge(graphdef, params).mesh  # the mesh is static model metadata; merging copies nothing
    if mesh is not None:
        batch = sharding.named(mesh, "act_bt", prompt_tokens.shape)
        prompt_tokens, prompt_mask = hosts.put_rows(prompt_tokens, batch), hosts.put_rows(prompt_mask, batch)
    return _generate(graphdef, cfg, params, prompt_tokens, prompt_mask, key)


def _pad_id(pad_id, eos_ids) -> int:
    """What fills a row after its end: pad_id if given, else the first end token, else 0."""
    if pad_id is not None:
        return int(pad_id)
    return eos_ids[0] if eos_ids else 0


def _check_prompts(tokens, mask):
    tokens, mask = jnp.asarray(tokens, jnp.int32), jnp.asarray(mask).astype(bool)
    if tokens.ndim != 2 or mask.shape != tokens.shape:
        raise ValueError(f"prompt_tokens {tokens.shape} and prompt_mask {mask.shape} must be the same [P, Tp]")
    if not isinstance(mask, jax.core.Tracer):
        empty = np.flatnonzero(~np.asarray(mask).any(-1))
        if empty.size:
            raise ValueError(f"prompt rows {empty.tolist()} have no real token (all-False prompt_mask)")
    return tokens, mask


@functools.partial(jax.jit, static_argnums=(0, 1))
def _generate(graphdef, cfg: SamplingConfig, params, prompt_tokens, prompt_mask, key) -> Rollout:
    model = nnx.merge(graphdef, params)
    state = _prefill(model, cfg, prompt_tokens, prompt_mask, key)

    def cond_fn(state: SamplingState):
        return ((state.step < cfg.max_new_tokens)  # room left in the budget
                & ~jnp.all(state.done))            # and some row has not ended yet

    layers = model.unstack_layers() if cfg.unroll_layers else None  # loop invariants: sliced once
    state = jax.lax.while_loop(cond_fn, functools.partial(_decode_step, model, cfg, layers), state)
    return _finish(state, cfg)


def _prefill(model: Qwen2, cfg: SamplingConfig, tokens_pt, mask_pt, key) -> SamplingState:
    """Runs every prompt once, then gives each of its G samples a copy of its cache and last logits."""
    p, t = tokens_pt.shape
    g, b = cfg.num_samples, tokens_pt.shape[0] * cfg.num_samples
    cache = kv_cache.init_cache(model.config, p, t + cfg.max_new_tokens, model.dtype, model.mesh)
    hidden, cache = model.hidden_states(tokens_pt, mask_pt, cache=cache)
    last = t - 1 - jnp.argmax(mask_pt[:, ::-1], axis=-1)  # last real token (left or right padding)
    logits = model.logits(jnp.take_along_axis(hidden, last[:, None, None], axis=1))[:, 0]
    share = lambda x: jnp.repeat(x, g, axis=0)  # noqa: E731
    cache = dataclasses.replace(cache, k=jnp.repeat(cache.k, g, axis=1), v=jnp.repeat(cache.v, g, axis=1),
                                mask=share(cache.mask))
    if model.mesh is not None:
        cache = dataclasses.replace(
            cache, k=sharding.constrain(cache.k, "cache_lbksh", model.mesh),
            v=sharding.constrain(cache.v, "cache_lbksh", model.mesh),
            mask=sharding.constrain(cache.mask, "cache_bs", model.mesh))
    n = cfg.max_new_tokens
    return SamplingState(step=jnp.zeros((), jnp.int32), tokens=jnp.full((b, n), cfg.pad_id, jnp.int32),
                         logprobs=jnp.zeros((b, n), jnp.float32), entropies=jnp.zeros((b, n), jnp.float32),
                         lengths=jnp.zeros((b,), jnp.int32), done=jnp.zeros((b,), bool), logits=share(logits),
                         cache=cache, uniforms=jax.random.uniform(key, (n, b), jnp.float32))


def _decode_step(model: Qwen2, cfg: SamplingConfig, layers, state: SamplingState) -> SamplingState:
    """Draws token `step` for every row, records it, and runs it through the model for the next logits."""
    token, logprob, entropy = distributions.sample(
        None, state.logits, uniform=state.uniforms[state.step], temperature=cfg.temperature, top_k=cfg.top_k,
        top_p=cfg.top_p, valid_vocab=cfg.valid_vocab)
    live = ~state.done  # rows still generating; an end token drawn now is part of the response
    token = jnp.where(live, token, cfg.pad_id)
    write = lambda buf, x: jax.lax.dynamic_update_slice(buf, x[:, None].astype(buf.dtype), (0, state.step))  # noqa: E731
    ended = jnp.isin(token, jnp.asarray(cfg.eos_ids, jnp.int32)) if cfg.eos_ids else jnp.zeros_like(live)
    hidden, cache = model.hidden_states(token[:, None], live[:, None], cache=state.cache, layers=layers)
    return SamplingState(
        step=state.step + 1,
        tokens=write(state.tokens, token),
        logprobs=write(state.logprobs, jnp.where(live, logprob, 0.0)),
        entropies=write(state.entropies, jnp.where(live, entropy, 0.0)),
        lengths=state.lengths + live.astype(jnp.int32),
        done=state.done | (live & ended),
        logits=model.logits(hidden)[:, 0],
        cache=cache,
        uniforms=state.uniforms,
    )


def _finish(state: SamplingState, cfg: SamplingConfig) -> Rollout:
    mask = response_mask(state.lengths, cfg.max_new_tokens)
    return Rollout(tokens=mask_after_end(state.tokens, mask, cfg.pad_id),
                   logprobs=mask_after_end(state.logprobs, mask, 0.0),
                   entropies=mask_after_end(state.entropies, mask, 0.0),
                   mask=mask, lengths=state.lengths, truncated=~state.done)
