"""`attention_plan` decides every platform-dependent path in one place: an accelerator mesh gets the kernels and
none of the CPU-only mechanisms, whoever asks (model, sampler, rollout loop); a CPU gets the XLA path and them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from r3jax import model as rm
from r3jax.model import attention_plan, sharding
from r3jax.model import cache as kv_cache
from r3jax.sampling import generate
from r3jax.sampling import parts as sampling_parts
from r3jax.train import rollouts


@pytest.fixture
def on(monkeypatch):
    """on(platform): every platform question the library asks now answers `platform`."""
    return lambda platform: monkeypatch.setattr(attention_plan, "platform_of", lambda where=None: platform)


@pytest.mark.parametrize("platform, kernel", [("tpu", "splash"), ("gpu", "cudnn")])
def test_an_accelerator_mesh_selects_its_kernel_and_no_cpu_only_mechanism(on, platform, kernel):
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)  # 8 fake devices
    on(platform)
    plan = attention_plan.plan(mesh=mesh)
    assert (plan.platform, plan.train, plan.prefill) == (platform, kernel, kernel)
    assert not any(dataclasses.asdict(plan.cpu).values()), plan.describe()
    assert rm.abstract_model(rm.tiny(), mesh=mesh).attention == kernel
    one = rm.init_model(rm.tiny(), attention="xla")  # one process, one device: where threads would apply
    _, params = rm.split_params(one)
    prompts = jnp.ones((4, 6), jnp.int32)
    assert sampling_parts.auto_parts(prompts, params, one.config) == 1
    assert not rollouts.threads_per_call(params)


def test_the_sampler_on_an_accelerator_mesh_decodes_from_the_stacked_cache_and_layers(on, monkeypatch):
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    built = rm.init_model(rm.tiny(), mesh=mesh, attention="xla")  # built on the CPU it really runs on
    on("tpu")
    caches, unstacked = [], []
    init_cache = kv_cache.init_cache
    monkeypatch.setattr(kv_cache, "init_cache", lambda *a, **kw: caches.append(kw.get("per_layer", 0)) or
                        init_cache(*a, **kw))
    monkeypatch.setattr(rm.Qwen2, "unstack_layers", lambda self: unstacked.append(1) or [])
    jax.clear_caches()  # the decode program is traced again, through the spies
    prompts = jnp.asarray(np.random.RandomState(0).randint(3, 200, (4, 6)), jnp.int32)
    out = generate(built, prompts, jnp.ones_like(prompts, bool), jax.random.key(0), max_new_tokens=4,
                   num_samples=2)
    assert out.tokens.shape == (8, 4)
    assert caches and not any(caches), "the decode cache went per layer (head/tail) on an accelerator"
    assert not unstacked, "the decode loop unrolled the layers on an accelerator"


def test_a_cpu_gets_the_xla_path_and_its_mechanisms():
    plan = attention_plan.plan(platform="cpu")
    assert plan.train == "xla" and all(dataclasses.asdict(plan.cpu).values())
    assert "train xla" in plan.describe() and plan.as_dict()["cpu"]["unroll_layers"] is True


@pytest.mark.parametrize("platform, backend, shared", [("cpu", "auto", True), ("tpu", "auto", True),
                                                       ("gpu", "auto", False), ("gpu", "xla", True)])
def test_training_rows_share_prompts_beside_xla_and_splash_attention(platform, backend, shared):
    """XLA and splash have a prefixed form; beside cuDNN rows keep their own prompt."""
    plan = attention_plan.plan(platform=platform, backend=backend)
    assert plan.shared_prompts is shared and plan.shared_prompts == attention_plan.shares_prompts(plan.train)


def test_prefixed_attention_on_a_backend_without_a_prefixed_form_is_refused_by_name():
    q = jnp.zeros((2, 3, 2, 4))
    kv, prefix = jnp.zeros((2, 1, 3, 4)), jnp.zeros((1, 1, 5, 4))
    with pytest.raises(ValueError, match="cudnn"):
        attention_plan.prefixed_attention("cudnn", q, prefix, prefix, kv, kv, jnp.ones((1, 5), bool),
                                          jnp.ones((2, 3), bool))


@pytest.mark.parametrize("backend, platform", [("splash", "cpu"), ("cudnn", "tpu"), ("flash", "gpu")])
def test_a_backend_the_platform_cannot_run_is_refused_by_name(backend, platform):
    with pytest.raises(ValueError, match=backend):
        attention_plan.resolve_backend(backend, platform)


def test_xla_runs_on_every_platform():
    assert {attention_plan.resolve_backend("xla", p) for p in ("cpu", "gpu", "tpu")} == {"xla"}
