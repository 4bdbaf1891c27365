"""GET /openapi.json: the OpenAPI 3.1 description of the OpenAI-compatible API, built from the
very msgspec Structs the routes decode (so the published schema cannot drift from what is
enforced: integer bounds, required fields, enums).

Litestar's own generator is off (app.py): the routes decode their bodies themselves, so it
would describe no request bodies. The admin API (/admin/*) is the console's and stays out.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec
from litestar import Request, Response, get

from appliance import __version__
from appliance.server import schemas as s
from appliance.server.errors import ErrorBody

_REF = "#/components/schemas/{name}"
# (method, path, request body type or None, response type, summary, streams)
_OPERATIONS: list[tuple[str, str, type | None, type, str, bool]] = [
    ("post", "/v1/completions", s.CompletionRequest, s.CompletionResponse, "Completions", True),
    (
        "post",
        "/v1/chat/completions",
        s.ChatCompletionRequest,
        s.ChatCompletionResponse,
        "Chat completions",
        True,
    ),
    ("get", "/v1/models", None, s.ModelList, "The served model", False),
    ("post", "/tokenize", s.TokenizeRequest, s.TokenizeResponse, "Tokenize (vLLM)", False),
    ("post", "/detokenize", s.DetokenizeRequest, s.DetokenizeResponse, "Detokenize (vLLM)", False),
]


def _ref(schema: dict[str, Any]) -> dict[str, Any]:
    return {"$ref": schema["$ref"]} if "$ref" in schema else schema


@cache
def openapi_document() -> dict[str, Any]:
    types: list[Any] = [ErrorBody]
    for _, _, req, resp, _, _ in _OPERATIONS:
        types += [t for t in (req, resp) if t is not None]
    refs, components = msgspec.json.schema_components(types, ref_template=_REF)
    ref_of = dict(zip(map(id, types), refs, strict=True))
    error = {
        "description": "OpenAI's error body",
        "content": {"application/json": {"schema": _ref(ref_of[id(ErrorBody)])}},
    }
    paths: dict[str, Any] = {}
    for method, path, req, resp, summary, streams in _OPERATIONS:
        ok: dict[str, Any] = {"application/json": {"schema": _ref(ref_of[id(resp)])}}
        if streams:  # "stream": true answers server-sent events
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        op: dict[str, Any] = {
            "summary": summary,
            "responses": {"200": {"description": "OK", "content": ok}, "4XX": error, "5XX": error},
        }
        if req is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _ref(ref_of[id(req)])}},
            }
        paths[path] = {method: op}
    return {
        "openapi": "3.1.0",
        "info": {"title": "appliance: OpenAI-compatible API", "version": __version__},
        "paths": paths,
        "components": {"schemas": components},
    }


@get("/openapi.json")
async def openapi_json(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(content=msgspec.json.encode(openapi_document()), media_type="application/json")
