"""The OpenAI-compatible API's routes, in one table.

`ROUTES` says, per endpoint, its method and path, the handler, the request body it takes and
the response it gives. The Litestar handlers (`router()`) and the published OpenAPI document
(server/openapi_doc.py) are both built from it, and so is the fuzz test's list of endpoints:
an endpoint cannot be served without being described, and its refusals get their request log
line (errors.py, by the handler's opt). Every other route (/admin/*, the ops endpoints,
/openapi.json itself) is registered with `include_in_schema=False`, and
tests/test_server_units.py fails on any served route that is neither.

Bodies are decoded here with msgspec, by the table's request type (not through Litestar's
`data:` injection), so that a schema error becomes one OpenAI-style 400 naming the field, and
so that the body is only read after the API key and readiness checks (guards) have passed.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from litestar import Request, Response, Router, route
from litestar.handlers import HTTPRouteHandler

from appliance.server import embeddings, openai, responses
from appliance.server import embeddings_schema as es
from appliance.server import responses_schema as rs
from appliance.server import schemas as s
from appliance.server.auth import api_key_guard
from appliance.server.errors import REQUEST_LOG_OPT

Handler = Callable[[Request[Any, Any, Any], Any], Awaitable[Response[Any]]]


@dataclass(frozen=True)
class Route:
    method: Literal["GET", "POST", "DELETE"]
    path: str
    # Called with the request and its body, decoded as `request` (None for a route without one).
    handler: Handler
    request: type[Any] | None
    response: type[Any]
    summary: str
    # "stream": true answers server-sent events.
    streams: bool = False


ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/v1/completions",
        openai.completions,
        s.CompletionRequest,
        s.CompletionResponse,
        "Completions",
        streams=True,
    ),
    Route(
        "POST",
        "/v1/chat/completions",
        openai.chat_completions,
        s.ChatCompletionRequest,
        s.ChatCompletionResponse,
        "Chat completions",
        streams=True,
    ),
    Route(
        "POST",
        "/v1/responses",
        responses.create_response,
        rs.ResponsesRequest,
        rs.ResponseObject,
        "Responses",
        streams=True,
    ),
    Route(
        "GET",
        "/v1/responses/{response_id}",
        responses.get_response,
        None,
        rs.ResponseObject,
        "A stored response",
    ),
    Route(
        "DELETE",
        "/v1/responses/{response_id}",
        responses.delete_response,
        None,
        rs.ResponseDeleted,
        "Delete a stored response",
    ),
    Route(
        "POST",
        "/v1/embeddings",
        embeddings.create_embeddings,
        es.EmbeddingRequest,
        es.EmbeddingResponse,
        "Embeddings",
    ),
    Route("GET", "/v1/models", openai.models, None, s.ModelList, "The served model"),
    Route(
        "POST",
        "/tokenize",
        openai.tokenize,
        s.TokenizeRequest,
        s.TokenizeResponse,
        "Tokenize (vLLM)",
    ),
    Route(
        "POST",
        "/detokenize",
        openai.detokenize,
        s.DetokenizeRequest,
        s.DetokenizeResponse,
        "Detokenize (vLLM)",
    ),
)


def _endpoint(r: Route) -> HTTPRouteHandler:
    async def endpoint(request: Request[Any, Any, Any]) -> Response[Any]:
        body = None if r.request is None else await openai.decode_body(request, r.request)
        return await r.handler(request, body)

    endpoint.__name__ = endpoint.__qualname__ = r.handler.__name__
    return route(
        # OpenAPI's {name} is Litestar's {name:str}.
        re.sub(r"\{(\w+)\}", r"{\1:str}", r.path),
        http_method=[r.method],
        status_code=200,
        summary=r.summary,
        opt={REQUEST_LOG_OPT: True},
    )(endpoint)


def router() -> Router:
    return Router(
        path="/",
        route_handlers=[_endpoint(r) for r in ROUTES],
        guards=[api_key_guard, openai.ready_guard],
    )
