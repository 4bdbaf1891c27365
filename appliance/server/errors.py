"""One exception handler: every error leaves as OpenAI's body,
`{"error": {"message", "type", "param", "code"}}`, with the right status (and Retry-After)."""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

log = logging.getLogger("appliance.server")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
_CODES = {
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}
# The handler opt that marks an API route (server/routes.py): its errors get a request log line.
REQUEST_LOG_OPT = "request_log"
# msgspec names the offending field as "... - at `$.field[0].sub`".
_PATH = re.compile(r"at `\$\.?([^`]*)`")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _CODES.get(status)
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}
        # Set once the request's JSON line has been written (so the handler does not repeat it).
        self.logged = False


class ClientGone(APIError):
    """The client disconnected before the answer was ready (nginx's 499)."""

    def __init__(self) -> None:
        super().__init__(499, "client disconnected", code="client_closed_request")
        self.logged = True


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct):
    error: ErrorInfo


def error_body(err: APIError) -> bytes:
    return msgspec.json.encode(ErrorBody(ErrorInfo(err.message, err.type, err.param, err.code)))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation(exc: msgspec.ValidationError | msgspec.DecodeError) -> APIError:
    """A body that does not match its schema: 400 naming the field (and the limit msgspec
    states, e.g. "Expected `int` >= 1 - at `$.n`")."""
    text = str(exc)
    m = _PATH.search(text)
    param = m.group(1) if m else None
    return bad_request(f"invalid request body: {text}", param=param)


def to_api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, msgspec.ValidationError | msgspec.DecodeError):
        return from_validation(exc)
    if isinstance(exc, ValidationException):
        extra: Any = exc.extra
        msg = exc.detail
        if isinstance(extra, list) and extra and isinstance(extra[0], dict):
            msg = str(extra[0].get("message", msg))
        err = bad_request(msg)
        m = _PATH.search(msg)
        err.param = m.group(1) if m else None
        return err
    if isinstance(exc, HTTPException):
        status = exc.status_code
        message = exc.detail
        if status == 413:
            message = "request body too large"
        return APIError(status, message, headers=dict(exc.headers or {}))
    log.exception("unhandled error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}")


def exception_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    err = to_api_error(exc)
    # A refused API request gets its request log line too: the routes of server/routes.py's
    # table say so in their handler's opt (a line already written is not repeated).
    handler = request.scope.get("route_handler")
    state = getattr(request.app.state, "server", None)
    if (
        state is not None
        and not err.logged
        and handler is not None
        and handler.opt.get(REQUEST_LOG_OPT)
    ):
        state.request_log.error_line(request, err)
    return Response(
        content=error_body(err),
        status_code=err.status,
        media_type="application/json",
        headers=err.headers,
    )
