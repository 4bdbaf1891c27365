"""One JSON line per API request on the `appliance.request` logger (journald, log shippers)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from litestar import Request

    from appliance.server.errors import APIError

logger = logging.getLogger("appliance.request")


class RequestLog:
    def __init__(self) -> None:
        self.count = 0

    def line(self, **fields: Any) -> None:
        self.count += 1
        if logger.isEnabledFor(logging.INFO):
            fields = {"ts": round(time.time(), 3), "event": "request", **fields}
            logger.info(msgspec.json.encode(fields).decode())

    def error_line(self, request: Request[Any, Any, Any], err: APIError) -> None:
        self.line(
            id=request.headers.get("x-request-id"),
            endpoint=request.url.path,
            status=err.status,
            error=err.code or err.type,
            message=err.message[:200],
        )


def configure_json_lines() -> None:
    """Request lines carry their own timestamp: print them bare, one JSON object a line."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
