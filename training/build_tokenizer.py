"""Byte-level tokenizer files for the shipped tiny model.

Every byte is one token and token id == byte value (0..255); ``<|endoftext|>``
(256) ends a generation and ``<|pad|>`` (257) fills batches. A byte vocabulary
needs no training data, encodes any UTF-8 text, and makes token counts equal byte
counts, which keeps prompt lengths (and so KV block counts) easy to reason about.

The model is a BPE with no merges over the GPT-2 byte-to-unicode alphabet, so the
standard ``ByteLevel`` pre-tokenizer and decoder of the ``tokenizers`` library do
the byte mapping and any HF-compatible client can load ``tokenizer.json``.

Run ``python -m training.build_tokenizer --out DIR`` to write the files alone;
``training.train_tiny`` writes them next to the checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
EOS_TOKEN_ID = 256
PAD_TOKEN_ID = 257
VOCAB_SIZE = 258
MODEL_MAX_LENGTH = 2048

# The model was trained on bare task text, so a chat request is rendered as the
# concatenation of its message contents: a user message holding an eval prompt is
# then exactly the prompt the model knows how to answer.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ``ByteLevel`` uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_tokenizer() -> Tokenizer:
    """The byte-level tokenizer with its two special tokens."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No prefix space and no regex split: the text maps to bytes exactly as written.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    if tokenizer.token_to_id(EOS_TOKEN) != EOS_TOKEN_ID or tokenizer.token_to_id(PAD_TOKEN) != PAD_TOKEN_ID:
        raise RuntimeError("special token ids moved; the model config depends on them")
    return tokenizer


def tokenizer_config() -> dict:
    """``tokenizer_config.json`` as ``transformers`` reads it."""
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(EOS_TOKEN_ID): {"content": EOS_TOKEN, **flags},
            str(PAD_TOKEN_ID): {"content": PAD_TOKEN, **flags},
        },
    }


def generation_config() -> dict:
    """``generation_config.json``: greedy by default, stop at ``<|endoftext|>``."""
    return {
        "bos_token_id": EOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "do_sample": False,
    }


def write_tokenizer_files(out_dir: str | Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    files = {"tokenizer_config.json": tokenizer_config(), "generation_config.json": generation_config()}
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write the tokenizer files into")
    write_tokenizer_files(parser.parse_args().out)


if __name__ == "__main__":
    main()
