from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from training.build_tokenizer import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    EOS_TOKEN_ID,
    PAD_TOKEN,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    build_tokenizer,
    write_tokenizer_files,
)

TEXTS = ["ab=123;?ab=", "", " leading  and trailing ", "héllo wörld\n\t日本 🤖", "\x00\x01\x7f", "<|endoftext"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return build_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_one_token_per_byte(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text).ids
    assert ids == list(text.encode())
    assert tokenizer.decode(ids) == text


def test_special_tokens(tokenizer: Tokenizer) -> None:
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert tokenizer.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID
    assert tokenizer.token_to_id(PAD_TOKEN) == PAD_TOKEN_ID
    ids = tokenizer.encode(f"a{EOS_TOKEN}b{PAD_TOKEN}").ids
    assert ids == [97, EOS_TOKEN_ID, 98, PAD_TOKEN_ID]
    assert tokenizer.decode(ids) == "ab"
    assert tokenizer.decode(ids, skip_special_tokens=False) == f"a{EOS_TOKEN}b{PAD_TOKEN}"


def test_written_files_agree(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path)
    loaded = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert loaded.encode("ab=1;").ids == [97, 98, 61, 49, 59]
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == EOS_TOKEN and config["pad_token"] == PAD_TOKEN
    assert config["chat_template"] == CHAT_TEMPLATE
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS_TOKEN_ID


def test_transformers_reads_the_files(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    write_tokenizer_files(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.eos_token_id == EOS_TOKEN_ID and hf.pad_token_id == PAD_TOKEN_ID
    assert hf("ab=1").input_ids == [97, 98, 61, 49]
    chat = hf.apply_chat_template([{"role": "user", "content": "ab=1;?ab="}], tokenize=False)
    assert chat == "ab=1;?ab="
