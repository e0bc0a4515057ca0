"""A toy task that runs anywhere: a byte-level tokenizer with R1-Distill's chat format, and arithmetic problems.

`configs/tiny.py` trains a random tiny model on it in seconds, with no download and no `../shared`: the files
live in `configs/tiny/` and are rebuilt bit for bit by `python -m r3jax.data.toy configs/tiny` (a test checks).

The tokenizer is byte-level BPE with no merges: 256 byte tokens (GPT-2's byte-to-unicode alphabet, so every
text round-trips) plus R1-Distill's special tokens and a chat template that renders
`<｜begin▁of▁sentence｜><｜User｜>{question}<｜Assistant｜><think>\\n` like the real one. Ids are small (vocabulary
263), so a tiny model's head is cheap.
"""

from __future__ import annotations

import json
import pathlib
import random
import sys

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
PAD = "<｜▁pad▁｜>"
THINK = ("<think>", "</think>")
SPECIAL_TOKENS = (EOS, BOS, USER, ASSISTANT, PAD, *THINK)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
                 "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
                 "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")


def byte_alphabet() -> list[str]:
    """The 256 printable characters byte-level BPE uses for bytes 0..255 (GPT-2's table), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def build_tokenizer(folder: str | pathlib.Path) -> pathlib.Path:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json into `folder`."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(byte_alphabet())}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # <think> and </think> are added but not "special" (as in R1-Distill): decoding keeps them for the grader
    tok.add_tokens([tokenizers.AddedToken(t, special=t not in THINK, normalized=False) for t in SPECIAL_TOKENS])
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
              "add_bos_token": False, "model_max_length": 4096, "chat_template": CHAT_TEMPLATE,
              "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, ensure_ascii=False) + "\n")
    return folder


def arithmetic_problems(n: int, *, seed: int, max_operand: int = 9) -> list[dict]:
    """n distinct problems "a + b" / "a - b" / "a * b" with single-digit operands, as {problem, answer} rows."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice("+-*")
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"problem": f"What is {a} {op} {b}?", "answer": str(value)})
    return rows


def write_assets(folder: str | pathlib.Path) -> None:
    """The tiny config's files: `tokenizer/`, `train.jsonl` (64 problems), `eval.jsonl` (16 others)."""
    folder = pathlib.Path(folder)
    build_tokenizer(folder / "tokenizer")
    rows = arithmetic_problems(80, seed=0)
    for name, part in (("train.jsonl", rows[:64]), ("eval.jsonl", rows[64:])):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    write_assets(sys.argv[1] if len(sys.argv) > 1 else "configs/tiny")
