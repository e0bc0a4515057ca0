"""Prompts: the DeepScaleR question format, the model's chat template, and fixed-shape left-padded batches.

A math problem becomes model input in three steps:

    question_text(problem)      "{problem} Let's think step by step and output the final answer within \\boxed{}."
    render(tokenizer, text)     the chat template; for DeepSeek-R1-Distill-Qwen:
                                "<｜begin▁of▁sentence｜><｜User｜>{text}<｜Assistant｜><think>\\n"
    tokenize_prompts(...)       token ids, left-padded into a [P, Tb] batch whose width Tb is one of a few buckets

The rendered text already holds BOS, so it is encoded with `add_special_tokens=False`; encoding it with the
tokenizer's defaults would put a second BOS in front. Buckets keep the number of distinct prompt shapes small,
so the jitted sampler compiles once per bucket instead of once per batch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np
import transformers

# The instruction DeepScaleR (rllm) appends to every training and evaluation problem, after one space.
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
# OlympiadBench prompts reach 1,254 tokens, AIME 1983-2023 ones 3,298
DEFAULT_BUCKETS = (128, 256, 512, 1024, 2048, 4096)

# Encoded and decoded by `load_tokenizer`: words, spaces, digits, punctuation and LaTeX all have to survive.
_SANITY_TEXT = "Hello, world! 12 + 30 = \\boxed{42}"


class TokenizerError(ValueError):
    """A tokenizer folder that r3jax cannot use: missing, without a chat template, or not round-tripping text."""


def question_text(problem: str) -> str:
    """The user message for a math problem, in the DeepScaleR format: the problem, one space, `INSTRUCTION`."""
    return f"{problem} {INSTRUCTION}"


def load_tokenizer(path: str | os.PathLike) -> transformers.PreTrainedTokenizerBase:
    """Loads the tokenizer of a local Hugging Face folder and checks that it can produce prompts.

    Fails loudly where a wrong tokenizer would otherwise fail silently: the folder must exist, must carry a chat
    template (`render` needs it), and must encode a short text to non-empty ids that decode back to that text.
    The last check catches a folder whose tokenizer_config.json names the wrong class (or none, next to a
    config.json that makes transformers guess one): such a tokenizer loads without error and returns empty or
    garbled ids. For byte-level BPE tokenizers (Qwen2, DeepSeek-R1-Distill) set
    `"tokenizer_class": "PreTrainedTokenizerFast"`.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise TokenizerError(f"tokenizer folder {path!r} does not exist (a local folder with tokenizer.json and "
                             "tokenizer_config.json is expected)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise TokenizerError(f"{path}: transformers could not load a tokenizer: {e}") from e
    if not tokenizer.chat_template:
        raise TokenizerError(f"{path}: the tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                             "or chat_template.jinja); prompts cannot be rendered")
    ids = encode(tokenizer, _SANITY_TEXT)
    decoded = tokenizer.decode(ids) if ids else ""
    if decoded != _SANITY_TEXT:
        raise TokenizerError(f"{path}: {type(tokenizer).__name__} does not round-trip text: {_SANITY_TEXT!r} -> "
                             f"ids {ids[:16]} -> {decoded!r}. Check 'tokenizer_class' in tokenizer_config.json "
                             "(byte-level BPE tokenizers need PreTrainedTokenizerFast)")
    return tokenizer


def render(tokenizer, user_text: str) -> str:
    """`user_text` as one user turn of the tokenizer's chat template, followed by the generation prompt.

    The text is used as is: math questions come from `question_text`, other prompts (e.g. reflection requests)
    are passed whole.
    """
    messages = [{"role": "user", "content": user_text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode(tokenizer, rendered: str) -> list[int]:
    """Token ids of already-rendered text; adds no special tokens (the template wrote BOS already)."""
    return tokenizer.encode(rendered, add_special_tokens=False)


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Prompts that fit, left-padded to one bucket width Tb, plus the positions of those that did not.

    tokens   [P, Tb] int32  prompt ids, right-aligned; pad id to their left
    mask     [P, Tb] bool   True on real tokens
    lengths  [P]     int32  real tokens per row
    kept     (P,)           row p is input text kept[p]
    dropped                 input texts longer than max_length, in input order; they have no row

    Left padding puts every prompt's last token in column Tb - 1, so generation starts at the same position for
    all rows. The row count P is whatever fitted: a caller that needs a fixed P (one compiled sampler shape)
    chooses its texts so, e.g. by drawing replacements for `dropped` from its data or by repeating real rows.
    Every row has at least one real token, as the sampler requires.
    """

    tokens: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    kept: tuple[int, ...]
    dropped: tuple[int, ...]

    @property
    def num_prompts(self) -> int:
        return self.tokens.shape[0]


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `length` tokens."""
    for bucket in sorted(buckets):
        if length <= bucket:
            return bucket
    raise ValueError(f"{length} tokens do not fit the largest bucket {max(buckets)}")


def tokenize_prompts(tokenizer, texts: Sequence[str], *, buckets: Sequence[int] = DEFAULT_BUCKETS,
                     max_length: int | None = None, pad_id: int | None = None,
                     render_template: bool = True) -> PromptBatch:
    """Renders, tokenizes and left-pads `texts` into a `PromptBatch` whose width is a bucket.

    texts: user messages, rendered through `render` first; with `render_template=False`, texts that are
      already rendered (template and BOS included) and are only encoded.
    max_length: prompts with more tokens are left out and listed in `dropped` (default: the largest bucket).
    pad_id: the id under the mask (default: the tokenizer's pad id, else its EOS id).
    The width Tb is the smallest bucket that holds the longest kept prompt (the smallest bucket if none is kept).
    """
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, not one string")
    buckets = sorted(buckets)
    if not buckets or buckets[0] < 1:
        raise ValueError(f"buckets {buckets} must be positive token counts")
    max_length = buckets[-1] if max_length is None else max_length
    if max_length > buckets[-1]:
        raise ValueError(f"max_length {max_length} exceeds the largest bucket {buckets[-1]}")
    pad_id = _pad_id(tokenizer) if pad_id is None else pad_id

    rendered = [render(tokenizer, t) for t in texts] if render_template else list(texts)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"] if rendered else []
    empty = [i for i, row in enumerate(ids) if not row]
    if empty:
        raise ValueError(f"texts {empty} encode to no tokens; the sampler needs at least one per prompt")
    kept = tuple(i for i, row in enumerate(ids) if len(row) <= max_length)
    dropped = tuple(i for i, row in enumerate(ids) if len(row) > max_length)

    lengths = np.array([len(ids[i]) for i in kept], np.int32)
    width = bucket_length(int(lengths.max(initial=1)), buckets)
    tokens = np.full((len(kept), width), pad_id, np.int32)
    for row, i in enumerate(kept):
        tokens[row, width - lengths[row]:] = ids[i]
    mask = np.arange(width)[None, :] >= width - lengths[:, None]  # [P, Tb]
    return PromptBatch(tokens=tokens, mask=mask, lengths=lengths, kept=kept, dropped=dropped)


def _pad_id(tokenizer) -> int:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token; pass pad_id")
    return pad_id


def decode_responses(tokenizer, tokens, lengths, truncated) -> list[str]:
    """Response texts of sampled rows: each row's first `lengths[b]` tokens without its end token (the
    last one, unless the row was truncated). Special tokens are kept (`</think>` must reach the grader)."""
    tokens, lengths, truncated = np.asarray(tokens), np.asarray(lengths), np.asarray(truncated)
    cut = np.where(truncated, lengths, np.maximum(lengths - 1, 0))
    return tokenizer.batch_decode([row[:n].tolist() for row, n in zip(tokens, cut, strict=True)],
                                  skip_special_tokens=False)
