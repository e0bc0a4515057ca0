"""Hugging Face weights in and out: safetensors folders <-> r3jax params, placed straight into their shards.

The whole mapping is one table of (HF tensor name, r3jax param path, layout). r3jax keeps HF's
[out, in] order, so the only layouts are:
  copy        same array                          (embeddings, norms, lm_head [V, D], MLP)
  split_out   HF [X*H, D] <-> r3jax [X, H, D]      (q/k/v projections; biases [X*H] <-> [X, H])
  split_in    HF [D, N*H] <-> r3jax [D, N, H]      (o_proj)
Names with `{}` are per layer; r3jax stacks them along a leading L axis.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from r3jax.model import qwen2, sharding
from r3jax.model.config import ModelConfig

WEIGHT_MAP = (
    ("model.embed_tokens.weight", ("embed_tokens",), "copy"),
    ("model.norm.weight", ("norm", "scale"), "copy"),
    ("lm_head.weight", ("lm_head",), "copy"),
    ("model.layers.{}.input_layernorm.weight", ("layers", "input_layernorm", "scale"), "copy"),
    ("model.layers.{}.post_attention_layernorm.weight", ("layers", "post_attention_layernorm", "scale"), "copy"),
    ("model.layers.{}.self_attn.q_proj.weight", ("layers", "self_attn", "q_proj"), "split_out"),
    ("model.layers.{}.self_attn.q_proj.bias", ("layers", "self_attn", "q_bias"), "split_out"),
    ("model.layers.{}.self_attn.k_proj.weight", ("layers", "self_attn", "k_proj"), "split_out"),
    ("model.layers.{}.self_attn.k_proj.bias", ("layers", "self_attn", "k_bias"), "split_out"),
    ("model.layers.{}.self_attn.v_proj.weight", ("layers", "self_attn", "v_proj"), "split_out"),
    ("model.layers.{}.self_attn.v_proj.bias", ("layers", "self_attn", "v_bias"), "split_out"),
    ("model.layers.{}.self_attn.o_proj.weight", ("layers", "self_attn", "o_proj"), "split_in"),
    ("model.layers.{}.mlp.gate_proj.weight", ("layers", "mlp", "gate_proj"), "copy"),
    ("model.layers.{}.mlp.up_proj.weight", ("layers", "mlp", "up_proj"), "copy"),
    ("model.layers.{}.mlp.down_proj.weight", ("layers", "mlp", "down_proj"), "copy"),
)

# Non-parameter buffers that old checkpoints carry and that r3jax recomputes.
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CheckpointError(ValueError):
    """A checkpoint folder whose tensors do not match its config (missing, extra, wrong shape/dtype)."""


def _hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if kind == "split_out":  # [X, H, D] -> [X*H, D]; a bias [X, H] -> [X*H]
        return (shape[0] * shape[1],) + tuple(shape[2:])
    if kind == "split_in":  # [D, N, H] -> [D, N*H]
        return (shape[0], shape[1] * shape[2])
    return tuple(shape)


def _to_hf(kind: str, w: np.ndarray) -> np.ndarray:
    return w.reshape(_hf_shape(kind, w.shape))


def _expected_tensors(config: ModelConfig, abstract: dict) -> dict[str, tuple[tuple[str, ...], int | None, str, tuple]]:
    """HF name -> (param path, layer index or None, layout, HF shape), for this config."""
    expected = {}
    for name, path, kind in WEIGHT_MAP:
        if path == ("lm_head",) and config.tie_word_embeddings:
            continue
        leaf = abstract
        for key in path:
            leaf = leaf[key]
        if "{}" in name:
            for layer in range(config.num_hidden_layers):
                expected[name.format(layer)] = (path, layer, kind, _hf_shape(kind, leaf.shape[1:]))
        else:
            expected[name] = (path, None, kind, _hf_shape(kind, leaf.shape))
    return expected


# --- locating files ------------------------------------------------------------------------------

def resolve_folder(path: str | os.PathLike, revision: str | None = None) -> str:
    """A local model folder; a hub id ("org/name") is downloaded when the Hub is reachable."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise NotADirectoryError(f"{path} is a file; a model folder (config.json + safetensors) is needed")
    if not _HUB_ID.match(path):
        raise FileNotFoundError(f"no such model folder: {path}")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(path, revision=revision,
                                 allow_patterns=["config.json", "*.safetensors", INDEX_FILE])
    except Exception as e:  # offline, unknown repo, gated repo: all end here with the cause attached
        raise OSError(f"{path!r} is not a local folder, and downloading it from the Hugging Face Hub failed "
                      f"({type(e).__name__}: {e}). Offline? Copy the model folder here and pass its path.") from e


def _tensor_files(folder: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path, from the index file or the single file's header."""
    index_path = os.path.join(folder, INDEX_FILE)
    single_path = os.path.join(folder, SINGLE_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a safetensors index ({type(e).__name__}: {e})") from None
        files = {name: os.path.join(folder, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.exists(file):
                raise FileNotFoundError(f"missing file: {file} (listed in {index_path})")
        return files
    if not os.path.exists(single_path):
        raise FileNotFoundError(f"missing file: {single_path} (and no {INDEX_FILE}) in {folder}")
    with _open(single_path) as f:
        return {name: single_path for name in f.keys()}


@contextlib.contextmanager
def _open(file: str):
    try:
        handle = safe_open(file, framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: cannot read safetensors ({e})") from None
    with handle as f:
        yield f


# --- loading -------------------------------------------------------------------------------------

def load_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, compute_dtype=None, mesh=None,
                    sharding_mode: str = "train", remat: str = "none", revision: str | None = None,
                    query_block: int | None = None, attention: str = "auto"):
    """Loads a Hugging Face Qwen2 folder (or hub id) into an r3jax model. Returns (model, config).

    dtype: parameter dtype; compute_dtype: activation dtype (default: dtype). With a mesh, every
    parameter is assembled directly into its shards (`sharding.param_shardings`, `sharding_mode`
    'train' or 'sample'): each device receives only its slice, and host memory peaks at one
    parameter stack. Everything is validated against the config (names, shapes, dtypes) before a
    single weight is read, and any error leaves nothing half-loaded behind.
    """
    folder = resolve_folder(path, revision)
    config = ModelConfig.from_json_file(os.path.join(folder, "config.json"))
    dtype = jnp.dtype(dtype)
    model_kw = dict(param_dtype=dtype, dtype=jnp.dtype(compute_dtype or dtype), remat=remat, mesh=mesh,
                    query_block=query_block, attention=attention)
    graphdef, abstract = qwen2.split_params(qwen2.abstract_model(config, **model_kw))
    expected = _expected_tensors(config, abstract)
    files = _tensor_files(folder)
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(_open(file)) for file in sorted(set(files.values()))}
        _validate(config, expected, files, handles, folder)
    by_path: dict[tuple[str, ...], dict[int | None, str]] = {}
    for name, (p, layer, _, _) in expected.items():
        by_path.setdefault(p, {})[layer] = name
    shardings = None if mesh is None else sharding.param_shardings(abstract, mesh, sharding_mode)

    def build(keypath, leaf):
        p = tuple(k.key for k in keypath)
        names = by_path[p]

        def read(name, shape):
            # One open per tensor: the file's mapping (and its resident pages) ends with the read.
            with _open(files[name]) as f:
                return f.get_tensor(name).reshape(shape).astype(dtype, copy=False)

        if p[0] == "layers":
            host = np.stack([read(names[i], leaf.shape[1:]) for i in range(config.num_hidden_layers)])
        else:
            host = read(names[None], leaf.shape)
        if shardings is None:
            return jax.device_put(host)
        return jax.make_array_from_callback(host.shape, _get(shardings, p), lambda index: host[index])

    params = jax.tree_util.tree_map_with_path(build, abstract)
    return qwen2.merge_params(graphdef, params), config


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _validate(config, expected, files, handles, folder):
    present = {name for name in files if not IGNORED.fullmatch(name)}
    missing = sorted(set(expected) - present)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{folder}: missing tensor(s) {', '.join(missing[:5])}{more}")
    extra = sorted(present - set(expected))
    if extra == ["lm_head.weight"] and config.tie_word_embeddings:
        head = handles[files["lm_head.weight"]].get_tensor("lm_head.weight")
        emb = handles[files["model.embed_tokens.weight"]].get_tensor("model.embed_tokens.weight")
        if head.shape == emb.shape and np.array_equal(head, emb):
            extra = []  # a tied checkpoint that also stored its (identical) head
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise CheckpointError(f"{folder}: unexpected tensor(s) {', '.join(extra[:5])}{more} for a "
                              f"{config.num_hidden_layers}-layer qwen2 with tie_word_embeddings="
                              f"{config.tie_word_embeddings}")
    for name, (_, _, _, shape) in expected.items():
        tensor = handles[files[name]].get_slice(name)
        got = tuple(tensor.get_shape())
        if got != tuple(shape):
            raise CheckpointError(f"{files[name]}: tensor {name} has shape {list(got)}, config.json implies "
                                  f"{list(shape)}")
        if tensor.get_dtype() not in ("F32", "F16", "BF16", "F64"):
            raise CheckpointError(f"{files[name]}: tensor {name} has dtype {tensor.get_dtype()}, expected a "
                                  "floating-point type")


# --- saving --------------------------------------------------------------------------------------

def _host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def save_pretrained(model: qwen2.Qwen2, path: str | os.PathLike, *, dtype=None,
                    max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes config.json and safetensors (sharded with an index past `max_shard_bytes`) that
    `transformers.Qwen2ForCausalLM.from_pretrained` loads. dtype: storage dtype (default: the
    params'). On multi-host runs every process gathers and process 0 writes."""
    config = model.config
    _, params = qwen2.split_params(model)
    store = jnp.dtype(dtype) if dtype is not None else jax.tree.leaves(params)[0].dtype
    expected = _expected_tensors(config, params)
    tensors, host = {}, {}
    for hf_name, (p, layer, kind, _) in expected.items():
        if p not in host:
            host[p] = _host(_get(params, p))  # one gather per parameter stack
        w = host[p] if layer is None else host[p][layer]
        tensors[hf_name] = np.ascontiguousarray(_to_hf(kind, w).astype(store))
    if jax.process_index() != 0:
        return
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config.to_dict(), "dtype": str(store), "torch_dtype": str(store)}, f, indent=2)
    shards, current, size = [], {}, 0
    for name, w in tensors.items():
        if current and size + w.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = w, size + w.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": sum(w.nbytes for w in tensors.values())},
                   "weight_map": weight_map}, f, indent=2)


def param_count(params: Any) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def abstract_params(config: ModelConfig, **kwargs) -> dict:
    """The parameter tree as ShapeDtypeStructs (nothing allocated)."""
    return nnx.to_pure_dict(nnx.state(qwen2.abstract_model(config, **kwargs)))
