"""GET /openapi.json: the OpenAPI 3.1 description of the OpenAI-compatible API, built from the
route table (server/routes.py) and the very msgspec Structs the routes decode (so the published
schema cannot drift from what is served and enforced: paths, integer bounds, required fields,
enums).

Litestar's own generator is off (app.py): the routes decode their bodies themselves, so it
would describe no request bodies. The admin API (/admin/*) is the console's and stays out.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import msgspec
from litestar import Request, Response, get

from appliance import __version__
from appliance.server.errors import ErrorBody
from appliance.server.routes import ROUTES

_REF = "#/components/schemas/{name}"


def _ref(schema: dict[str, Any]) -> dict[str, Any]:
    return {"$ref": schema["$ref"]} if "$ref" in schema else schema


@cache
def openapi_document() -> dict[str, Any]:
    types: list[Any] = [ErrorBody]
    for r in ROUTES:
        types += [t for t in (r.request, r.response) if t is not None]
    refs, components = msgspec.json.schema_components(types, ref_template=_REF)
    ref_of = dict(zip(map(id, types), refs, strict=True))
    error = {
        "description": "OpenAI's error body",
        "content": {"application/json": {"schema": _ref(ref_of[id(ErrorBody)])}},
    }
    paths: dict[str, Any] = {}
    for r in ROUTES:
        ok: dict[str, Any] = {"application/json": {"schema": _ref(ref_of[id(r.response)])}}
        if r.streams:  # "stream": true answers server-sent events
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        op: dict[str, Any] = {
            "summary": r.summary,
            "responses": {"200": {"description": "OK", "content": ok}, "4XX": error, "5XX": error},
        }
        names = re.findall(r"\{(\w+)\}", r.path)
        if names:
            op["parameters"] = [
                {"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                for n in names
            ]
        if r.request is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _ref(ref_of[id(r.request)])}},
            }
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "appliance: OpenAI-compatible API", "version": __version__},
        "paths": paths,
        "components": {"schemas": components},
    }


@get("/openapi.json", include_in_schema=False)
async def openapi_json(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(content=msgspec.json.encode(openapi_document()), media_type="application/json")
