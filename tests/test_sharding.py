"""The real sharded path on 8 fake CPU devices: parameters are split and the forward is unchanged."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from r3jax import model as rm
from r3jax.model import sharding


@pytest.fixture
def mesh():
    assert jax.device_count() == 8, "tests/conftest.py must give 8 fake devices"
    return sharding.make_mesh(data=2, fsdp=2, tensor=2)


def test_parameters_are_really_split(hf_checkpoint, mesh):
    folder, _ = hf_checkpoint()
    model, _ = rm.load_pretrained(folder, mesh=mesh)
    q = model.layers.self_attn.q_proj[...]  # [L, N, H, D]
    assert q.sharding.spec == P(None, "tensor", None, "fsdp")
    assert {s.data.shape for s in q.addressable_shards} == {(2, 2, 16, 32)}
    emb = model.embed_tokens[...]
    assert emb.sharding.spec == P("tensor", "fsdp")
    assert emb.addressable_shards[0].data.shape == (64, 32)


def test_sample_mode_keeps_weights_whole_along_fsdp(hf_checkpoint, mesh):
    folder, _ = hf_checkpoint()
    model, _ = rm.load_pretrained(folder, mesh=mesh, sharding_mode="sample")
    _, params = rm.split_params(model)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        assert "fsdp" not in jax.tree.leaves(tuple(leaf.sharding.spec)), path
    assert model.layers.mlp.up_proj[...].sharding.spec == P(None, "tensor", None)


def test_sharded_jitted_forward_equals_single_device(hf_checkpoint, mesh):
    folder, _ = hf_checkpoint(num_hidden_layers=3)
    single, _ = rm.load_pretrained(folder)
    sharded, _ = rm.load_pretrained(folder, mesh=mesh)
    tokens = np.random.RandomState(0).randint(0, 128, (4, 8))
    mask = np.ones_like(tokens, bool)
    mask[1, :3] = False
    graphdef, params = rm.split_params(sharded)
    batch = sharding.named(mesh, "act_bt", tokens.shape)

    @jax.jit
    def forward(params, tokens, mask):
        return rm.merge_params(graphdef, params)(tokens, attention_mask=mask)

    logits = forward(params, jax.device_put(tokens, batch), jax.device_put(mask, batch))
    assert logits.sharding.spec == P(("data", "fsdp"), None, "tensor")
    np.testing.assert_allclose(np.asarray(logits), np.asarray(single(tokens, attention_mask=mask)), atol=2e-5)


def test_fit_spec_leaves_indivisible_dims_whole(mesh):
    # 1 KV head cannot be split 2 ways; a batch of 2 can only take the data axis.
    assert sharding.fit_spec(P("tensor", None, "fsdp"), (1, 16, 64), mesh) == P(None, None, "fsdp")
    assert sharding.fit_spec(P(("data", "fsdp"), None), (2, 5), mesh) == P("data", None)


def test_mesh_helper_rejects_impossible_shapes():
    with pytest.raises(ValueError, match="needs 12 devices"):
        sharding.make_mesh(data=3, fsdp=2, tensor=2)
    assert sharding.make_mesh(tensor=2).shape == {"data": 1, "fsdp": 4, "tensor": 2}
