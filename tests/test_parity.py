"""Random tiny transformers checkpoints load with `load_pretrained` and give the same fp32 logits."""

import numpy as np
import pytest
from conftest import hf_logits

from r3jax import model as rm

CASES = {
    "untied_gqa_1e4_2l": dict(),
    "tied_mqa_1e6_1l": dict(tie_word_embeddings=True, num_key_value_heads=1, num_hidden_layers=1, rope_theta=1e6),
    "untied_mha_1e6_3l": dict(num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=3, rope_theta=1e6,
                              hidden_size=48, intermediate_size=80),
    "tied_8heads_1e4_2l": dict(tie_word_embeddings=True, num_attention_heads=8, num_key_value_heads=4,
                               hidden_size=64, head_dim=8),
}


def padded_batch(vocab, seed=0):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, vocab, (4, 11))
    mask = np.ones_like(tokens, bool)
    mask[1, :4] = False   # left padding
    mask[2, 7:] = False   # right padding
    mask[3, :10] = False  # a single real token
    return tokens, mask


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp32_logits_match_transformers(hf_checkpoint, name):
    overrides = {k: v for k, v in CASES[name].items() if k != "head_dim"}
    folder, hf = hf_checkpoint(**overrides)
    model, config = rm.load_pretrained(folder)
    tokens, mask = padded_batch(config.vocab_size)
    ours = np.asarray(model(tokens, attention_mask=mask))
    np.testing.assert_allclose(ours[mask], hf_logits(hf, tokens, mask)[mask], atol=1e-4, rtol=0)


def test_padding_does_not_change_real_token_logits(hf_checkpoint):
    folder, _ = hf_checkpoint()
    model, _ = rm.load_pretrained(folder)
    tokens = np.random.RandomState(1).randint(0, 128, (1, 6))
    alone = np.asarray(model(tokens))
    left = np.asarray(model(np.concatenate([np.zeros((1, 3), int), tokens], 1),
                            attention_mask=np.array([[0] * 3 + [1] * 6])))[:, 3:]
    right = np.asarray(model(np.concatenate([tokens, np.zeros((1, 3), int)], 1),
                             attention_mask=np.array([[1] * 6 + [0] * 3])))[:, :6]
    np.testing.assert_allclose(left, alone, atol=1e-5)
    np.testing.assert_allclose(right, alone, atol=1e-5)


def test_save_then_transformers_load_gives_equal_logits(hf_checkpoint, tmp_path):
    from transformers import Qwen2ForCausalLM

    for overrides in (dict(), dict(tie_word_embeddings=True, num_key_value_heads=1)):
        folder, _ = hf_checkpoint(name=f"src{len(overrides)}", **overrides)
        model, config = rm.load_pretrained(folder)
        out = tmp_path / f"saved{len(overrides)}"
        rm.save_pretrained(model, out)
        reloaded = Qwen2ForCausalLM.from_pretrained(out).eval()
        tokens, mask = padded_batch(config.vocab_size, seed=2)
        np.testing.assert_allclose(hf_logits(reloaded, tokens, mask)[mask],
                                   np.asarray(model(tokens, attention_mask=mask))[mask], atol=1e-5)


def test_sharded_save_writes_an_index_transformers_loads(hf_checkpoint, tmp_path):
    from transformers import Qwen2ForCausalLM

    folder, hf = hf_checkpoint()
    model, _ = rm.load_pretrained(folder)
    rm.save_pretrained(model, tmp_path / "out", max_shard_bytes=40_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    again, _ = rm.load_pretrained(tmp_path / "out")
    tokens, mask = padded_batch(128, seed=3)
    np.testing.assert_array_equal(np.asarray(again(tokens, attention_mask=mask)),
                                  np.asarray(model(tokens, attention_mask=mask)))
    reloaded = Qwen2ForCausalLM.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(hf_logits(reloaded, tokens, mask), hf_logits(hf, tokens, mask), atol=0)


def test_bf16_params_and_compute_stay_close_to_fp32(hf_checkpoint):
    import jax.numpy as jnp

    folder, hf = hf_checkpoint()
    model, _ = rm.load_pretrained(folder, dtype=jnp.bfloat16)
    assert model.embed_tokens[...].dtype == jnp.bfloat16
    tokens, mask = padded_batch(128, seed=4)
    ours = np.asarray(model(tokens, attention_mask=mask))
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours[mask], hf_logits(hf, tokens, mask)[mask], atol=0.1)


def test_remat_changes_nothing_numerically(hf_checkpoint):
    import jax

    folder, _ = hf_checkpoint()
    plain, _ = rm.load_pretrained(folder)
    remat, _ = rm.load_pretrained(folder, remat="full")
    tokens, mask = padded_batch(128, seed=5)

    def loss_grad(model):
        graphdef, params = rm.split_params(model)
        loss = lambda p: rm.merge_params(graphdef, p)(tokens, attention_mask=mask).std()  # noqa: E731
        return jax.grad(loss)(params)

    for a, b in zip(jax.tree.leaves(loss_grad(plain)), jax.tree.leaves(loss_grad(remat)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_query_blocks_change_nothing_numerically(hf_checkpoint):
    """11 positions in blocks of 3 queries (the last one padded) = in one block: logits and every gradient."""
    import jax

    folder, _ = hf_checkpoint()
    whole, _ = rm.load_pretrained(folder)
    blocks, _ = rm.load_pretrained(folder, query_block=3, remat="dots")
    tokens, mask = padded_batch(128, seed=6)

    def logits_and_grad(model):
        graphdef, params = rm.split_params(model)
        loss = lambda p: rm.merge_params(graphdef, p)(tokens, attention_mask=mask).std()  # noqa: E731
        return np.asarray(model(tokens, attention_mask=mask)), jax.grad(loss)(params)

    def products(model):  # each block of queries is products of its own in the program
        graphdef, params = rm.split_params(model)
        return str(jax.make_jaxpr(lambda p: rm.merge_params(graphdef, p)(tokens, attention_mask=mask))(params)).count(
            "dot_general[")

    assert products(blocks) > products(whole)
    (a, grads_a), (b, grads_b) = logits_and_grad(whole), logits_and_grad(blocks)
    np.testing.assert_allclose(a, b, atol=1e-6)
    for x, y in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)


@pytest.mark.parametrize("name", ["untied_gqa_1e4_2l", "tied_mqa_1e6_1l"])
def test_fp32_gradients_match_transformers(hf_checkpoint, tmp_path, name):
    """d(sum of the real tokens' next-token log-probs) / d(every weight) = torch's backward through
    `Qwen2ForCausalLM`. The gradients are written as a checkpoint (`save_pretrained`) to compare them by name."""
    import jax
    import jax.numpy as jnp
    import torch
    from safetensors.numpy import load_file

    folder, hf = hf_checkpoint(**CASES[name])
    model, config = rm.load_pretrained(folder)
    tokens, mask = padded_batch(config.vocab_size, seed=2)
    counted = mask[:, :-1] & mask[:, 1:]  # a real token predicting the real token after it

    graphdef, params = rm.split_params(model)

    def loglik(params):
        logp = jax.nn.log_softmax(rm.merge_params(graphdef, params)(tokens, attention_mask=mask)[:, :-1], -1)
        return jnp.sum(jnp.where(counted, jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0], 0.0))

    grads = jax.jit(jax.grad(loglik))(params)
    rm.save_pretrained(rm.merge_params(graphdef, grads), tmp_path / "grads")
    ours = load_file(str(tmp_path / "grads" / "model.safetensors"))

    logits = hf(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64))).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[:, 1:, None])).squeeze(-1)
    (logp * torch.tensor(counted)).sum().backward()
    theirs = {n: p.grad.numpy() for n, p in hf.named_parameters()}
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    for n, g in ours.items():
        np.testing.assert_allclose(g, theirs[n], atol=2e-4, rtol=1e-3, err_msg=n)
