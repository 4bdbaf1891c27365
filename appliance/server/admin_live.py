"""/admin/* levers smaller than a template apply, each recorded in the audit log:

- `PATCH /admin/config`: live knobs (live_config.py), applied by the engine core between two
  steps; answers the before/after diff.
- `POST /admin/classes/{name}/pause` (`?drain=true`) and `/resume`: one priority class stops
  taking requests (503 + Retry-After, code `class_paused`) while the others run on. Paused, its
  queued requests wait in the queue (the class's queue_timeout_s still applies); draining,
  they are served. Running requests always finish.
- `GET /admin/audit?since=&limit=`: the audit log's actions (audit.py).

Guarded by the admin token, as admin.py's routes (its router serves `patch_config`, beside
GET /admin/config: Litestar takes one route per path).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from litestar import Request, Response, Router, get, patch, post

from appliance.engine.client import EngineError
from appliance.server.audit import AuditRecord
from appliance.server.auth import admin_guard, bearer
from appliance.server.errors import APIError, bad_request
from appliance.server.live_config import LiveConfigError, plan_change
from appliance.server.state import ServerState

# Who asked, as the client says (the console sends "console"); recorded beside the token name.
CLIENT_HEADER = "x-appliance-client"
MAX_AUDIT_RECORDS = 10_000


def _state(request: Request[Any, Any, Any]) -> ServerState:
    return request.app.state.server


def _json(obj: Any, status: int = 200) -> Response[bytes]:
    return Response(
        content=msgspec.json.encode(obj), status_code=status, media_type="application/json"
    )


def actor_of(request: Request[Any, Any, Any]) -> str:
    """The admin token's name; an unnamed caller ("local", or an unnamed token's fingerprint)
    that says which client it is (X-Appliance-Client: console) is recorded as that client."""
    name = _state(request).auth.admin_name(bearer(request))
    client = request.headers.get(CLIENT_HEADER, "").strip()[:64]
    unnamed = name == "local" or name.startswith("token-")
    return client if client and unnamed else name


def _what(request: Request[Any, Any, Any], **more: Any) -> dict[str, Any]:
    client = request.headers.get(CLIENT_HEADER, "").strip()[:64]
    return {**({"via": client} if client else {}), **more}


def _require_engine(state: ServerState) -> None:
    client = state.client
    if state.phase != "ready" or client is None or client.dead:
        raise APIError(503, f"the server is {state.phase}; retry later", code=state.phase)


@patch("/admin/config", status_code=200)
async def patch_config(request: Request[Any, Any, Any]) -> Response[bytes]:
    state = _state(request)
    try:
        raw = msgspec.json.decode(await request.body())
    except msgspec.DecodeError as exc:
        raise bad_request(f"invalid JSON body: {exc}") from None
    async with _knob_lock(request):  # one change at a time: each plans from the last one's result
        return await _change_knobs(request, state, raw)


def _knob_lock(request: Request[Any, Any, Any]) -> asyncio.Lock:
    lock: asyncio.Lock | None = request.app.state.get("knob_lock")
    if lock is None:
        lock = request.app.state["knob_lock"] = asyncio.Lock()
    return lock


async def _change_knobs(
    request: Request[Any, Any, Any], state: ServerState, raw: Any
) -> Response[bytes]:
    _require_engine(state)
    client = state.client
    assert client is not None  # (checked)
    with state.audit.action(actor_of(request), "knob_change", _what(request, patch=raw)) as act:
        try:
            planned = plan_change(raw, state.config, client.built_config)
        except LiveConfigError as exc:
            act.fail("refused", str(exc))
            code = "reload_required" if exc.status == 409 else None
            raise APIError(exc.status, str(exc), param=exc.key or None, code=code) from None
        act.diff = planned.diff()
        step = None
        if planned.changes:
            try:
                step = await client.reconfigure(planned.config)
            except (EngineError, TimeoutError) as exc:
                act.fail("failed", str(exc))
                raise APIError(503, f"the engine core did not apply it: {exc}") from None
            if state.client is not client:  # a reload replaced the engine meanwhile
                act.fail("failed", "a template apply replaced the engine meanwhile")
                raise APIError(409, "a template apply replaced the engine meanwhile; retry")
            state.config = planned.config
            state.overrides = {**state.overrides, **planned.overrides()}
    return _json({"changed": planned.diff(), "applied_after_step": step})


def _known_class(state: ServerState, name: str) -> None:
    if name not in state.config.priority_classes:
        known = ", ".join(sorted(state.config.priority_classes)) or "none"
        raise APIError(
            404, f"no priority class {name!r} (known: {known})", param="name", code="not_found"
        )


def class_states(state: ServerState) -> dict[str, str]:
    """Every configured class's state: serving, paused or draining."""
    return {name: state.class_states.get(name, "serving") for name in state.config.priority_classes}


@post("/admin/classes/{name:str}/pause", status_code=200)
async def pause_class(
    request: Request[Any, Any, Any], name: str, drain: bool = False
) -> Response[bytes]:
    state = _state(request)
    _known_class(state, name)
    _require_engine(state)
    client = state.client
    assert client is not None  # (checked)
    how = "draining" if drain else "paused"
    action = "class_drain" if drain else "class_pause"
    with state.audit.action(actor_of(request), action, _what(request, priority_class=name)) as act:
        before = state.class_states.get(name, "serving")
        state.class_states[name] = how
        client.hold_class(name, not drain)
        act.diff = [{"key": f"classes.{name}", "before": before, "after": how}]
    state.metrics.set_class_state(name, how)
    return _json({"class": name, "state": how, "classes": class_states(state)})


@post("/admin/classes/{name:str}/resume", status_code=200)
async def resume_class(request: Request[Any, Any, Any], name: str) -> Response[bytes]:
    state = _state(request)
    _known_class(state, name)
    _require_engine(state)
    client = state.client
    assert client is not None  # (checked)
    what = _what(request, priority_class=name)
    with state.audit.action(actor_of(request), "class_resume", what) as act:
        before = state.class_states.pop(name, "serving")
        client.hold_class(name, False)
        act.diff = [{"key": f"classes.{name}", "before": before, "after": "serving"}]
    state.metrics.set_class_state(name, "serving")
    return _json({"class": name, "state": "serving", "classes": class_states(state)})


@get("/admin/classes")
async def list_classes(request: Request[Any, Any, Any]) -> Response[bytes]:
    return _json({"classes": class_states(_state(request))})


@get("/admin/audit")
async def audit(
    request: Request[Any, Any, Any], since: float = 0.0, limit: int = 1000
) -> Response[bytes]:
    """Actions started at or after `since` (Unix seconds; negative: that many seconds ago)."""
    if since < 0:
        since = time.time() + since
    limit = min(max(limit, 1), MAX_AUDIT_RECORDS)
    records: list[AuditRecord] = _state(request).audit.read(since, limit)
    return _json({"path": str(_state(request).audit.path), "records": records})


def router() -> Router:
    return Router(
        path="/",
        route_handlers=[pause_class, resume_class, list_classes, audit],
        guards=[admin_guard],
        include_in_schema=False,  # the console's API: not in /openapi.json
    )
