"""Memory plans on the 8 fake CPU devices: the same compile path as a TPU plan, at tiny shapes."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from r3jax import model as rm
from r3jax.model import sharding
from r3jax.train import memory_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("program", "topology", "peak_bytes_per_device", "hbm_bytes_per_device", "flops", "argument_bytes",
          "output_bytes", "temp_bytes", "alias_bytes", "headroom", "mesh", "settings")


def tiny_config(**changes):
    spec = importlib.util.spec_from_file_location("tiny_config", os.path.join(ROOT, "configs", "tiny.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    for name, value in changes.items():
        *parents, leaf = name.split(".")
        node = c
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def model_config(c):
    return rm.tiny(**c.model.init_overrides.to_dict())


def make_plan(c, programs):
    devs, chip = memory_plan.devices("cpu")
    return memory_plan.plan(c, model_config(c), devs, chip, topology="cpu", prompt_tokens=16, num_questions=16,
                            programs=programs)


@pytest.fixture(scope="module")
def records():
    return {r["program"]: r for r in make_plan(tiny_config(), ("train_step", "sampler"))}


def test_records_have_every_field_and_peak_is_their_sum(records):
    for rec in records.values():
        assert all(k in rec for k in FIELDS), sorted(set(FIELDS) - set(rec))
        assert rec["devices"] == 8 and rec["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
        assert rec["peak_bytes_per_device"] == (rec["argument_bytes"] + rec["output_bytes"] - rec["alias_bytes"]
                                                + rec["temp_bytes"] + rec["code_bytes"]) > 0
        assert rec["flops"] > 0 and rec["compiler_flops_per_device"] > 0 and rec["fits"] is True
        assert rec["headroom"] == pytest.approx(1 - rec["peak_bytes_per_device"] / rec["hbm_bytes_per_device"],
                                                abs=1e-4)


def test_train_step_donates_its_state(records):
    """The state comes back in place: the aliased bytes are the bulk of the output (params, Adam, buffer)."""
    rec = records["train_step"]
    assert rec["alias_bytes"] > 0.9 * rec["output_bytes"]
    assert rec["loss_rows"] == (4 + 4) * (4 + 2)  # (P + reflection slots) x (G + k replayed)


def test_sampler_chunk_needs_less_memory_than_all_rows():
    """Decoding 8 of the step's 32 rows at a time needs less memory per device, and a quarter of the FLOPs.
    (A 2-way batch axis: a chunk's prompts must split over it, or the prefill runs replicated.)"""
    mesh = {"mesh.fsdp": 2, "mesh.tensor": 4}
    (whole,) = make_plan(tiny_config(**mesh), ("sampler",))
    (chunk,) = make_plan(tiny_config(sampling_chunk=8, **mesh), ("sampler",))
    assert whole["rows"] == 32 and chunk["rows"] == 8 and chunk["calls_per_step"] == 4
    assert chunk["peak_bytes_per_device"] < whole["peak_bytes_per_device"]
    assert chunk["flops"] == pytest.approx(whole["flops"] / 4)


def test_forward_flops_count_every_matmul_parameter_twice():
    """At zero attended slots, F_fwd = 2 x (parameters - embedding table - norm scales - biases)."""
    cfg = rm.tiny(hidden_size=32, intermediate_size=64, num_hidden_layers=3)
    params = rm.split_params(rm.abstract_model(cfg))[1]
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    skipped = sum(int(np.prod(x.shape)) for path, x in flat
                  if any(getattr(k, "key", "") in ("embed_tokens", "scale", "q_bias", "k_bias", "v_bias")
                         for k in path))
    assert memory_plan.forward_flops_per_token(cfg, 0) == 2 * (total - skipped)


def test_unknown_topology_is_refused():
    with pytest.raises(ValueError, match="unknown topology"):
        memory_plan.devices("v9:2x2")


def test_cli_prints_one_json_line_per_program():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "memory_plan.py"), "--config", "configs/tiny.py",
         "--topology", "cpu", "--programs", "sampler", "--prompt_tokens", "16", "--num_questions", "16",
         "--config.sampling_chunk=16"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["program"] for r in lines] == ["sampler"]
    assert lines[0]["settings"]["sampling_chunk"] == 16 and lines[0]["rows"] == 16
    assert lines[0]["peak_bytes_per_device"] > 0 and lines[0]["devices"] == 8


def test_a_program_the_compiler_cannot_place_is_a_line_that_does_not_fit():
    devs, chip = memory_plan.devices("cpu")
    mesh = jax.sharding.Mesh(np.asarray(devs), ("fsdp",))
    error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
                                       "for HLO temporaries (21.82G) exceeds available HBM (15.75G).")
    rec = memory_plan.refused("train_step", error, topology="v5e:4x8", chip=chip, mesh=mesh, flops=1.0, settings={})
    assert rec["fits"] is False and rec["peak_is_lower_bound"] is True
    assert rec["peak_bytes_per_device"] == int(21.82 * 2**30) and rec["error"].startswith("RESOURCE_EXHAUSTED")
    assert all(k in rec for k in ("program", "topology", "hbm_bytes_per_device", "flops"))


def test_train_flops_count_what_each_remat_policy_recomputes():
    """none: forward + backward (3 F_fwd); full: the forward again (4 F_fwd); dots keeps the projections' and
    the attention's outputs, so its backward recomputes no product: 3 F_fwd."""
    m = rm.tiny()
    shapes = memory_plan.Shapes(prompts=2, slots=0, samples=4, prompt_tokens=8, response_tokens=24, num_questions=2,
                                replay_k=0)
    tokens = shapes.loss_rows * 32
    flops = {r: memory_plan.train_flops(tiny_config(**{"model.remat": r}), m, shapes, tokens)
             for r in ("none", "dots", "full")}
    forward, projections = (memory_plan.forward_flops_per_token(m, s) for s in (32, 0))  # 0 slots: no attention
    assert flops["none"] == pytest.approx(3 * forward * tokens)
    assert flops["full"] == pytest.approx(4 * forward * tokens)
    assert flops["dots"] == pytest.approx(3 * forward * tokens)
    assert flops["dots"] < flops["full"]
    assert projections < forward  # the attention term is counted (forward_flops_per_token at 32 slots vs 0)


@pytest.mark.parametrize("share, backend", [(True, "xla"), (True, "splash"), (False, "xla"), (True, "cudnn")])
def test_rows_that_share_their_prompt_count_it_once_per_micro_batch(share, backend):
    """GRPO, 2 groups of 4 rows in 2 micro-batches of one group each: with shared prompts each micro-batch runs
    its one prompt once (2 prompts of 8 tokens + 8 rows of 24), without them (or beside cuDNN) every row runs its
    own (8 rows of 32 tokens)."""
    from r3jax.train import config as run_config

    c = tiny_config(**{"algorithm": "grpo", "prompts_per_step": 2, "samples_per_prompt": 4,
                       "rl.num_micro_batches": 2, "rl.share_prompts": share})
    rl = run_config.rl_config(c, valid_vocab=None)
    shapes = memory_plan.Shapes(prompts=2, slots=0, samples=4, prompt_tokens=8, response_tokens=24, num_questions=2,
                                replay_k=0)
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    shared = share and backend != "cudnn"
    assert memory_plan.trained_tokens(rl, shapes, mesh, backend) == (2 * 8 + 8 * 24 if shared else 8 * 32)


def test_decode_reads_the_cache_blocks_below_the_longest_row(monkeypatch):
    """A decode step reads the cache in blocks up to its longest live row (`attention.attend_cached`), which at
    step t holds prompt + t slots: the plan's FLOPs and bytes use that mean, not the whole cache. Prompt 4,
    10 steps, blocks of 4: 8, 8, 8, 8, 12, 12, 12, 12, 14, 14 slots (the last block ends at the cache's 14)."""
    monkeypatch.setattr(memory_plan.attention, "CACHE_BLOCK", 4)
    shapes = memory_plan.Shapes(prompts=2, slots=0, samples=4, prompt_tokens=4, response_tokens=10,
                                num_questions=2, replay_k=0)
    assert memory_plan.decode_slots(shapes) == pytest.approx(10.8)
    m = rm.tiny()
    prefill = 2 * 4 * memory_plan.forward_flops_per_token(m, 4)
    decode = 8 * 10 * memory_plan.forward_flops_per_token(m, 10.8)
    assert memory_plan.sampler_flops(m, shapes, 8) == pytest.approx(prefill + decode)
    monkeypatch.setattr(memory_plan.attention, "CACHE_BLOCK", 256)  # one block holds it all
    assert memory_plan.decode_slots(shapes) == 14


def test_a_shared_prompt_is_read_once_for_its_samples(monkeypatch):
    """With the prompt a shared prefix (`slots.shares_prompts`), a decode step scores the whole prompt and the
    response blocks below the longest row, but reads the prompt from memory once for its G samples. Prompt 4,
    10 steps, blocks of 4: 4 + (4, 4, 4, 4, 8, 8, 8, 8, 10, 10) = 10.8 slots scored; read 10.8 - 4 + 4 / 4."""
    monkeypatch.setattr(memory_plan.attention, "CACHE_BLOCK", 4)
    shapes = memory_plan.Shapes(prompts=2, slots=0, samples=4, prompt_tokens=4, response_tokens=10,
                                num_questions=2, replay_k=0)
    assert memory_plan.decode_slots(shapes, shared=True) == pytest.approx(10.8)
    assert memory_plan.decode_read_slots(shapes, shared=True) == pytest.approx(7.8)
    assert memory_plan.decode_read_slots(shapes) == memory_plan.decode_slots(shapes) == pytest.approx(10.8)


def test_train_flops_count_the_keys_causal_blocks_score():
    """Every backend skips the blocks above the diagonal: at 2,048 positions in blocks of 512 a query scores 1,280
    keys on average (not 2,048); splash rounds the sequence up to its blocks, cuDNN is taken as exact."""
    assert memory_plan.causal_keys(2048, "xla") == (512 * (512 + 1024 + 1536 + 2048)) / 2048 == 1280
    assert memory_plan.causal_keys(1000, "splash") == 512 * (512 + 1024) / 1000
    assert memory_plan.causal_keys(2048, "cudnn") == pytest.approx(1024.5)
