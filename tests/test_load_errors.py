"""Bad checkpoints fail with an error that names the file or tensor; nothing half-loaded is returned."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from r3jax import model as rm


@pytest.fixture
def folder(hf_checkpoint):
    return hf_checkpoint()[0]


def edit_tensors(folder, edit):
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        raw = json.load(f)
    raw.update(changes)
    with open(path, "w") as f:
        json.dump(raw, f)


def test_wrong_model_type(folder):
    edit_config(folder, model_type="llama")
    with pytest.raises(rm.ConfigError, match=r"config\.json: model_type 'llama'"):
        rm.load_pretrained(folder)


def test_missing_tensor_is_named(folder):
    edit_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(rm.CheckpointError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.up_proj\.weight"):
        rm.load_pretrained(folder)


def test_extra_tensor_is_named(folder):
    edit_tensors(folder, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((96, 64), np.float32)}))
    with pytest.raises(rm.CheckpointError, match=r"unexpected tensor\(s\) model\.layers\.2\.mlp\.up_proj\.weight"):
        rm.load_pretrained(folder)


def test_wrong_shape_is_named_with_both_shapes(folder):
    edit_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((16, 64), np.float32)}))
    expected = r"k_proj\.weight has shape \[16, 64\], config\.json implies \[32, 64\]"
    with pytest.raises(rm.CheckpointError, match=expected):
        rm.load_pretrained(folder)


def test_integer_tensor_is_rejected(folder):
    edit_tensors(folder, lambda t: t.update({"model.norm.weight": np.ones((64,), np.int32)}))
    with pytest.raises(rm.CheckpointError, match=r"model\.norm\.weight has dtype I32"):
        rm.load_pretrained(folder)


def test_missing_config_file(folder):
    os.remove(os.path.join(folder, "config.json"))
    with pytest.raises(FileNotFoundError, match=r"missing file: .*config\.json"):
        rm.load_pretrained(folder)


def test_missing_weights_file(folder):
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"missing file: .*model\.safetensors"):
        rm.load_pretrained(folder)


def test_missing_shard_listed_in_index(hf_checkpoint, tmp_path):
    model, _ = rm.load_pretrained(hf_checkpoint()[0])
    rm.save_pretrained(model, tmp_path / "sharded", max_shard_bytes=40_000)
    victim = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=f"missing file: .*{victim.name}"):
        rm.load_pretrained(tmp_path / "sharded")


def test_corrupt_weights_file_is_named(folder):
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(rm.CheckpointError, match=r"model\.safetensors: cannot read safetensors"):
        rm.load_pretrained(folder)


def test_old_rotary_buffers_are_ignored(folder):
    edit_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    model, _ = rm.load_pretrained(folder)
    assert model.config.num_hidden_layers == 2


def test_nonexistent_local_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        rm.load_pretrained(str(tmp_path / "nope"))


def test_hub_id_offline_is_a_clear_error():
    with pytest.raises(OSError, match=r"'someone/some-model' is not a local folder.*Offline\?"):
        rm.load_pretrained("someone/some-model")
