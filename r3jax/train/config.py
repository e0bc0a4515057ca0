"""A training run's settings: one `ml_collections.ConfigDict`, checked before anything compiles.

Config files (`configs/*.py`) start from `base_config()` and set what their experiment needs; the command line
overrides any field (`--config.rl.learning_rate=1e-5`). Fields of `rl` and `rl.r3` are placeholders (None =
the algorithm's own default), so that `--config.algorithm=grpo` keeps GRPO's clip range unless one is given.

One source of truth: the sampler's temperature, budget and vocabulary mask and the loss's (`RLConfig.temperature`,
`max_response_tokens`, `valid_vocab`) are derived from the same top-level fields here; `rl` may not set them.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing

import ml_collections
from ml_collections import config_dict

from r3jax.model import attention_plan
from r3jax.model.attention import CAUSAL_BLOCK
from r3jax.model.qwen2 import REMAT_POLICIES
from r3jax.rl import algorithm

# RLConfig fields that come from top-level fields (one source of truth), not from `rl`.
DERIVED_RL_FIELDS = {"algorithm": "algorithm", "temperature": "temperature", "max_response_tokens": "max_new_tokens",
                     "valid_vocab": "(the tokenizer's size)"}
# Fields whose change makes a checkpoint unusable (array shapes or what the arrays mean).
SHAPE_FIELDS = ("algorithm", "model.path", "model.init", "model.init_overrides", "prompts_per_step",
                "samples_per_prompt", "max_new_tokens", "data.train", "data.limit", "rl.r3.slots_correct",
                "rl.r3.slots_wrong", "rl.r3.max_reflection_prompts", "rl.r3.reflection_attempt_tokens",
                "rl.oversample", "mesh.data", "mesh.fsdp", "mesh.tensor")


class ConfigError(ValueError):
    """A setting that cannot work; the message names the field."""


def _placeholders(cls) -> ml_collections.ConfigDict:
    hints = typing.get_type_hints(cls)
    out = ml_collections.ConfigDict()
    for f in dataclasses.fields(cls):
        if f.name in DERIVED_RL_FIELDS:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = _placeholders(hints[f.name])
            continue
        kind = next((t for t in (bool, int, float, str) if t == hints[f.name] or t in typing.get_args(hints[f.name])),
                    None)
        out[f.name] = config_dict.placeholder(kind)
    return out


def base_config() -> ml_collections.ConfigDict:
    """Every field a run reads, with defaults; config files change what their experiment needs."""
    c = ml_collections.ConfigDict()
    c.algorithm = "r3"
    c.rl = _placeholders(algorithm.RLConfig)
    c.model = ml_collections.ConfigDict(dict(
        path=config_dict.placeholder(str),        # a Hugging Face folder (config.json + safetensors)
        tokenizer=config_dict.placeholder(str),   # default: model.path's own (else init_tokenizer)
        init=config_dict.placeholder(str),        # no path: random init of a preset (`tiny`) ...
        init_overrides=ml_collections.ConfigDict(),  # ... with these ModelConfig fields changed ...
        init_tokenizer=config_dict.placeholder(str),  # ... and this tokenizer (used only without a path)
        dtype="float32", compute_dtype=config_dict.placeholder(str),
        # per layer: keep the projections' outputs, recompute attention and elementwise work in the backward
        # (the [B, N, T, T] scores are never stored: about a third of the temp memory, and on this CPU half
        # the train step, page faults included: BENCHMARKS.md); "none" stores everything, "full" only inputs
        remat="dots",
        # queries a causal attention takes at a time on the XLA backend (at most attention.CAUSAL_BLOCK): block i
        # reads keys up to its diagonal, and [T, S] scores and their gradients exist for one block at once
        query_block=CAUSAL_BLOCK,
        # causal self-attention's backend (r3jax.model.attention_plan): "auto" picks the platform's (TPU: Pallas
        # splash, GPU: cuDNN flash, CPU: XLA with causal block skipping); "xla" runs anywhere
        attention="auto"))
    c.data = ml_collections.ConfigDict(dict(
        train=config_dict.placeholder(str), split="train", limit=config_dict.placeholder(int),
        on_error="raise",  # a malformed row stops the run (file, line, reason); "skip": left out, counted
        eval=ml_collections.ConfigDict(), eval_limit=config_dict.placeholder(int)))
    c.prompts_per_step = 8
    c.samples_per_prompt = 4
    c.max_new_tokens = 256
    c.temperature = 1.0
    c.top_p = 1.0
    c.sampling_chunk = 0                          # rollout rows decoded at once (0: all P·G rows in one call)
    c.sampling_slots = 0                          # rows one call decodes at a time, a finished row's slot going
                                                  # to the next waiting row (0: every row of the call at once)
    c.micro_batch_rows = 0                        # loss rows per micro-batch (0: rl.num_micro_batches decides)
    c.steps = 10
    c.seed = 0
    c.checkpoint_every = 10
    c.eval_every = 0                              # 0: evaluate only at the end
    c.eval_at_start = False                       # also evaluate the initial policy (step 0): before -> after
    c.keep_checkpoints = 2
    c.eval = ml_collections.ConfigDict(dict(greedy=True, num_samples=1, temperature=0.6, top_p=0.95,
                                            max_new_tokens=config_dict.placeholder(int), batch_size=64, seed=0,
                                            slots=0))  # slots: as sampling_slots, for evaluation
    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
    c.grading = ml_collections.ConfigDict(dict(timeout_s=3.0, workers=config_dict.placeholder(int)))
    c.compilation_cache = "~/.cache/r3jax/xla"  # XLA's persistent cache: restarts skip compiling ("" = off)
    c.wandb = ml_collections.ConfigDict(dict(project=config_dict.placeholder(str),
                                             entity=config_dict.placeholder(str), name=config_dict.placeholder(str)))
    return c


def flat_keys(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Dotted names of every field, nested ones included (`rl.r3.replay`)."""
    keys = []
    for k, v in c.items():
        name = f"{prefix}{k}"
        keys.append(name)
        if isinstance(v, ml_collections.ConfigDict):
            keys.extend(flat_keys(v, name + "."))
    return keys


_OVERRIDE = re.compile(r"^--config\.([A-Za-z0-9_.]+)(?:=|$)")


def check_overrides(argv: list[str], c: ml_collections.ConfigDict) -> None:
    """Every `--config.a.b=value` on the command line names an existing field; the error lists close names."""
    known = flat_keys(c)
    for arg in argv:
        m = _OVERRIDE.match(arg)
        if m and m.group(1) not in known:
            close = difflib.get_close_matches(m.group(1), known, n=4, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else "; see `configs/` for the fields"
            raise ConfigError(f"unknown config field {m.group(1)!r}{hint}")


_OVERRIDE_VALUE = re.compile(r"^--config\.([A-Za-z0-9_.]+)=(.*)$", re.S)
_BOOLS = ("true", "false", "t", "f", "1", "0", "yes", "no")


def check_override_values(argv: list[str], c: ml_collections.ConfigDict) -> None:
    """Every `--config.a.b=value` parses as its field's type (int, float, bool), named in one line."""
    known = flat_keys(c)
    for arg in argv:
        m = _OVERRIDE_VALUE.match(arg)
        if not m or m.group(1) not in known:
            continue
        *parents, field = m.group(1).split(".")
        section = get(c, ".".join(parents)) if parents else c
        kind, text = section.get_type(field), m.group(2)
        if kind is bool:
            good = text.lower() in _BOOLS
        elif kind in (int, float):
            try:
                kind(text)
                good = text.lower() not in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity")
            except ValueError:
                good = text in ("None",) and section[field] is None
        else:
            continue
        if not good:
            what = {int: "an integer", float: "a finite number", bool: "true or false"}[kind]
            raise ConfigError(f"config field {m.group(1)} must be {what}, got {text!r}")


def get(c: ml_collections.ConfigDict, dotted: str):
    for part in dotted.split("."):
        c = c[part]
    return c


def _given(c: ml_collections.ConfigDict) -> dict:
    """The fields of a placeholder section that were set (None = the algorithm's default)."""
    out = {}
    for k, v in c.items():
        if isinstance(v, ml_collections.ConfigDict):
            sub = _given(v)
            if sub:
                out[k] = sub
        elif v is not None:
            out[k] = v
    return out


def rl_config(c: ml_collections.ConfigDict, valid_vocab: int | None) -> algorithm.RLConfig:
    """The RLConfig of a run: the algorithm's preset, the `rl` fields that were set, and the derived ones."""
    overrides = _given(c.rl)
    if "r3" in overrides:
        overrides["r3"] = dataclasses.asdict(algorithm.R3Config()) | overrides["r3"]
    try:
        rl = algorithm.algorithm_config(c.algorithm, **overrides, temperature=c.temperature,
                                        max_response_tokens=c.max_new_tokens, valid_vocab=valid_vocab)
    except (TypeError, ValueError) as e:
        raise ConfigError(_as_config_field(str(e))) from e
    return _micro_batches(c, rl)


def _as_config_field(message: str) -> str:
    """An RLConfig check's message with its field named as the run's config names it (`rl.x`, `rl.r3.x`, or the
    top-level field it is derived from)."""
    m = re.match(r"RL config field (\S+) (.*)", message, re.S)
    if not m:
        return message
    field = m.group(1)
    derived = DERIVED_RL_FIELDS.get(field)
    name = derived if derived and not derived.startswith("(") else f"rl.{field}"
    return f"config field {name} {m.group(2)}"


def loss_rows(c: ml_collections.ConfigDict, rl: algorithm.RLConfig) -> tuple[int, str]:
    """The train step's rows per update and how they arise: (P + reflection slots) x (G + replayed). The most a
    step uses (`rl.layout`: a step with fewer replayed responses runs on fewer rows, in as many micro-batches)."""
    slots = rl.r3.max_reflection_prompts if rl.uses_reflection else 0
    k = rl.r3.replay_k if rl.uses_replay else 0
    rows = (c.prompts_per_step + slots) * (c.samples_per_prompt + k)
    return rows, f"(P {c.prompts_per_step} + {slots} reflection slots) x (G {c.samples_per_prompt} + {k} replayed)"


def _micro_batches(c: ml_collections.ConfigDict, rl: algorithm.RLConfig) -> algorithm.RLConfig:
    """`micro_batch_rows` sets rl.num_micro_batches from the loss's row count (so that an algorithm or an
    ablation with another row count keeps the same memory per micro-batch); either way the rows must split."""
    rows, how = loss_rows(c, rl)
    if c.get("micro_batch_rows"):
        if c.rl.num_micro_batches is not None:
            raise ConfigError("config fields micro_batch_rows and rl.num_micro_batches are both set; set one")
        if rows % c.micro_batch_rows:
            raise ConfigError(f"config field micro_batch_rows = {c.micro_batch_rows} does not divide the loss's "
                              f"{how} = {rows} rows")
        return dataclasses.replace(rl, num_micro_batches=rows // c.micro_batch_rows)
    if rows % rl.num_micro_batches:
        raise ConfigError(f"config field rl.num_micro_batches = {rl.num_micro_batches} does not divide the loss's "
                          f"{how} = {rows} rows (or set micro_batch_rows, rows per micro-batch)")
    return rl


def tokenizer_path(c: ml_collections.ConfigDict) -> str | None:
    """model.tokenizer if set, else the model folder's own, else (random init) model.init_tokenizer."""
    return c.model.tokenizer or c.model.path or c.model.get("init_tokenizer")


def check_values(c: ml_collections.ConfigDict) -> None:
    """Settings that are wrong on their own (before any file is read): every field of `RANGES`, then every rl.*
    field against RLConfig's own checks."""
    for name, ok, what in RANGES:
        try:
            value = get(c, name)
        except (KeyError, AttributeError):
            continue  # a config without the field (an older file): the run's defaults apply
        try:
            good = not isinstance(value, bool) and ok(value)
        except TypeError:  # None or a string where a number belongs
            good = False
        if not good:
            raise ConfigError(f"config field {name} must be {what}, got {value!r}")
    if c.model.path is None and c.model.init is None:
        raise ConfigError("config field model.path is not set (a Hugging Face folder), nor model.init (a preset)")
    if c.data.train is None:
        raise ConfigError("config field data.train is not set (a problem file or a hub dataset id)")
    rl_config(c, valid_vocab=None)


_POSITIVE = (lambda v: isinstance(v, int) and v >= 1, "a positive integer")
_POSITIVE_OR_NONE = (lambda v: v is None or (isinstance(v, int) and v >= 1), "a positive integer or None")
_COUNT = (lambda v: isinstance(v, int) and v >= 0, ">= 0")
_MESH_AXIS = (lambda v: v == -1 or (isinstance(v, int) and v >= 1), "-1 (fill) or a positive integer")
# (field, test, what it must be) for every top-level, model, data, eval, grading and mesh field with a range
RANGES = (
    *((name, *_POSITIVE) for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "steps",
                                      "keep_checkpoints", "model.query_block", "eval.num_samples",
                                      "eval.batch_size")),
    *((name, *_COUNT) for name in ("checkpoint_every", "eval_every", "sampling_chunk", "sampling_slots",
                                   "eval.slots", "micro_batch_rows")),
    ("temperature", lambda v: v > 0, "> 0 for RL (log-probs of softmax(logits / T))"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("model.remat", lambda v: v in REMAT_POLICIES, f"one of {sorted(REMAT_POLICIES)}"),
    ("model.attention", lambda v: v in ("auto", *attention_plan.BACKENDS),
     f"'auto' or one of {list(attention_plan.BACKENDS)}"),
    ("data.limit", *_POSITIVE_OR_NONE),
    ("data.eval_limit", *_POSITIVE_OR_NONE),
    ("data.on_error", lambda v: v in ("raise", "skip"), "'raise' or 'skip'"),
    ("eval.temperature", lambda v: v >= 0, ">= 0 (0: greedy)"),
    ("eval.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("eval.max_new_tokens", lambda v: v is None or v >= 1, "a positive integer or None (the run's)"),
    ("grading.timeout_s", lambda v: v > 0, "> 0 seconds"),
    ("grading.workers", lambda v: v is None or v >= 1, "a positive integer or None (one per core)"),
    *((f"mesh.{axis}", *_MESH_AXIS) for axis in ("data", "fsdp", "tensor")),
)


def changed_shape_fields(saved: dict, c: ml_collections.ConfigDict) -> list[str]:
    """SHAPE_FIELDS whose value differs between a checkpoint's config (a plain dict) and this one."""
    now = c.to_dict()
    changed = []
    for name in SHAPE_FIELDS:
        a, b = saved, now
        for part in name.split("."):
            a = a.get(part) if isinstance(a, dict) else None
            b = b.get(part) if isinstance(b, dict) else None
        if a != b:
            changed.append(f"{name} (checkpoint: {a!r}, now: {b!r})")
    return changed
