"""The ASGI proxy pieces `appliance route` (tools/router.py) and the cluster's ingress
(cluster/ingress.py) share: hop-by-hop headers dropped both ways, a bounded request body, a
relayed body that a client disconnect stops, a whole reply, and the OpenAI-shaped error body."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import httpx
import msgspec

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


# Hop-by-hop headers (RFC 9110 7.6.1) and those the proxy sets itself.
_DROP_REQUEST = {
    b"host",
    b"content-length",
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"te",
    b"trailer",
    b"upgrade",
    b"proxy-authorization",
    b"proxy-connection",
}
_DROP_RESPONSE = {
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"te",
    b"trailer",
    b"upgrade",
    b"proxy-authenticate",
}


def router_error(status: int, message: str, kind: str) -> bytes:
    return msgspec.json.encode(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    )


def proxied_request_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The client's headers as a proxy passes them on (hop-by-hop ones dropped)."""
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _DROP_REQUEST]
    client_addr = scope.get("client")
    if client_addr:
        headers.append((b"x-forwarded-for", client_addr[0].encode()))
    return headers


def proxied_response_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in response.headers.raw if k.lower() not in _DROP_RESPONSE]


async def read_body(receive: Receive, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not msg.get("more_body", False):
            break
    return b"".join(chunks)


async def pump_until_disconnect(
    pump: Coroutine[Any, Any, None], receive: Receive
) -> Exception | None:
    """Run `pump` (a response body's relay) until it ends or the client disconnects, which
    cancels it; the exception it ended with, if any (a cancellation is none)."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    pumping = asyncio.create_task(pump)
    watching = asyncio.create_task(watch())
    try:
        await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (pumping, watching):
            task.cancel()
        results = await asyncio.gather(pumping, watching, return_exceptions=True)
    ended = results[0]
    if isinstance(ended, Exception) and not isinstance(ended, asyncio.CancelledError):
        return ended
    return None


async def reply(
    send: Send,
    status: int,
    body: bytes,
    ctype: bytes = b"application/json",
    headers: list[tuple[bytes, bytes]] | None = None,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """A whole response: `headers` replaces the default ones (a relayed answer's own), `extra`
    adds to them."""
    if headers is None:
        headers = [(b"content-type", ctype)]
    headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    headers += [(b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
