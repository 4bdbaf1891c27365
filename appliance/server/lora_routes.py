"""vLLM's LoRA endpoints: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with its
bodies (lora_name, lora_path), guarded by the admin token (loopback only when none is set).

A load reads and checks the adapter in the engine core and takes a slot (400 naming the field
for a bad adapter, 409 when every slot serves running requests); an unload answers once the
adapter's requests have finished, and new requests naming it get a 404 from then on."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, Router, post

from appliance.server.auth import admin_guard
from appliance.server.errors import APIError
from appliance.server.openai import decode_body
from appliance.server.state import ServerState


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    # vLLM accepts it; the appliance reads every adapter the same way.
    load_inplace: bool = False


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None


def _state(request: Request[Any, Any, Any]) -> ServerState:
    return request.app.state.server


def _client(state: ServerState) -> Any:
    client = state.client
    if client is None or client.dead or state.info is None:
        raise APIError(503, "the engine is not running", code="not_ready")
    return client


def _answer(
    state: ServerState, status: int, detail: str, adapters: dict[str, str]
) -> Response[str]:
    if state.info is not None:
        state.info.lora_adapters = adapters if state.info.lora_adapters is not None else None
    if status != 200:
        code = {404: "model_not_found", 409: "conflict"}.get(status, "invalid_lora")
        raise APIError(status, detail, param="lora_name", code=code)
    return Response(content=detail, status_code=200, media_type="text/plain")


@post("/v1/load_lora_adapter", status_code=200)
async def load_lora_adapter(request: Request[Any, Any, Any]) -> Response[str]:
    state = _state(request)
    body = await decode_body(request, LoadLoraAdapterRequest)
    reply = await _client(state).load_lora(body.lora_name, body.lora_path)
    return _answer(state, reply.status, reply.detail, reply.adapters)


@post("/v1/unload_lora_adapter", status_code=200)
async def unload_lora_adapter(request: Request[Any, Any, Any]) -> Response[str]:
    state = _state(request)
    body = await decode_body(request, UnloadLoraAdapterRequest)
    reply = await _client(state).unload_lora(body.lora_name)
    return _answer(state, reply.status, reply.detail, reply.adapters)


def router() -> Router:
    return Router(
        path="/",
        route_handlers=[load_lora_adapter, unload_lora_adapter],
        guards=[admin_guard],
        include_in_schema=False,  # an operator's lever, as /admin/*: not in /openapi.json
    )
