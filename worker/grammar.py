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
overlaps the step still running; the step that first samples for the request waits for it, but
only until `COMPILE_TIMEOUT_S` after compiling started: xgrammar's time grows steeply with some
schemas (an object of 1000 optional properties takes seconds, of 5000 minutes), and every
request of the step waits with it. A grammar not compiled by then fails its request as one
that does not compile; it goes on compiling on its thread, so the same grammar asked for again
finds it done.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import xgrammar as xgr
from tokenizers import Tokenizer

from engine.messages import INVALID_GRAMMAR, StructuredOutput
from worker.structured import InvalidGrammarError

# Compiled grammars kept for reuse: a service sees few distinct schemas, each used many times.
CACHE_SIZE = 64
COMPILE_TIMEOUT_S = 10.0
# Grammars compiled at once: one that takes long holds a thread, not every later request.
COMPILE_THREADS = 4
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


class _Rejected(ValueError):
    """xgrammar refused a grammar; the text says why. Cached with the grammar, so the error a
    request gets is made when it asks, naming its own field."""


class GrammarCompiler:
    """Compiled grammars by (kind, text), compiled on a few threads in the order asked for."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_id: int | None) -> None:
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        # The tokenizer is read on the thread too: the first request's step need not wait for it.
        self._compiler = self._pool.submit(self._make_compiler, model_dir, vocab_size, eos_token_id)
        # Each grammar's compile and when it was asked for (its deadline counts from then).
        self._compiled: OrderedDict[tuple[str, str], tuple[Future[xgr.CompiledGrammar], float]] = OrderedDict()
        self._lock = threading.Lock()  # prefetch runs on the caller's thread, `get` on the stream's

    @staticmethod
    def _make_compiler(model_dir: str, vocab_size: int, eos_token_id: int | None) -> xgr.GrammarCompiler:
        if eos_token_id is None:
            raise _Rejected("the model has no EOS token to end a structured output with")
        # One cache, ours (bounded by count); xgrammar's would keep every grammar ever compiled.
        return xgr.GrammarCompiler(tokenizer_info(model_dir, vocab_size, eos_token_id), cache_enabled=False)

    def prefetch(self, structured: StructuredOutput) -> tuple[Future[xgr.CompiledGrammar], float]:
        """Start compiling `structured` unless it is compiled or being compiled; its compile
        and when that started."""
        key = (structured.kind, structured.spec)
        with self._lock:
            entry = self._compiled.get(key)
            if entry is None:
                entry = self._compiled[key] = (self._pool.submit(self._compile, structured), time.monotonic())
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
            return entry

    def get(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar, waiting for it until `COMPILE_TIMEOUT_S` after compiling
        started; raises InvalidGrammarError."""
        future, started = self.prefetch(structured)
        try:
            return future.result(timeout=max(0.0, started + COMPILE_TIMEOUT_S - time.monotonic()))
        except FutureTimeout:
            why = (
                f"did not compile within {COMPILE_TIMEOUT_S:g} s (an object with fewer optional "
                "properties, or a simpler regex or grammar, compiles faster)"
            )
        except _Rejected as e:
            why = str(e)
        raise InvalidGrammarError(f"{INVALID_GRAMMAR}{structured.param}: {why}")

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
            raise _Rejected(_reason(e)) from None
        raise _Rejected(f"unknown kind {kind!r}")


def _reason(error: Exception) -> str:
    """xgrammar's message without its source location, first line only."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return _SOURCE_PREFIX.sub("", lines[0])
