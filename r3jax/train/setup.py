"""Everything a run needs before its first compile, checked: config, tokenizer, data, model, mesh.

`prepare` reads and validates in an order that fails fast and names the culprit (a field, a file, a row):
settings first, then files, then shapes (P·G against the mesh, prompt + response against the model's
positions), and only then the model's weights. Every error here is a `SetupError` (exit code 2).
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from r3jax import compiles, hosts
from r3jax import model as rm
from r3jax.data import problems as data_problems
from r3jax.data import prompts
from r3jax.eval import benchmark
from r3jax.model import sharding, weights
from r3jax.rl import reflection, train_step
from r3jax.rl.algorithm import RLConfig
from r3jax.train import config as run_config
from r3jax.train import rollouts

_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


class SetupError(ValueError):
    """A run that cannot start; the message names the field, file or row."""


@dataclasses.dataclass
class Run:
    config: ml_collections.ConfigDict
    rl: RLConfig
    mesh: jax.sharding.Mesh
    tokenizer: object
    model_config: rm.ModelConfig
    graphdef: object
    state: train_step.TrainState
    tx: object
    bank: rollouts.QuestionBank
    settings: rollouts.RolloutSettings
    benchmarks: list
    eval_settings: benchmark.EvalSettings
    questions_per_step: int      # P, or P * oversample with DAPO's dynamic sampling
    skipped_rows: dict = dataclasses.field(default_factory=dict)  # field -> malformed rows left out (data.on_error)


def _exists(path, field: str, kind: str = "file or folder") -> None:
    if path is not None and not os.path.exists(path):
        raise SetupError(f"{field}: {kind} {path!r} does not exist")


def _model_folder(path: str) -> None:
    """A model folder holds config.json and weights (*.safetensors, or a shard index): say which are missing
    before the tokenizer is tried in it (an empty folder would otherwise read as a tokenizer problem)."""
    if not os.path.isdir(path):
        raise SetupError(f"model.path: {path!r} is a file, not a Hugging Face model folder")
    names = os.listdir(path)
    missing = [what for what, present in (("config.json", "config.json" in names),
                                          ("*.safetensors weights", any(n.endswith(".safetensors") for n in names)))
               if not present]
    if missing:
        raise SetupError(f"model.path: folder {path!r} has no {' and no '.join(missing)}"
                         + (" (it is empty)" if not names else "") + "; give a Hugging Face model folder")


def check_workdir(path: str) -> None:
    """The run's folder is a folder this user can write into, or can be made where it is named (nothing is
    created here); raises SetupError naming it."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise SetupError(f"--workdir {path!r} is a file, not a folder")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise SetupError(f"--workdir {path!r}: {existing!r} is a file, so the folder cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SetupError(f"--workdir {path!r}: this user cannot write into {existing!r}")


def _load_problems(path: str, field: str, limit: int | None, on_error: str):
    """The file's first `limit` problems and its malformed rows left out (only with data.on_error="skip": each
    stops the run otherwise, named by file and line)."""
    try:
        loaded = data_problems.load_problems(path, on_error=on_error)
    except (data_problems.DataError, OSError, ValueError) as e:
        raise SetupError(f"{field}: {e}") from e
    chosen = list(loaded)[:limit]
    if not chosen:
        raise SetupError(f"{field}: {path} has no usable problems ({loaded.report.summary()})")
    return chosen, loaded.report.skipped


def _mesh(c) -> jax.sharding.Mesh:
    try:
        return sharding.make_mesh(data=c.mesh.data, fsdp=c.mesh.fsdp, tensor=c.mesh.tensor)
    except ValueError as e:
        raise SetupError(f"mesh.data/fsdp/tensor: {e}") from e


def _check_batch_fits(c, mesh, groups: int, what: str) -> None:
    """The sampler's and the loss's rows (P·G) are split along the mesh's batch axes (data x fsdp)."""
    devices = sharding.batch_devices(mesh)
    rows = groups * c.samples_per_prompt
    if rows % devices:
        raise SetupError(f"prompts_per_step: {what} = {groups} groups x samples_per_prompt G = "
                         f"{c.samples_per_prompt} = {rows} rows must split evenly over the {devices} devices of the "
                         f"mesh's data x fsdp axes")


def model_config(c, tokenizer) -> rm.ModelConfig:
    """The policy's architecture: the folder's config.json, or a preset for a random start (its vocabulary
    the tokenizer's, rounded up to a multiple of 8)."""
    if c.model.path is not None:
        try:
            return rm.ModelConfig.from_json_file(os.path.join(weights.resolve_folder(c.model.path), "config.json"))
        except (rm.CheckpointError, rm.ConfigError, OSError, ValueError) as e:
            raise SetupError(f"model.path: {e}") from e
    presets = {"tiny": rm.tiny, "tiny_tied": rm.tiny_tied, "small_100m": rm.small_100m,
               "deepseek_r1_distill_qwen_1p5b": rm.deepseek_r1_distill_qwen_1p5b}
    if c.model.init not in presets:
        raise SetupError(f"model.init: unknown preset {c.model.init!r}; one of {sorted(presets)}")
    vocab = -(-len(tokenizer) // 8) * 8
    overrides = {"vocab_size": vocab, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
                 **c.model.init_overrides.to_dict()}
    try:
        return presets[c.model.init](**overrides)
    except (TypeError, ValueError) as e:
        raise SetupError(f"model.init_overrides: {e}") from e


def prepare(c: ml_collections.ConfigDict) -> Run:
    """Validates the config and loads everything; raises SetupError before any compilation."""
    try:
        run_config.check_values(c)
    except run_config.ConfigError as e:
        raise SetupError(str(e)) from e
    compiles.use_persistent_cache(c.compilation_cache)  # before anything compiles (JAX_COMPILATION_CACHE_DIR wins)
    compiles.start_counting()
    if c.model.path is not None and not _HUB_ID.fullmatch(c.model.path):
        _exists(c.model.path, "model.path", "model folder")  # else a hub id, fetched when the hub is reachable
        _model_folder(c.model.path)
    tokenizer_path = run_config.tokenizer_path(c)
    if tokenizer_path is None:
        raise SetupError("model.tokenizer: no tokenizer folder (set model.tokenizer, or model.init_tokenizer for a "
                         "random init)")
    _exists(tokenizer_path, "model.tokenizer", "tokenizer folder")
    if not _HUB_ID.fullmatch(c.data.train) or c.data.train.endswith((".json", ".jsonl", ".parquet")):
        _exists(c.data.train, "data.train", "problem file")  # else a hub id such as owner/name
    for name, path in c.data.eval.items():
        _exists(path, f"data.eval.{name}", "problem file")
    try:
        tokenizer = prompts.load_tokenizer(tokenizer_path)
    except prompts.TokenizerError as e:
        raise SetupError(f"model.tokenizer: {e}") from e
    try:
        rl = run_config.rl_config(c, valid_vocab=len(tokenizer))
    except run_config.ConfigError as e:
        raise SetupError(str(e)) from e
    train, skipped = _load_problems(c.data.train, "data.train", c.data.limit, c.data.on_error)
    skipped_rows = {"data.train": skipped} if skipped else {}
    questions = int(np.ceil(c.prompts_per_step * rl.oversample)) if rl.dynamic_sampling else c.prompts_per_step
    if questions > len(train):
        raise SetupError(f"prompts_per_step: {questions} questions per step but data.train has {len(train)} usable "
                         "problems (data.limit included)")
    bank = rollouts.build_bank(tokenizer, train)
    model_cfg = model_config(c, tokenizer)
    settings = _rollout_settings(c, rl, tokenizer, bank)
    longest = max(bank.longest_prompt, settings.reflection_width if settings.reflection_prompts else 0)
    if longest + c.max_new_tokens > model_cfg.max_position_embeddings:
        raise SetupError(f"max_new_tokens: the longest prompt ({longest} tokens) + max_new_tokens "
                         f"({c.max_new_tokens}) exceeds the model's max_position_embeddings "
                         f"({model_cfg.max_position_embeddings})")
    if model_cfg.vocab_size < len(tokenizer):
        raise SetupError(f"model: vocab_size {model_cfg.vocab_size} is smaller than the tokenizer's "
                         f"{len(tokenizer)} ids")
    mesh = _mesh(c)
    slots = settings.reflection_prompts
    _check_batch_fits(c, mesh, questions + slots, f"P = {questions} sampled questions + {slots} reflection slots")
    if rl.dynamic_sampling:
        _check_batch_fits(c, mesh, c.prompts_per_step, f"P = {c.prompts_per_step} groups kept by dynamic sampling")
    try:
        per_call = rollouts.chunk_prompts(questions + slots, c.samples_per_prompt, c.sampling_chunk)
    except ValueError as e:
        raise SetupError(f"sampling_chunk: {e}") from e
    if per_call < questions + slots:
        _check_batch_fits(c, mesh, per_call, f"sampling_chunk = {c.sampling_chunk} rows = {per_call} prompts")
    # a step with no reflection prompt samples the plain prompts alone when their rows split over the devices;
    # one with reflection prompts samples them in calls of their own when theirs split too
    plain_rows, reflection_rows = (min(n, per_call) * c.samples_per_prompt for n in (questions, slots))
    plain_alone = plain_rows % sharding.batch_devices(mesh) == 0
    settings = dataclasses.replace(settings, plain_alone=plain_alone, reflection_alone=plain_alone and slots > 0
                                   and reflection_rows % sharding.batch_devices(mesh) == 0)
    benchmarks = [_load_benchmark(name, path, tokenizer, c) for name, path in c.data.eval.items()]
    skipped_rows.update({f"data.eval.{b.name}": b.skipped for b in benchmarks if b.skipped})
    for field, issues in skipped_rows.items() if hosts.is_main() else ():
        print(benchmark.skipped_note(field, run_config.get(c, field), issues), flush=True)
    graphdef, params = rm.split_params(_load_model(c, model_cfg, mesh))
    tx = train_step.optimizer(rl)
    state = train_step.init_train_state(params, rl, tx, num_questions=len(train), seed=c.seed, mesh=mesh)
    eval_settings = benchmark.EvalSettings(
        max_new_tokens=c.eval.max_new_tokens or c.max_new_tokens, num_samples=c.eval.num_samples,
        temperature=0.0 if c.eval.greedy else c.eval.temperature, top_p=1.0 if c.eval.greedy else c.eval.top_p,
        batch_size=c.eval.batch_size, seed=c.eval.seed, slots=c.eval.slots)
    return Run(config=c, rl=rl, mesh=mesh, tokenizer=tokenizer, model_config=model_cfg, graphdef=graphdef,
               state=state, tx=tx, bank=bank, settings=settings, benchmarks=benchmarks, eval_settings=eval_settings,
               questions_per_step=questions, skipped_rows={k: len(v) for k, v in skipped_rows.items()})


def _rollout_settings(c, rl: RLConfig, tokenizer, bank) -> rollouts.RolloutSettings:
    template, width, slots = None, 0, 0
    if rl.uses_reflection and rl.r3.max_reflection_prompts:
        template = reflection.make_template(tokenizer, rl.r3.reflection_instruction)
        slots = rl.r3.max_reflection_prompts
        width = reflection.required_width(template, bank.question_tokens.shape[1], rl.r3.reflection_attempt_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return rollouts.RolloutSettings(
        num_samples=c.samples_per_prompt, max_new_tokens=rl.max_response_tokens, temperature=rl.temperature,
        top_p=c.top_p, eos_ids=(tokenizer.eos_token_id,), pad_id=pad_id, valid_vocab=rl.valid_vocab,
        reflection_prompts=slots, reflection_width=width, template=template, sampling_chunk=c.sampling_chunk,
        sampling_slots=c.sampling_slots)


def _load_benchmark(name, path, tokenizer, c):
    try:
        return benchmark.load_benchmark(name, path, tokenizer, limit=c.data.eval_limit, on_error=c.data.on_error)
    except (data_problems.DataError, OSError, ValueError) as e:
        raise SetupError(f"data.eval.{name}: {e}") from e


def _load_model(c, model_config, mesh):
    kw = dict(dtype=jnp.dtype(c.model.dtype), compute_dtype=c.model.compute_dtype, mesh=mesh, remat=c.model.remat,
              query_block=c.model.query_block, attention=c.model.attention)
    if c.model.path is not None:
        try:
            return rm.load_pretrained(c.model.path, **kw)[0]
        except (rm.CheckpointError, rm.ConfigError, OSError) as e:
            raise SetupError(f"model.path: {e}") from e
    dtype = kw.pop("dtype")
    return rm.init_model(model_config, seed=c.seed, param_dtype=dtype,
                         dtype=jnp.dtype(kw.pop("compute_dtype") or dtype), **kw)
