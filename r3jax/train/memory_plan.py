"""Ahead-of-time memory plans: the train step and the sampler compiled for a mesh, nothing allocated.

`plan` builds the run's state, rollout batch and sampler inputs as `jax.ShapeDtypeStruct`s carrying the
project's own shardings (`sharding.py`, `train_step.state_shardings`, `batch.batch_shardings`), lowers the
very jitted functions a run calls (`train_step.make_train_step`, `sampler._generate`) and compiles them.
On abstract TPU devices (`jax.experimental.topologies`) the TPU compiler itself reports per-device bytes,
so a plan for a v5e pod is made on a laptop; on CPU devices the same code path runs in tests.

Peak bytes per device = argument + output - alias + temp + generated code (`memory_analysis()`; alias is
the part of the output written into donated arguments, so it is not counted twice).

FLOPs are counted by formula, not taken from `cost_analysis()`: XLA counts a loop body once, whatever its
trip count, and both programs are loops (layers, micro-batches, decode steps). With Φ the matmul
parameters (layers and head, not the embedding lookup), per token of a forward pass

    F_fwd = 2·Φ + 4·L·N·H·S_attn        (S_attn: key slots each query scores)

train step: 3·F_fwd per token (forward + backward, the MFU convention), + F_fwd with remat "full" (the layer's
forward again), nothing more with remat "dots" (every product's output is kept, the attention's too), over
every loss row's tokens, where rows that read their prompts once per micro-batch (`trained_tokens`) count each
distinct prompt once;
sampler: prefill F_fwd on every prompt token (S_attn: the prompt), then one F_fwd per row per decode step (S_attn:
`decode_slots`, the cache blocks below the longest live row, averaged over the steps). The training attention
skips the blocks above the diagonal on every backend (`attention_plan`): S_attn is `causal_keys`, about half
the sequence (padding is still computed).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from r3jax import model as rm
from r3jax.model import attention, attention_plan, sharding, splash
from r3jax.rl import batch as rl_batch
from r3jax.rl import layout as rl_layout
from r3jax.rl import train_step
from r3jax.sampling import sampler, slots
from r3jax.train import config as run_config

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: peak dense bf16 FLOP/s, HBM capacity and HBM bandwidth (bytes/s)."""

    peak_flops: float | None
    hbm_bytes: int
    hbm_bandwidth: float | None


# Google Cloud's TPU system-architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e), per chip.
CHIPS = {
    "v4": Chip(275e12, 32 * GiB, 1200e9),
    "v5e": Chip(197e12, 16 * GiB, 819e9),
    "v5p": Chip(459e12, 95 * GiB, 2765e9),
    "v6e": Chip(918e12, 32 * GiB, 1640e9),
}


def devices(topology: str) -> tuple[list, Chip]:
    """The devices of `topology` and their chip: "cpu" (this host's devices, its RAM split among them) or a
    TPU topology name such as "v5e:4x8" (abstract devices; needs libtpu, not a TPU)."""
    if topology == "cpu":
        found = jax.devices("cpu")
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return found, Chip(None, ram // len(found), None)
    kind = topology.split(":")[0]
    if kind not in CHIPS:
        raise ValueError(f"unknown topology {topology!r}: 'cpu' or <kind>:<AxB[xC]> with kind in {sorted(CHIPS)}")
    from jax.experimental import topologies  # only TPU plans need it (and libtpu)

    return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices), CHIPS[kind]


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The step's sizes: P plain + slots reflection groups of G, Tp prompt and T response tokens, Q questions."""

    prompts: int
    slots: int
    samples: int
    prompt_tokens: int
    response_tokens: int
    num_questions: int
    replay_k: int

    @property
    def groups(self) -> int:
        return self.prompts + self.slots

    @property
    def loss_rows(self) -> int:  # the loss batch: every group's G on-policy rows plus its k replay slots
        return self.groups * (self.samples + self.replay_k)


def shapes(c, rl, *, prompt_tokens: int, num_questions: int) -> Shapes:
    slots = rl.r3.max_reflection_prompts if rl.uses_reflection else 0
    return Shapes(prompts=c.prompts_per_step, slots=slots, samples=c.samples_per_prompt,
                  prompt_tokens=prompt_tokens, response_tokens=c.max_new_tokens, num_questions=num_questions,
                  replay_k=rl.r3.replay_k if rl.uses_replay else 0)


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_model(c, model_cfg: rm.ModelConfig, mesh):
    """(graphdef, params as sharded ShapeDtypeStructs) of the policy, with the run's dtypes and remat."""
    compute = jnp.dtype(c.model.compute_dtype or c.model.dtype)
    model = rm.abstract_model(model_cfg, param_dtype=jnp.dtype(c.model.dtype), dtype=compute, remat=c.model.remat,
                              mesh=mesh, query_block=c.model.query_block, attention=c.model.get("attention", "auto"))
    graphdef, params = rm.split_params(model)
    return graphdef, _abstract(params, sharding.param_shardings(params, mesh, "train"))


def abstract_batch(s: Shapes, mesh) -> rl_batch.RolloutBatch:
    """A graded `RolloutBatch` of P + slots groups, placed as `batch_shardings` places it."""
    p, g, tp, t = s.groups, s.samples, s.prompt_tokens, s.response_tokens
    sds = jax.ShapeDtypeStruct
    batch = rl_batch.RolloutBatch(
        qids=sds((p,), jnp.int32), prompt_tokens=sds((p, tp), jnp.int32), prompt_mask=sds((p, tp), bool),
        tokens=sds((p, g, t), jnp.int32), mask=sds((p, g, t), bool), logprobs=sds((p, g, t), jnp.float32),
        entropies=sds((p, g, t), jnp.float32), lengths=sds((p, g), jnp.int32), truncated=sds((p, g), bool),
        correct=sds((p, g), bool), rewards=sds((p, g), jnp.float32), group_valid=sds((p,), bool),
        is_reflection=sds((p,), bool))
    return _abstract(batch, rl_batch.batch_shardings(batch, mesh))


def compile_train_step(c, rl, graphdef, params, s: Shapes, mesh):
    """The R³ train step at these shapes: the state (optimizer, buffer) comes from `jax.eval_shape`."""
    tx = train_step.optimizer(rl)
    # init_train_state rounds Q up to the device count only when given a mesh; the same rounding here
    q = -(-s.num_questions // mesh.devices.size) * mesh.devices.size
    state = jax.eval_shape(lambda p: train_step.init_train_state(p, rl, tx, num_questions=q, seed=c.seed), params)
    state = _abstract(state, train_step.state_shardings(state, tx, mesh))
    batch = abstract_batch(s, mesh)
    return train_step.make_train_step(graphdef, rl, tx, state, batch, mesh).lower(state, batch).compile()


def sampler_rows(c, s: Shapes) -> int:
    """Rows one sampler call decodes: `sampling_chunk`, or every row of the step when it is 0."""
    rows = c.sampling_chunk or s.groups * s.samples
    if rows % s.samples:
        raise ValueError(f"sampling_chunk = {rows} rows must be a multiple of samples_per_prompt = {s.samples}")
    return rows


def compile_sampler(c, rl, model_cfg: rm.ModelConfig, graphdef, params, s: Shapes, mesh):
    """`sampler._generate` for one chunk of rows, on the train-sharded params the loop hands it."""
    prompts = sampler_rows(c, s) // s.samples
    cfg = sampler.SamplingConfig(max_new_tokens=s.response_tokens, temperature=rl.temperature, top_p=c.top_p,
                                 eos_ids=(model_cfg.eos_token_id,), num_samples=s.samples,
                                 valid_vocab=rl.valid_vocab, pad_id=model_cfg.eos_token_id,
                                 share_prompts=True)  # as `rollouts.collect` samples
    placed = sharding.named(mesh, "act_bt", (prompts, s.prompt_tokens))
    tokens = jax.ShapeDtypeStruct((prompts, s.prompt_tokens), jnp.int32, sharding=placed)
    mask = jax.ShapeDtypeStruct((prompts, s.prompt_tokens), bool, sharding=placed)
    key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype  # no array: there may be no backend to hold one
    key = jax.ShapeDtypeStruct((), key_dtype, sharding=NamedSharding(mesh, jax.sharding.PartitionSpec()))
    widths, groups = slots.schedule(prompts, s.samples, c.get("sampling_slots", 0) or None, mesh)  # as `generate`
    return sampler._generate.lower(graphdef, cfg, widths, groups, params, tokens, mask, key).compile()


def forward_flops_per_token(m: rm.ModelConfig, attended: int) -> float:
    """F_fwd of the module docstring: matmuls of the layers and head, plus QK^T and PV over `attended` slots."""
    d, f, n, k, h, lyr = (m.hidden_size, m.intermediate_size, m.num_attention_heads, m.num_key_value_heads,
                          m.head_dim, m.num_hidden_layers)
    per_layer = d * n * h * 2 + d * k * h * 2 + 3 * d * f
    return 2.0 * (lyr * per_layer + m.vocab_size * d) + 4.0 * lyr * n * h * attended


def causal_keys(seq: int, backend: str) -> float:
    """Keys a query of a causal self-attention over `seq` positions scores, on average: every backend skips the
    blocks above the diagonal, so a block of queries scores the keys up to its last query (splash: blocks of
    `splash.BLOCK` over `seq` rounded up to them; cuDNN: per tile, taken as exact; XLA: `attention.CAUSAL_BLOCK`)."""
    if backend == "cudnn":
        return (seq + 1) / 2
    block = splash.BLOCK if backend == "splash" else attention.CAUSAL_BLOCK
    padded = -(-seq // block) * block if backend == "splash" else seq
    return sum((end - first) * end for first, end in attention._causal_spans(padded, block)) / seq


def trained_tokens(rl, s: Shapes, mesh, backend: str) -> int:
    """Tokens the train step's forward runs: each loss row's prompt and response, except in segments whose rows
    read their prompts once per micro-batch (`train_step.shared_prompts`, beside a backend that
    `attention_plan.shares_prompts`), which run each micro-batch's distinct prompts once."""
    batch = abstract_batch(s, mesh)
    total = 0
    for seg in train_step.segments(rl, batch, rl_layout.full(rl, batch)):
        shared = (train_step.shared_prompts(rl, seg, sharding.batch_devices(mesh))
                  if attention_plan.shares_prompts(backend) else None)
        prompts = seg.rows if shared is None else seg.micro_batches * shared[1]
        total += prompts * seg.prompt_width + seg.rows * s.response_tokens
    return total


def train_flops(c, m: rm.ModelConfig, s: Shapes, tokens: int, backend: str = "xla") -> float:
    """FLOPs of a train step that runs `tokens` (`trained_tokens`), each query scoring the causal keys of a
    whole row."""
    forward = forward_flops_per_token(m, causal_keys(s.prompt_tokens + s.response_tokens, backend))
    # forward + backward (2x), + what the backward recomputes: "dots" keeps every product's output (the
    # projections' and the attention's), so only "full" runs the forward again
    recomputed = {"none": 0.0, "full": forward, "dots": 0.0}[c.model.remat]
    return tokens * (3 * forward + recomputed)


def decode_slots(s: Shapes, shared: bool = False) -> float:
    """Cache slots a decode step's attention reads, averaged over the steps: the `attention.CACHE_BLOCK` blocks
    below the longest live row, which at step t holds prompt + t slots when that row runs to the budget (R1's
    truncated rows do; a call whose rows all end sooner stops sooner and reads less). shared: the prompt is
    the cache's shared prefix (`slots.shares_prompts`), read whole, and only the response slots in blocks."""
    block, steps = attention.CACHE_BLOCK, np.arange(1, s.response_tokens + 1)
    if shared:
        return s.prompt_tokens + float(np.minimum(s.response_tokens, -(-steps // block) * block).mean())
    whole, filled = s.prompt_tokens + s.response_tokens, s.prompt_tokens + steps
    return float(np.minimum(whole, -(-filled // block) * block).mean())


def decode_read_slots(s: Shapes, shared: bool = False) -> float:
    """Cache slots a decode step reads per row from memory (`decode_slots`), where a shared prompt is read once
    for its G samples."""
    if shared:
        return decode_slots(s, shared) - s.prompt_tokens + s.prompt_tokens / s.samples
    return decode_slots(s)


def sampler_shares_prompts(c, s: Shapes, mesh) -> bool:
    """Whether the plan's sampler call reads its prompts from a shared prefix (`slots.shares_prompts`; the run's
    sampler calls ask for it: `rollouts.collect`)."""
    rows = sampler_rows(c, s)
    widths = slots.loop_widths(rows, c.get("sampling_slots", 0) or None, mesh)
    return slots.shares_prompts(rows // s.samples, s.samples, widths, mesh)


def sampler_flops(m: rm.ModelConfig, s: Shapes, rows: int, shared: bool = False) -> float:
    prefill = rows // s.samples * s.prompt_tokens * forward_flops_per_token(m, s.prompt_tokens)
    return prefill + rows * s.response_tokens * forward_flops_per_token(m, decode_slots(s, shared))


def decode_bytes_per_step(c, m: rm.ModelConfig, s: Shapes, rows: int, mesh, shared: bool = False) -> float:
    """HBM bytes one decode step reads per device, averaged over the steps: the weights it multiplies with
    (whole along fsdp, split by tensor, in the compute dtype) and its rows' KV cache up to the longest live row
    (`decode_read_slots`)."""
    tensor = mesh.shape["tensor"]
    batch = sharding.batch_devices(mesh)
    itemsize = jnp.dtype(c.model.compute_dtype or c.model.dtype).itemsize
    weights = (forward_flops_per_token(m, 0) / 2) * itemsize / tensor
    kv_heads = m.num_key_value_heads / (tensor if m.num_key_value_heads % tensor == 0 else 1)
    cache = 2 * m.num_hidden_layers * kv_heads * decode_read_slots(s, shared) * m.head_dim * itemsize
    return weights + math.ceil(rows / batch) * cache


def record(program: str, compiled, *, topology: str, chip: Chip, mesh, flops: float, settings: dict,
           compile_s: float) -> dict:
    """One JSON-able line: the compiler's per-device bytes, peak against HBM, FLOPs and implied seconds."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # older jax returned one dict per module
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)
    chips = int(mesh.devices.size)
    at_peak = None if chip.peak_flops is None else flops / (chips * chip.peak_flops)
    return {
        "program": program, "topology": topology, "devices": chips,
        "mesh": {name: int(size) for name, size in mesh.shape.items()}, "settings": settings,
        "peak_bytes_per_device": int(peak), "hbm_bytes_per_device": int(chip.hbm_bytes),
        "peak_gib": round(peak / GiB, 3), "headroom": round(1.0 - peak / chip.hbm_bytes, 4),
        "fits": bool(peak <= chip.hbm_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
        "code_bytes": int(mem.generated_code_size_in_bytes),
        "flops": float(flops), "compiler_flops_per_device": float((cost or {}).get("flops", 0.0)),
        "peak_flops_per_chip": chip.peak_flops,
        "seconds_at_peak": at_peak, "seconds_at_40pct_mfu": None if at_peak is None else at_peak / 0.4,
        "compile_s": round(compile_s, 1),
    }


def refused(program: str, error: Exception, *, topology: str, chip: Chip, mesh, flops: float,
            settings: dict) -> dict:
    """The line of a program the compiler refused to place (RESOURCE_EXHAUSTED): it does not fit, and the
    bytes the compiler says it needed are a lower bound on its peak."""
    text = str(error)
    sizes = [float(v) * {"K": 2**10, "M": 2**20, "G": 2**30}[u] for v, u in re.findall(r"\(([\d.]+)([KMG])\)", text)]
    needed = int(sizes[0]) if sizes else None
    return {"program": program, "topology": topology, "devices": int(mesh.devices.size),
            "mesh": {name: int(size) for name, size in mesh.shape.items()}, "settings": settings,
            "peak_bytes_per_device": needed, "peak_is_lower_bound": True, "hbm_bytes_per_device": int(chip.hbm_bytes),
            "peak_gib": None if needed is None else round(needed / GiB, 3),
            "headroom": None if needed is None else round(1.0 - needed / chip.hbm_bytes, 4), "fits": False,
            "flops": float(flops), "error": text.strip().splitlines()[0][:500]}


def plan(c, model_cfg: rm.ModelConfig, devs: list, chip: Chip, *, topology: str, prompt_tokens: int = 1024,
         num_questions: int = 40315, programs=("train_step", "sampler")) -> list[dict]:
    """Compiles each of `programs` for the run config `c` on `devs` (mesh from `c.mesh`) and returns their records."""
    rl = run_config.rl_config(c, valid_vocab=None)
    mesh = sharding.make_mesh(data=c.mesh.data, fsdp=c.mesh.fsdp, tensor=c.mesh.tensor, devices=devs)
    s = shapes(c, rl, prompt_tokens=prompt_tokens, num_questions=num_questions)
    graphdef, params = abstract_model(c, model_cfg, mesh)
    backend = attention_plan.plan(mesh=mesh, backend=c.model.get("attention", "auto")).train
    settings = {"remat": c.model.remat, "query_block": c.model.query_block, "attention": backend,
                "num_micro_batches": rl.num_micro_batches, "share_prompts": rl.share_prompts,
                "chunk_size": rl.chunk_size,
                "sampling_chunk": c.sampling_chunk, "sampling_slots": c.get("sampling_slots", 0),
                "param_dtype": c.model.dtype,
                "compute_dtype": c.model.compute_dtype or c.model.dtype, **dataclasses.asdict(s)}
    out = []
    for program in programs:
        start = time.perf_counter()
        if program == "train_step":
            build = functools.partial(compile_train_step, c, rl, graphdef, params, s, mesh)
            tokens = trained_tokens(rl, s, mesh, backend)
            extra, flops = {"loss_rows": s.loss_rows, "trained_tokens": tokens}, train_flops(c, model_cfg, s, tokens,
                                                                                               backend)
        elif program == "sampler":
            rows = sampler_rows(c, s)
            build = functools.partial(compile_sampler, c, rl, model_cfg, graphdef, params, s, mesh)
            calls = -(-s.groups * s.samples // rows)
            refilled = c.get("sampling_slots", 0)  # slots decoding at once (0: all the call's rows)
            shared = sampler_shares_prompts(c, s, mesh)
            per_step = decode_bytes_per_step(c, model_cfg, s, min(refilled, rows) if refilled else rows, mesh,
                                             shared)
            # with slots, the steps a call takes depend on the response lengths: no estimate
            decode_s = (s.response_tokens * per_step / chip.hbm_bandwidth
                        if chip.hbm_bandwidth is not None and not refilled else None)
            extra = {"rows": rows, "calls_per_step": calls, "shared_prompts": shared,
                     "decode_bytes_per_step_per_device": int(per_step),
                     "decode_s_at_hbm_bandwidth": decode_s,
                     "sampling_s_per_step_at_hbm_bandwidth": None if decode_s is None else calls * decode_s}
            flops = sampler_flops(model_cfg, s, rows, shared)
        else:
            raise ValueError(f"unknown program {program!r}: 'train_step' or 'sampler'")
        try:
            compiled = build()
        except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program that cannot fit
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            out.append({**refused(program, e, topology=topology, chip=chip, mesh=mesh, flops=flops,
                                  settings=settings), **extra})
            continue
        rec = record(program, compiled, topology=topology, chip=chip, mesh=mesh, flops=flops, settings=settings,
                     compile_s=time.perf_counter() - start)
        out.append({**rec, **extra})
    return out
