"""A sampler call split into parts: the prompts in equal blocks, each block's program run from a thread of its own.

XLA:CPU runs a program in the thread that calls it, and a small model's decode ops are too small to spread over
the cores, so one program keeps about one core busy; programs called from several threads overlap. Each block is
the same compiled program (`sampler._generate` with the block's first row traced), and a row draws the numbers it
would draw in one program (its row of the whole batch's table), so the rollout is one program's: the same tokens,
log-probs within float rounding (a batch of another size may sum in another order: 1 ulp seen).
"""

from __future__ import annotations

import os
import threading
from concurrent import futures

import jax
import jax.numpy as jnp
import numpy as np

from r3jax.model import attention_plan, sharding

# Models whose MLP matrices hold more weights than this decode as one program by default (`auto_parts`).
PARTS_MAX_MLP_WEIGHTS = 1 << 19


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# At most this many blocks run at once, whoever started them (a training step's plain and reflection calls, say):
# more programs than cores contend (the GRPO bench's call as four blocks on two cores took 0.10-0.16 s, as two
# 0.085-0.093 s).
RUNNING = threading.BoundedSemaphore(cores())


def auto_parts(prompt_tokens, params, config) -> int:
    """`generate`'s default `parts` for a static batch: on a CPU with one process and one device, for a model
    whose MLP matrices hold at most `PARTS_MAX_MLP_WEIGHTS` weights (hidden x intermediate), the largest divisor
    of the prompt count P up to the cores this process may use; else 1. A larger model's ops already spread over
    the cores, and each part reads every weight at every step, so a split only adds traffic. Measured on 2 cores
    (random models, 4 layers, 32-token prompts, 64 new tokens; one program's time / two programs'): D128 x F384
    1.44-1.74 (16-128 rows), D256 x F768 1.36-1.50, D512 x F1536 0.86-1.12 (32-256 rows); D1536 x F8960 (2
    layers, 16 rows) 0.55. The GRPO bench's call (8 prompts x 8 samples): 0.145-0.160 s as one program,
    0.085-0.093 s as two, 0.10-0.16 s as four. Equal parts: one compiled program."""
    device = _one_device(prompt_tokens, params)
    if device is None or not attention_plan.cpu_mechanisms(device).sampler_parts:
        return 1
    if config.hidden_size * config.intermediate_size > PARTS_MAX_MLP_WEIGHTS:
        return 1
    p = prompt_tokens.shape[0]
    return max(d for d in range(1, min(cores(), p) + 1) if p % d == 0)


def device_of(params):
    """The device of a one-process call whose parameters all sit on one device, else None. Only there may several
    programs run at once from threads of their own (a sampler call's parts, a training step's sampler calls):
    programs over several devices run one at a time, since two in flight at once could reach their collectives
    in different orders and deadlock."""
    return _one_device(None, params)


def _one_device(prompt_tokens, params):
    """The device of a one-process, one-device call on concrete inputs, else None (several devices, several
    processes, or a traced call inside another jit)."""
    leaves = jax.tree.leaves(params)
    if jax.process_count() != 1 or any(isinstance(x, jax.core.Tracer) for x in [prompt_tokens, *leaves]):
        return None
    devices = {d for x in leaves for d in x.sharding.device_set}
    return devices.pop() if len(devices) == 1 else None


def check_parts(parts, prompt_tokens, params, slots) -> int:
    """An explicit `parts`, refused unless it splits the prompts (and the slots) evenly where a split may run."""
    p = prompt_tokens.shape[0]
    if not (isinstance(parts, int | np.integer) and parts >= 1 and p % parts == 0):
        raise ValueError(f"parts must be a positive divisor of the {p} prompts, got {parts!r}")
    if slots is not None and int(slots) % parts:
        raise ValueError(f"slots={slots} do not split over parts={parts} (each part decodes slots / parts rows)")
    if parts > 1 and _one_device(prompt_tokens, params) is None:
        raise ValueError(f"parts={parts} needs one process, one device and concrete inputs (not inside jit): "
                         "programs over several devices run whole")
    return int(parts)


def run_in_parts(program, params, prompt_tokens, prompt_mask, key, parts: int, num_samples: int, mesh):
    """program(params, tokens, mask, key, table_rows, first_row) -> (rollout, counts) on each of `parts` equal
    blocks of the prompts, each called from a thread of its own once its inputs are in place (on the parameters'
    device); the rollouts joined in prompt order, the steps of the longest block, all slot-steps."""
    per, rows = prompt_tokens.shape[0] // parts, prompt_tokens.shape[0] * num_samples
    tokens_h, mask_h = np.asarray(prompt_tokens), np.asarray(prompt_mask)  # sliced on the host: no program
    params, device = jax.block_until_ready(params), _one_device(prompt_tokens, params)

    def block(b):
        tokens, mask = tokens_h[b * per:(b + 1) * per], mask_h[b * per:(b + 1) * per]
        at = sharding.named(mesh, "act_bt", tokens.shape) if mesh is not None else device
        # every input in place before the call: XLA:CPU runs a program in the calling thread only when its inputs
        # are ready, and queues it behind the others otherwise
        tokens, mask, ready_key = jax.block_until_ready((jax.device_put(tokens, at), jax.device_put(mask, at), key))
        with RUNNING:
            return jax.block_until_ready(program(params, tokens, mask, ready_key, rows,
                                                 np.int32(b * per * num_samples)))

    with futures.ThreadPoolExecutor(max_workers=parts) as pool:
        return _join(tuple(pool.map(block, range(parts))))


@jax.jit
def _join(outs):
    rollout = jax.tree.map(lambda *xs: jnp.concatenate(xs), *(r for r, _ in outs))
    return rollout, {"steps": jnp.max(jnp.stack([c["steps"] for _, c in outs])),
                     "slot_steps": jnp.sum(jnp.stack([c["slot_steps"] for _, c in outs]))}
