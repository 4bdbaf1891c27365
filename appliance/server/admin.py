"""/admin/*: the console's view of the engine and the operator's levers (reload, abort,
pause/resume).
Guarded by the admin token (loopback only when none is configured)."""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
from litestar import Request, Response, Router, get, post

from appliance.config import ConfigError, config_to_toml_dict
from appliance.engine.client import EngineError
from appliance.server import audited
from appliance.server.admin_live import actor_of, class_states, patch_config
from appliance.server.admin_schema import AdminStats, ConfigRef, ServerInfo
from appliance.server.auth import admin_guard
from appliance.server.errors import APIError, bad_request
from appliance.server.openai import decode_body
from appliance.server.state import ServerState

MAX_HISTORY_S = 600.0


class ReloadRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # A template name or path; None reloads the running template (re-read from disk).
    template: str | None = None
    # Dotted keys, as `appliance up --set`: {"scheduler.max_num_seqs": 32}.
    overrides: dict[str, Any] | None = None
    # The console's "roll back" (the template that ran before): recorded as a rollback.
    rollback: bool = False


def _state(request: Request[Any, Any, Any]) -> ServerState:
    return request.app.state.server


def _json(obj: Any, status: int = 200) -> Response[bytes]:
    return Response(
        content=msgspec.json.encode(obj), status_code=status, media_type="application/json"
    )


def _config_ref(state: ServerState) -> ConfigRef:
    return ConfigRef(
        template=state.template,
        path=state.template_path,
        overrides=state.overrides,
        description=state.config.description,
    )


@get("/admin/stats")
async def stats(
    request: Request[Any, Any, Any], history_s: float = 60.0, count_objects: bool = False
) -> Response[bytes]:
    state = _state(request)
    history_s = min(max(history_s, 0.0), MAX_HISTORY_S)
    reply = None
    client = state.client
    if client is not None and not client.dead:
        try:
            reply = await client.stats(
                history_s=history_s, detail=True, count_objects=count_objects
            )
        except (TimeoutError, EngineError):
            reply = None
    info = state.info
    snap = reply.snapshot if reply else None
    body = AdminStats(
        time=time.time(),
        model_name=state.model_name,
        model_dir=info.model_dir if info else "",
        max_model_len=info.max_model_len if info else 0,
        device=info.device if info else "",
        dtype=info.dtype if info else "",
        backend=info.backend if info else {},
        config=_config_ref(state),
        server=ServerInfo(
            phase=state.phase,
            phase_detail=state.phase_detail,
            pid=os.getpid(),
            core_pid=info.pid if info and client is not None else None,
            uptime_s=time.monotonic() - state.started_at,
            ready_after_s=state.ready_after_s,
            startup_phases=state.startup_phases,
            requests_in_flight=len(state.inflight),
            requests_served=state.request_log.count,
            engine_generation=state.engine_generation,
            paused=state.paused,
            requests_tracked=len(client.output) if client is not None else 0,
            last_reload=state.last_reload,
            class_states=class_states(state),
        ),
        engine=snap.engine if snap else None,
        history=snap.history if snap else [],
        history_s=history_s,
        preemptions=snap.preemptions if snap else [],
        requests=snap.requests if snap else [],
        queues=snap.queues if snap else [],
        engine_objects=reply.live_objects if reply else {},
    )
    return _json(body)


@get("/admin/config")
async def config(request: Request[Any, Any, Any]) -> Response[bytes]:
    state = _state(request)
    return _json(
        {**msgspec.to_builtins(_config_ref(state)), "config": config_to_toml_dict(state.config)}
    )


@post("/admin/reload", status_code=200)
async def reload(request: Request[Any, Any, Any]) -> Response[bytes]:
    state = _state(request)
    body = await decode_body(request, ReloadRequest)
    if state.phase not in ("ready", "reloading"):
        raise APIError(503, f"cannot reload while {state.phase}", code=state.phase)
    template = body.template if body.template is not None else state.template
    try:
        overrides = {**state.pinned_overrides, **(body.overrides or {})}
        action = "rollback" if body.rollback else "template_apply" if body.template else "reload"
        result = await audited.reload(state, template, overrides, actor_of(request), action)
    except ConfigError as exc:
        raise bad_request(f"reload refused, nothing changed: {exc}", param="template") from None
    except EngineError as exc:
        raise APIError(500, str(exc), code="reload_failed") from None
    return _json({**result, "config": config_to_toml_dict(state.config)})


@post("/admin/abort/{request_id:str}", status_code=200)
async def abort(request: Request[Any, Any, Any], request_id: str) -> Response[bytes]:
    """Abort an API request (all its choices) or one engine request ("<id>-<choice>")."""
    state = _state(request)
    for gen in list(state.inflight):
        ids = [ch.request_id for ch in gen.choices]
        if request_id == gen.request_id or request_id in ids:
            gen.abort("aborted by the operator")
            return _json({"aborted": ids})
    raise APIError(404, f"no request {request_id!r} in flight", param="request_id")


def _set_paused(request: Request[Any, Any, Any], paused: bool) -> Response[bytes]:
    state = _state(request)
    try:
        state.set_paused(paused)
    except EngineError as exc:
        raise APIError(503, str(exc), code=state.phase) from None
    return _json({"paused": paused})


@post("/admin/pause", status_code=200)
async def pause(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Stop scheduling steps (as vLLM's /pause): running and waiting requests keep their place and
    their blocks; new requests queue; aborts, stats and queue timeouts (on their timers in the
    API process) still apply while paused."""
    return _set_paused(request, True)


@post("/admin/resume", status_code=200)
async def resume(request: Request[Any, Any, Any]) -> Response[bytes]:
    return _set_paused(request, False)


def router() -> Router:
    return Router(
        path="/",
        # PATCH /admin/config beside GET here: one route per path (admin_live.py has the rest).
        route_handlers=[stats, config, patch_config, reload, abort, pause, resume],
        guards=[admin_guard],
        include_in_schema=False,  # the console's API: not in /openapi.json
    )
