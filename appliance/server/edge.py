"""The HTTP edge: requests the app never sees still get OpenAI's error body.

uvicorn's h11 protocol answers a request it cannot parse (headers over its limit, malformed
request lines) with a plain-text 400 "Invalid HTTP request received." before any ASGI app runs.
A gateway or an OpenAI SDK then gets no JSON to read. This protocol sends the same refusal as
`{"error": {...}}`, with h11's own status hint: 431 for headers over `server.max_header_bytes`,
400 for the rest.
"""

from __future__ import annotations

from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from appliance.server.errors import APIError, error_body

_PHRASES = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}


class OpenAIErrorH11Protocol(H11Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._protocol_error: h11.RemoteProtocolError | None = None
        # h11 raises inside uvicorn's event loop, which swallows the exception and keeps only a
        # fixed message: remember it on the way out to answer with its status hint.
        inner = self.conn.next_event

        def next_event() -> Any:
            try:
                return inner()
            except h11.RemoteProtocolError as exc:
                self._protocol_error = exc
                raise

        self.conn.next_event = next_event  # type: ignore[method-assign]

    def send_400_response(self, msg: str) -> None:
        exc = self._protocol_error
        status = exc.error_status_hint if exc is not None else 400
        status = status if status in _PHRASES else 400
        max_size = self.conn._max_incomplete_event_size  # what h11 was configured with
        if status == 431:
            message = f"request headers too large: more than {max_size} bytes"
        else:
            message = f"invalid HTTP request: {exc or msg}"
        err = APIError(
            status,
            message,
            code="request_header_too_large" if status == 431 else "invalid_http_request",
            type="invalid_request_error",
        )
        body = error_body(err)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        # h11 lets a server answer a client's protocol error (as uvicorn's own 400 does).
        data = (
            self.conn.send(
                h11.Response(status_code=status, headers=headers, reason=_PHRASES[status])
            )
            or b""
        )
        data += self.conn.send(h11.Data(data=body)) or b""
        data += self.conn.send(h11.EndOfMessage()) or b""
        self.transport.write(data)
        self.transport.close()
