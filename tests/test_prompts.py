"""Prompts: the rebuilt R1-Distill tokenizer gives the hub's ids, the template renders the DeepScaleR prompt with
one BOS, and batches are left-padded into buckets with nothing dropped silently."""

import json
import pathlib

import numpy as np
import pytest
import r1_tokenizer  # tests/ is on sys.path: pytest prepends the rootdir of a test file without __init__.py

from r3jax.data import prompts

BOS_ID, EOS_ID = 151646, 151643
SHARED_R1 = pathlib.Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "deepseek-r1-distill-qwen"
MATH_STRINGS = [
    "Find $x$ if $\\frac{3}{x} + 2 = 5$.",
    "Let $f(x) = x^2 - 4x + 4$. Compute $\\sum_{k=1}^{10} f(k)$.\n\nGive the answer mod 1000.",
    "  Two  spaces, a tab\tand üñíçødé: α+β=γ, 1/2 ≤ √2, 中文, ｜full-width｜.",
    "</think>\n\nThe answer is $\\boxed{\\dfrac{\\pi}{4}}$.",
]


@pytest.fixture(scope="session")
def folder(tmp_path_factory):
    return r1_tokenizer.session_r1_distill_tokenizer(tmp_path_factory)


@pytest.fixture(scope="session")
def tokenizer(folder):
    return prompts.load_tokenizer(folder)  # the path users take


def rendered(problem):
    return f"<｜begin▁of▁sentence｜><｜User｜>{prompts.question_text(problem)}<｜Assistant｜><think>\n"


def test_hub_ids(tokenizer):
    text = "<｜begin▁of▁sentence｜><｜User｜>Hello, world!<｜Assistant｜>"
    assert tokenizer.encode(text, add_special_tokens=False) == [151646, 151644, 9707, 11, 1879, 0, 151645]
    assert len(tokenizer) == 151665
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (BOS_ID, EOS_ID, EOS_ID)
    assert tokenizer("2+2?")["input_ids"] == [BOS_ID, 17, 10, 17, 30]  # default encoding adds BOS once


def test_chat_template_ids(tokenizer):
    encoding = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
    assert encoding["input_ids"] == [151646, 151644, 17, 10, 17, 30, 151645, 151648, 198]


def test_chat_template_system_and_assistant_turns(tokenizer):
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                {"role": "system", "content": "S"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<｜begin▁of▁sentence｜>S<｜User｜>Q<｜Assistant｜>A<｜end▁of▁sentence｜>")


def test_question_text():
    assert prompts.question_text("What is 1+1?") == (
        "What is 1+1? Let's think step by step and output the final answer within \\boxed{}.")


def test_render_and_encode_one_bos(tokenizer):
    problem = "What is $1+1$?"
    text = prompts.render(tokenizer, prompts.question_text(problem))
    assert text == rendered(problem)
    ids = prompts.encode(tokenizer, text)
    assert ids[:2] == [BOS_ID, 151644] and ids.count(BOS_ID) == 1
    assert ids[-2:] == [151648, 198]  # <think> \n: generation starts inside the thinking block
    assert tokenizer.decode(ids) == text


def test_round_trip_math(tokenizer):
    for text in MATH_STRINGS:
        assert tokenizer.decode(prompts.encode(tokenizer, text)) == text


def test_left_padding_and_masks(tokenizer):
    problems = ["1+1?", "What is the sum of the first 100 positive integers, written in base 7?"]
    batch = prompts.tokenize_prompts(tokenizer, [prompts.question_text(p) for p in problems])
    assert batch.tokens.shape == batch.mask.shape == (2, 128)
    assert batch.tokens.dtype == np.int32 and batch.mask.dtype == bool
    assert batch.kept == (0, 1) and batch.dropped == ()
    for row, problem in enumerate(problems):
        n = int(batch.lengths[row])
        assert batch.mask[row].tolist() == [False] * (128 - n) + [True] * n  # left padding
        assert (batch.tokens[row, :128 - n] == EOS_ID).all()  # pad id: the tokenizer's pad (= EOS)
        real = batch.tokens[row][batch.mask[row]].tolist()
        assert real[0] == BOS_ID and real.count(BOS_ID) == 1
        assert tokenizer.decode(real) == rendered(problem)
    assert batch.lengths[0] < batch.lengths[1]


def test_bucket_is_smallest_that_fits(tokenizer):
    long = "x " * 150  # 156 tokens rendered
    batch = prompts.tokenize_prompts(tokenizer, ["short", long])
    assert 128 < batch.lengths.max() <= 256 and batch.tokens.shape == (2, 256)
    assert prompts.bucket_length(16, (16, 32)) == 16 and prompts.bucket_length(17, (32, 16)) == 32
    with pytest.raises(ValueError, match="largest bucket 32"):
        prompts.bucket_length(33, (16, 32))


def test_too_long_prompts_are_listed(tokenizer):
    texts = ["a", "word " * 40, "b", "word " * 20]  # rendered: 6, 46, 6, 26 tokens
    batch = prompts.tokenize_prompts(tokenizer, texts, buckets=(16, 32, 64), max_length=32)
    assert batch.kept == (0, 2, 3) and batch.dropped == (1,)
    assert batch.tokens.shape == (3, 32)
    kept_texts = [tokenizer.decode(batch.tokens[p][batch.mask[p]]) for p in range(3)]
    assert kept_texts == [prompts.render(tokenizer, texts[i]) for i in batch.kept]

    none_fit = prompts.tokenize_prompts(tokenizer, ["word " * 40], buckets=(16, 64), max_length=16)
    assert none_fit.kept == () and none_fit.dropped == (0,) and none_fit.tokens.shape == (0, 16)


def test_prerendered_texts_and_pad_id(tokenizer):
    texts = ["1+1?", "2+2?"]
    from_user = prompts.tokenize_prompts(tokenizer, texts, buckets=(16,), pad_id=0)
    from_rendered = prompts.tokenize_prompts(
        tokenizer, [prompts.render(tokenizer, t) for t in texts], buckets=(16,), pad_id=0, render_template=False)
    np.testing.assert_array_equal(from_user.tokens, from_rendered.tokens)
    np.testing.assert_array_equal(from_user.mask, from_rendered.mask)
    assert (from_user.tokens[~from_user.mask] == 0).all()


def test_bad_arguments(tokenizer):
    with pytest.raises(TypeError, match="not one string"):
        prompts.tokenize_prompts(tokenizer, "1+1?")
    with pytest.raises(ValueError, match=r"texts \[1\] encode to no tokens"):
        prompts.tokenize_prompts(tokenizer, ["a", ""], render_template=False)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        prompts.tokenize_prompts(tokenizer, ["a"], buckets=(16,), max_length=17)


@pytest.mark.skipif(not SHARED_R1.is_dir(), reason="needs ../shared/tokenizers (the workspace's reference copy)")
def test_matches_shared_reconstruction(tokenizer):
    reference = prompts.load_tokenizer(SHARED_R1)
    assert len(reference) == len(tokenizer)
    assert reference.get_vocab() == tokenizer.get_vocab()
    for text in MATH_STRINGS:
        user = prompts.question_text(text)
        assert prompts.render(reference, user) == prompts.render(tokenizer, user)
        assert prompts.encode(reference, text) == prompts.encode(tokenizer, text)
        assert reference(text)["input_ids"] == tokenizer(text)["input_ids"]  # BOS post-processor too


def test_missing_folder(tmp_path):
    with pytest.raises(prompts.TokenizerError, match="does not exist"):
        prompts.load_tokenizer(tmp_path / "nope")


def tiny_tokenizer_folder(folder, *, tokenizer_config=None, model_config=None):
    """A 3-word WordLevel tokenizer: loads in well under a second, round-trips only 'hello world'."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    tiny = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tiny.pre_tokenizer = pre_tokenizers.Whitespace()
    tiny.save(str(folder / "tokenizer.json"))
    for name, content in (("tokenizer_config.json", tokenizer_config), ("config.json", model_config)):
        if content is not None:
            (folder / name).write_text(json.dumps(content))
    return folder


def test_folder_without_chat_template(tmp_path):
    tiny_tokenizer_folder(tmp_path, tokenizer_config={"tokenizer_class": "PreTrainedTokenizerFast"})
    with pytest.raises(prompts.TokenizerError, match="no chat template"):
        prompts.load_tokenizer(tmp_path)


def test_empty_folder(tmp_path):
    with pytest.raises(prompts.TokenizerError, match="could not load a tokenizer"):
        prompts.load_tokenizer(tmp_path)


def test_silently_wrong_tokenizer_is_caught(tmp_path):
    # The ENV-NOTES trap: no tokenizer_class next to a qwen2 config.json makes transformers build an (empty)
    # Qwen2 BPE tokenizer that returns [] for every text instead of failing.
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tiny_tokenizer_folder(tmp_path, tokenizer_config={"chat_template": template}, model_config={"model_type": "qwen2"})
    with pytest.raises(prompts.TokenizerError, match=r"does not round-trip text.*ids \[\]"):
        prompts.load_tokenizer(tmp_path)
