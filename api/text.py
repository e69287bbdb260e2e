"""Text in and out of the engine: tokenizing prompts, rendering chats, and turning streamed token
ids back into text that never shows a stop string or half a character.

The engine only knows token ids. It stops *after* the token that completes a stop string, so
the text API must cut the string off, and while streaming it must hold back any tail that may
still become the start of a stop string.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from engine.messages import InvalidRequestError
from engine.stop import truncate_at_stop
from models.model_files import load_chat_template, load_config, load_generation_config

# Prompt tokens decoded ahead of the output, so a decoder that joins tokens with spaces
# (word-level) or merges bytes (byte-level) renders the first output token as it would in
# the middle of the text. As in vLLM.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"  # what a byte-level decoder shows for a partial UTF-8 sequence
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for the message a reply continues


class TemplateError(ValueError):
    """The chat cannot be rendered with the model's template (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class TextModel:
    """What the ingress needs of a model directory: its tokenizer, chat template, EOS and context."""

    tokenizer: Tokenizer
    chat_template: str | None
    eos_token_id: int | None
    max_model_len: int
    vocab_size: int
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as templates expect them

    @classmethod
    def load(cls, model_dir: str, max_model_len: int | None = None) -> TextModel:
        path = Path(model_dir)
        model_cfg = load_config(path)
        _, eos = load_generation_config(path, model_cfg)
        chat = load_chat_template(path)
        return cls(
            Tokenizer.from_file(str(path / "tokenizer.json")),
            chat.template,
            eos,
            max_model_len or model_cfg.max_position_embeddings,
            model_cfg.vocab_size,
            chat.special_tokens,
        )

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def check_ids(self, ids: Sequence[int], param: str = "prompt") -> None:
        """Token ids from a client, checked before they can reach (and crash) the model."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", param=param
            )

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt for a chat: the model's template when it has one, rendered as transformers'
        `apply_chat_template` renders it (in a sandbox, `tools` and the generation prompt as its
        variables, its `tojson`, its way of leaving the last message open), else the built-in
        one: the message contents, one a line."""
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError(
                "continue_final_message needs add_generation_prompt set to false", param="continue_final_message"
            )
        if self.chat_template is None:
            if tools:
                raise InvalidRequestError("the model has no chat template to show it the tools", param="tools")
            return "\n".join(m["content"] for m in messages)
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # only models that ship a template need jinja2
            raise TemplateError(f"the model's chat template needs jinja2, which is not installed: {e}") from None

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False) -> str:
            # Jinja's own escapes HTML and sorts keys; templates are written against transformers' one.
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = tojson
        if continue_final_message:  # marked, so the text after the last message can be cut off
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
        try:
            template = env.from_string(self.chat_template)
            variables = {"messages": messages, "documents": None, "add_generation_prompt": add_generation_prompt}
            text = template.render(tools=tools, **variables, **self.special_tokens)
            # A template that leaves the tools out would have the model answer without them.
            if tools and text == template.render(tools=None, **variables, **self.special_tokens):
                raise InvalidRequestError("the model's chat template does not show tools to the model", param="tools")
        except jinja2.TemplateError as e:
            raise TemplateError(f"cannot render the chat template: {e}") from None
        if not continue_final_message:
            return text
        end = text.rfind(_CONTINUE_TAG.strip())
        if end < 0:
            raise TemplateError("the chat template drops the final message, so it cannot be continued")
        # A template that trims the message's trailing space trims the tag's too.
        return text[:end] if text.startswith(_CONTINUE_TAG, end) else text[:end].rstrip()


class Detokenizer:
    """Token ids in, new text out, one increment per call (vLLM's prefix/read offsets).

    Each call decodes a short window that ends at the newest token and returns what it added
    to the text already returned; text that ends in half a UTF-8 character waits for the
    token that completes it."""

    def __init__(self, model: TextModel, prompt_ids: Sequence[int], skip_eos: bool) -> None:
        self._model = model
        self._skip = model.eos_token_id if skip_eos else None
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        # EOS ends a generation; it is counted in usage but is not text.
        self._ids.extend(t for t in token_ids if t != self._skip)
        decode = self._model.tokenizer.decode
        before = decode(self._ids[self._prefix : self._read])
        text = decode(self._ids[self._prefix :])
        if len(text) <= len(before) or (text.endswith(_INCOMPLETE) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before) :]


class StopBuffer:
    """Output text with stop strings applied: `push` returns what may be shown now."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.text = ""
        self.sent = 0
        self.stopped = False  # a stop string was found: the text ends before it

    def pass_through(self, new: str) -> str:
        """Text no stop string may end in, shown at once: the outputs before `min_tokens`, in
        which vLLM looks for no stop string either."""
        self.text += new
        self.sent = len(self.text)
        return new

    def push(self, new: str, final: bool) -> str:
        self.text += new
        if self.stop:
            # A stop string cannot start in text already sent: its start would have been held back.
            unsent = self.text[self.sent :]
            cut = truncate_at_stop(unsent, self.stop)
            if len(cut) < len(unsent):
                self.text = self.text[: self.sent] + cut
                self.stopped = final = True
        end = len(self.text) if final else len(self.text) - self._held()
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def _held(self) -> int:
        """Length of the longest tail of the text that is the start of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text) - self.sent), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest
