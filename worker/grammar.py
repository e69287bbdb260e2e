"""Compiling a request's `StructuredOutput` into xgrammar's token-level grammar: once per
distinct grammar, on a thread of its own, started before the step that needs it.

xgrammar needs the vocabulary as the model samples it: each token's text at its id (from the
model's tokenizer.json, as the `tokenizers` library reads it), padded with empty entries up to
the logits' width. xgrammar takes an empty entry for a special token and never allows it, so
the padding rows of the logits are masked; the tokenizer's other special tokens are blanked the
same way, so no grammar is ever satisfied by a control token whose text the API drops. The stop
token is the model's EOS, the one the engine's stop check ends a request on (engine/stop.py): a
grammar ends its output by allowing only EOS once it is complete.

`prefetch` starts compiling when a step that admits the request is submitted, so compiling
overlaps the step still running; the step that first samples for the request waits for it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import xgrammar as xgr
from tokenizers import Tokenizer

from engine.messages import INVALID_GRAMMAR, StructuredOutput
from worker.structured import InvalidGrammarError

# Compiled grammars kept for reuse: a service sees few distinct schemas, each used many times.
CACHE_SIZE = 64
# `json_object`: any JSON object. Compact whitespace for it and for schemas: a weak model given
# free whitespace can fill its whole budget with it and never close the object.
_ANY_OBJECT = '{"type": "object"}'
# "[12:00:00] /project/cpp/json_schema_converter.cc:4944: " before each of xgrammar's messages.
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


def tokenizer_info(model_dir: str, vocab_size: int, eos_token_id: int) -> xgr.TokenizerInfo:
    """xgrammar's view of the model's tokenizer, `vocab_size` (the logits' width) entries long."""
    path = Path(model_dir) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    vocab = [""] * vocab_size
    for text, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            vocab[token_id] = text
    for token_id, added in tokenizer.get_added_tokens_decoder().items():
        if added.special and token_id != eos_token_id and token_id < vocab_size:
            vocab[token_id] = ""
    # How the vocabulary encodes bytes (byte-level, byte fallback, raw), read from
    # tokenizer.json as xgrammar's own `from_huggingface` reads it.
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(path.read_text())
    return xgr.TokenizerInfo(
        vocab,
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=[eos_token_id],
        add_prefix_space=meta["add_prefix_space"],
    )


class GrammarCompiler:
    """Compiled grammars by (kind, text), compiled on one thread in the order asked for."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_id: int | None) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        # The tokenizer is read on the thread too: the first request's step need not wait for it.
        self._compiler = self._pool.submit(self._make_compiler, model_dir, vocab_size, eos_token_id)
        self._compiled: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # prefetch runs on the caller's thread, `get` on the stream's

    @staticmethod
    def _make_compiler(model_dir: str, vocab_size: int, eos_token_id: int | None) -> xgr.GrammarCompiler:
        if eos_token_id is None:
            raise InvalidGrammarError(f"{INVALID_GRAMMAR}the model has no EOS token to end a structured output with")
        # One cache, ours (bounded by count); xgrammar's would keep every grammar ever compiled.
        return xgr.GrammarCompiler(tokenizer_info(model_dir, vocab_size, eos_token_id), cache_enabled=False)

    def prefetch(self, structured: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        """Start compiling `structured` unless it is compiled or being compiled."""
        key = (structured.kind, structured.spec)
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._compiled[key] = self._pool.submit(self._compile, structured)
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
            return future

    def get(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar, waiting for it if need be; raises InvalidGrammarError."""
        return self.prefetch(structured).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        compiler = self._compiler.result()
        kind, spec = structured.kind, structured.spec
        try:
            if kind == "json_object":
                return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
            if kind == "json_schema":
                json.loads(spec)  # a JSON error in our words, before xgrammar's
                return compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "grammar":
                return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError) as e:
            raise InvalidGrammarError(f"{INVALID_GRAMMAR}{structured.param}: {_reason(e)}") from None
        raise InvalidGrammarError(f"{INVALID_GRAMMAR}{structured.param}: unknown kind {kind!r}")


def _reason(error: Exception) -> str:
    """xgrammar's message without its source location, first line only."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return _SOURCE_PREFIX.sub("", lines[0])
