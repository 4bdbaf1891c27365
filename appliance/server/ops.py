"""Operations endpoints, unauthenticated on purpose (probes and scrapers carry no keys):
/health (the process is alive), /ready (the engine is up and not draining), /metrics."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import Request, Response, get

from appliance.engine.client import EngineError
from appliance.metrics import CONTENT_TYPE
from appliance.server.state import ServerState

log = logging.getLogger("appliance.server")
# A scrape waits at most this long for the core (one step, normally milliseconds).
STATS_TIMEOUT_S = 5.0


def _state(request: Request[Any, Any, Any]) -> ServerState:
    return request.app.state.server


def _json(obj: Any, status: int = 200) -> Response[bytes]:
    return Response(
        content=msgspec.json.encode(obj), status_code=status, media_type="application/json"
    )


@get("/health", include_in_schema=False)
async def health(request: Request[Any, Any, Any]) -> Response[bytes]:
    state = _state(request)
    alive = state.phase != "failed"
    return _json(
        {"status": "ok" if alive else "failed", "phase": state.phase}, 200 if alive else 503
    )


@get("/ready", include_in_schema=False)
async def ready(request: Request[Any, Any, Any]) -> Response[bytes]:
    state = _state(request)
    body = {"ready": state.ready, "phase": state.phase, "detail": state.phase_detail}
    return _json(body, 200 if state.ready else 503)


@get("/metrics", include_in_schema=False)
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    state = _state(request)
    client = state.client
    if client is not None and not client.dead:
        try:
            reply = await client.stats(timeout_s=STATS_TIMEOUT_S)
            state.metrics.update_engine(reply.snapshot.engine)
        except (TimeoutError, EngineError) as exc:
            # Serve what we have: request-level series are still right.
            log.warning("metrics: no engine stats (%s)", exc)
    return Response(content=state.metrics.render(), media_type=CONTENT_TYPE)


route_handlers = [health, ready, metrics]
