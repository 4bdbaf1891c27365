"""Incremental detokenization and stop-string detection for one request."""

from __future__ import annotations

import logging
from typing import Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

log = logging.getLogger("appliance.detokenizer")


class TokenDecoder(Protocol):
    """What turning token ids into text takes of a tokenizer (a transformers one has it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class TextStream(Protocol):
    """One request's output ids in, the text each one makes final out."""

    def step(self, token_id: int) -> str:
        """Append one token; returns the text it completes ("" while a character is partial)."""
        ...


class WindowTextStream:
    """Any `TokenDecoder`: decode a short window and emit only once the window's text no
    longer ends in a partial character (two `decode` calls a token)."""

    def __init__(self, tokenizer: TokenDecoder) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return full[len(prefix_text) :]
        return ""


class RustTextStream:
    """A Hugging Face fast tokenizer's own incremental decoder (`tokenizers`' DecodeStream,
    which vLLM's fast detokenizer uses too): one call into Rust a token instead of two trips
    through transformers' `decode` (0.5 vs 5.7 us a token, SmolLM's tokenizer; Sapphire
    Rapids). Should the stream ever refuse a token, the request goes on with the window
    decoder over the same ids, so its text is never lost."""

    def __init__(self, backend: Tokenizer, tokenizer: TokenDecoder) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.stream: DecodeStream | None = DecodeStream(skip_special_tokens=True)
        self.tokens: list[int] = []
        self.window: WindowTextStream | None = None

    def step(self, token_id: int) -> str:
        self.tokens.append(token_id)
        if self.stream is not None:
            try:
                return self.stream.step(self.backend, token_id) or ""
            except Exception as exc:  # the tokenizers library's own refusal, whatever its type
                log.warning("incremental decoding fell back to the window decoder: %s", exc)
                self.stream = None
                self.window = WindowTextStream(self.tokenizer)
                for earlier in self.tokens[:-1]:  # their text went out already
                    self.window.step(earlier)
        assert self.window is not None
        return self.window.step(token_id)


def text_stream(tokenizer: TokenDecoder) -> TextStream:
    """The fastest stream the tokenizer allows: transformers' fast tokenizers expose their
    `tokenizers.Tokenizer` as `backend_tokenizer`; anything else decodes through a window, and
    so does a tokenizer whose `decode` cleans up spaces before punctuation (the Rust stream
    does not: its text would differ from the tokenizer's own)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    ):
        return RustTextStream(backend, tokenizer)
    return WindowTextStream(tokenizer)


class IncrementalDetokenizer:
    """Emits text as tokens arrive without re-decoding the whole output each step, holding
    back a tail that could still grow into a stop string."""

    def __init__(
        self, tokenizer: TokenDecoder, stop: list[str], include_stop: bool = False
    ) -> None:
        self.stream = text_stream(tokenizer)
        self.stop = stop
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        # Text already handed to the caller (held back while it might start a stop string).
        self.emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; returns newly available text (may be empty)."""
        if self.stopped:
            return ""
        self.text += self.stream.step(token_id)
        if self.stop:
            self._check_stop()
        # Hold back a tail that could still grow into a stop string.
        if self.stopped or not self.stop:
            safe = len(self.text)
        else:
            safe = max(self.emitted, len(self.text) - self.max_stop_len + 1)
        new = self.text[self.emitted : safe]
        self.emitted = max(self.emitted, safe)
        return new

    def _check_stop(self) -> None:
        # Only the newly decoded tail can complete a stop string.
        search_from = max(0, self.emitted - self.max_stop_len)
        best = None
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
            self.stopped = True

    def flush(self) -> str:
        """Text still held back when the request ends."""
        new = self.text[self.emitted :]
        self.emitted = len(self.text)
        return new
