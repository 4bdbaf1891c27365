"""A relayed SSE stream that loses its replica mid-way must end visibly: the guard follows
the OpenAI chunks it relays (id, object, model, which choices have finished) and, when the
upstream breaks, writes what the appliance's own drain cut writes (server/generate.py `cut`):
each open choice's last chunk with finish_reason "abort", then an error event, which OpenAI's
SDKs raise, then [DONE]."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from appliance.server.format import error_event

FINISH_REASON = "abort"


class _ReplicaLost:
    """The error the stream ends with (the fields error_event reads)."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.type = "upstream_error"
        self.param = None
        self.code = "replica_lost"


class StreamGuard:
    def __init__(self) -> None:
        self._pending = b""
        self.head: dict[str, Any] = {}
        self.open_choices: set[int] = set()
        self.finished_choices: set[int] = set()
        self.done = False

    def feed(self, chunk: bytes) -> None:
        self._pending += chunk
        while b"\n\n" in self._pending:
            event, self._pending = self._pending.split(b"\n\n", 1)
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        try:
            body = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return
        if not isinstance(body, dict) or "choices" not in body:
            return
        self.head = {k: body.get(k) for k in ("id", "object", "created", "model")}
        for choice in body.get("choices") or []:
            index = int(choice.get("index", 0))
            if choice.get("finish_reason") is not None:
                self.finished_choices.add(index)
                self.open_choices.discard(index)
            elif index not in self.finished_choices:
                self.open_choices.add(index)

    def tail(self, message: str) -> bytes:
        """What ends the stream after the upstream broke."""
        if self.done:
            return b""
        chat = self.head.get("object") == "chat.completion.chunk"
        head = {
            "id": self.head.get("id") or "cmpl-lost",
            "object": self.head.get("object") or "text_completion",
            "created": self.head.get("created") or int(time.time()),
            "model": self.head.get("model") or "",
        }
        parts: list[bytes] = []
        for index in sorted(self.open_choices or ({0} - self.finished_choices)):
            choice: dict[str, Any] = {"index": index, "finish_reason": FINISH_REASON}
            if chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            parts.append(b"data: " + msgspec.json.encode({**head, "choices": [choice]}) + b"\n\n")
        parts.append(error_event(_ReplicaLost(message)))
        parts.append(b"data: [DONE]\n\n")
        return b"".join(parts)
