"""Where every tensor lives: one table of PartitionSpecs, named by role and shape letters.

The mesh has three named axes: `data` (pure data parallelism), `fsdp` (data parallelism whose
replicas also split the parameters and optimizer state) and `tensor` (Megatron-style splitting of
heads, MLP width and vocabulary). A batch is split over `data` x `fsdp`.

Two variants of the parameter table exist: `train` shards weights over `fsdp` and `tensor`;
`sample` keeps them whole along `fsdp` (replicated across data-parallel samplers) and splits only
over `tensor`, so decoding never all-gathers weights. A dimension that a mesh axis does not divide
evenly stays whole along that axis (a 2-KV-head model on a 4-way tensor axis, say): that rule is
applied explicitly by `fit_spec`, on every platform, CPU included.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")

# Parameter specs for one layer (the stacked layer axis L is prepended, never split).
PARAM_SPECS = {
    "emb_vd": P("tensor", "fsdp"),
    "norm_d": P(None),
    "wq_nhd": P("tensor", None, "fsdp"),
    "bq_nh": P("tensor", None),
    "wkv_khd": P("tensor", None, "fsdp"),
    "bkv_kh": P("tensor", None),
    "wo_dnh": P("fsdp", "tensor", None),
    "wup_fd": P("tensor", "fsdp"),
    "wdown_df": P("fsdp", "tensor"),
}

# Parameter path (as in the pure-dict params tree) -> role in PARAM_SPECS.
PARAM_ROLES = {
    ("embed_tokens",): "emb_vd",
    ("lm_head",): "emb_vd",
    ("norm", "scale"): "norm_d",
    ("layers", "input_layernorm", "scale"): "norm_d",
    ("layers", "post_attention_layernorm", "scale"): "norm_d",
    ("layers", "self_attn", "q_proj"): "wq_nhd",
    ("layers", "self_attn", "q_bias"): "bq_nh",
    ("layers", "self_attn", "k_proj"): "wkv_khd",
    ("layers", "self_attn", "k_bias"): "bkv_kh",
    ("layers", "self_attn", "v_proj"): "wkv_khd",
    ("layers", "self_attn", "v_bias"): "bkv_kh",
    ("layers", "self_attn", "o_proj"): "wo_dnh",
    ("layers", "mlp", "gate_proj"): "wup_fd",
    ("layers", "mlp", "up_proj"): "wup_fd",
    ("layers", "mlp", "down_proj"): "wdown_df",
}

# Activations and the KV cache (the same in both variants).
ACTIVATION_SPECS = {
    "act_btd": P(BATCH, None, None),
    "act_btnh": P(BATCH, None, "tensor", None),
    "act_btkh": P(BATCH, None, "tensor", None),
    "act_btf": P(BATCH, None, "tensor"),
    "act_btv": P(BATCH, None, "tensor"),
    "act_bt": P(BATCH, None),
    "act_b": P(BATCH),
    # The embedding table as the token lookup reads it: whole along fsdp (all-gathered, as FSDP does for
    # every weight before use), vocabulary still split over tensor. Gathering rows straight out of the
    # train layout, whose D is split over fsdp, gives rows split along D that XLA cannot reshard to
    # batch-split activations except by replicating them ("Involuntary full rematerialization").
    "emb_lookup_vd": P("tensor", None),
    "cache_lbksh": P(None, BATCH, "tensor", None, None),
    "cache_bksh": P(BATCH, "tensor", None, None),  # one layer's, in a per-layer cache (decode loops)
    "cache_bkhs": P(BATCH, "tensor", None, None),
    "cache_bs": P(BATCH, None),
    # RL state and batches: the replay buffer along its question axis Q over the whole mesh; rollout
    # groups along P like a batch.
    "buffer_qst": P(("data", "fsdp", "tensor"), None, None),
    "buffer_qs": P(("data", "fsdp", "tensor"), None),
    "buffer_q": P(("data", "fsdp", "tensor")),
    "group_pgt": P(BATCH, None, None),
    "group_pg": P(BATCH, None),
    "group_p": P(BATCH),
}


def param_spec(path: tuple[str, ...], mode: str = "train") -> P:
    """The PartitionSpec of one parameter (before `fit_spec` adapts it to a concrete shape)."""
    if mode not in ("train", "sample"):
        raise ValueError(f"sharding mode must be 'train' or 'sample', got {mode!r}")
    try:
        spec = PARAM_SPECS[PARAM_ROLES[tuple(path)]]
    except KeyError:
        raise KeyError(f"no sharding rule for parameter {'/'.join(path)}") from None
    if mode == "sample":
        spec = P(*(None if axis == "fsdp" else axis for axis in spec))
    if path[0] == "layers":
        spec = P(None, *spec)
    return spec


def batch_devices(mesh: Mesh | None) -> int:
    """How many ways a batch splits: the devices along `data` x `fsdp` (1 without a mesh)."""
    return 1 if mesh is None else _axis_size(mesh, BATCH)


def _axis_size(mesh, axis) -> int:
    names = axis if isinstance(axis, tuple) else (axis,)
    return int(np.prod([mesh.shape[n] for n in names]))


def fit_spec(spec: P, shape: tuple[int, ...], mesh) -> P:
    """Drops mesh axes (left to right within a dim) that do not divide that dim, or that the mesh lacks."""
    fitted = []
    for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        names = () if axis is None else (axis if isinstance(axis, tuple) else (axis,))
        names = tuple(n for n in names if n in mesh.shape)
        while names and dim % _axis_size(mesh, names):
            names = names[:-1]
        fitted.append(None if not names else names[0] if len(names) == 1 else names)
    return P(*fitted)


def param_shardings(params: Any, mesh: Mesh, mode: str = "train") -> Any:
    """A pytree of NamedShardings matching a (pure-dict) params tree of arrays or ShapeDtypeStructs."""
    def one(path, leaf):
        names = tuple(k.key for k in path)
        return NamedSharding(mesh, fit_spec(param_spec(names, mode), leaf.shape, mesh))
    return jax.tree_util.tree_map_with_path(one, params)


def named(mesh: Mesh, name: str, shape: tuple[int, ...]) -> NamedSharding:
    """The NamedSharding of an activation or cache tensor of this shape."""
    return NamedSharding(mesh, fit_spec(ACTIVATION_SPECS[name], shape, mesh))


def constrain(x: jax.Array, name: str, mesh: Mesh | None) -> jax.Array:
    """Pins an activation to its table entry; a model built without a mesh runs unconstrained."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named(mesh, name, x.shape))


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh; one size may be -1 to take the remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis size may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices cannot be split as {dict(zip(AXES, sizes, strict=True))}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh {dict(zip(AXES, sizes, strict=True))} needs {int(np.prod(sizes))} devices, "
                         f"{len(devices)} are available")
    return Mesh(np.asarray(devices).reshape(sizes), AXES)
