"""Incremental detokenization and stop-string detection for one request."""

from __future__ import annotations

from typing import Protocol


class TokenDecoder(Protocol):
    """What turning token ids into text takes of a tokenizer (a transformers one has it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Emits text as tokens arrive without re-decoding the whole output each step: decode a
    short window and emit only once the window's text no longer ends in a partial character."""

    def __init__(
        self, tokenizer: TokenDecoder, stop: list[str], include_stop: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        # Text already handed to the caller (held back while it might start a stop string).
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one token; returns newly available text (may be empty)."""
        if self.stopped:
            return ""
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            self.text += full[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
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
