"""The console's HTTP client for the admin API (/admin/*) and /metrics.

Every failure becomes a `ConsoleError` whose message an operator can act on: the console shows
it in its status line instead of a traceback, and keeps polling.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import msgspec

from appliance.server.admin_schema import AdminStats
from appliance.stats import ReplicaLoad

# The admin token when no --admin-token-file is given (scripts, CI).
TOKEN_ENV = "APPLIANCE_ADMIN_TOKEN"
# A poll must come back well within the refresh period's order of magnitude; a slow or hung
# server shows as "not answering" rather than freezing the figures silently.
POLL_TIMEOUT_S = 5.0
# A reload drains in-flight requests (server.drain_timeout_s, 30 s by default) and restarts the
# engine: give it minutes, not seconds.
RELOAD_TIMEOUT_S = 600.0


class ConsoleError(Exception):
    """A failure the console reports in words; `kind` selects how it is shown."""

    kind = "error"


class Unreachable(ConsoleError):
    kind = "unreachable"


class Unauthorized(ConsoleError):
    kind = "auth"


class ServerError(ConsoleError):
    kind = "http"

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def read_token(path: str | None) -> str | None:
    """The admin token from a file (first non-comment line) or $APPLIANCE_ADMIN_TOKEN."""
    if path:
        p = Path(os.path.expanduser(path))
        try:
            lines = p.read_text().splitlines()
        except OSError as exc:
            raise ConsoleError(
                f"--admin-token-file: cannot read {str(p)!r}: {exc.strerror}"
            ) from None
        for line in lines:
            if line.strip() and not line.startswith("#"):
                return line.strip()
        raise ConsoleError(f"--admin-token-file: {str(p)!r} holds no token")
    return os.environ.get(TOKEN_ENV) or None


def error_message(resp: httpx.Response) -> tuple[str, str | None]:
    """The message and code of an OpenAI-style error body, or the raw text."""
    try:
        body = resp.json()
        err = body.get("error", body) if isinstance(body, dict) else {}
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"]), err.get("code")
    except ValueError:
        pass
    return (resp.text.strip()[:300] or resp.reason_phrase), None


class AdminClient:
    def __init__(
        self, url: str, token: str | None = None, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.url = url.rstrip("/")
        # The audit log records the console's actions as the console's (or the token's name).
        headers = {"X-Appliance-Client": "console"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.has_token = token is not None
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=POLL_TIMEOUT_S, transport=transport
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(
        self, method: str, path: str, timeout: float = POLL_TIMEOUT_S, **kw: Any
    ) -> httpx.Response:
        try:
            resp = await self._http.request(method, path, timeout=timeout, **kw)
        except httpx.TimeoutException:
            raise Unreachable(f"{self.url} is not answering ({timeout:g} s timeout)") from None
        except httpx.TransportError as exc:
            reason = str(exc) or type(exc).__name__
            raise Unreachable(f"server unreachable at {self.url} ({reason})") from None
        if resp.status_code == 401:
            message, _ = error_message(resp)
            hint = (
                "the token given was rejected"
                if self.has_token
                else "none was given: pass --admin-token-file (the file the template's "
                "server.admin_token_file names)"
            )
            raise Unauthorized(
                f"admin token refused by {self.url} (401): {hint}. Server: {message}"
            )
        if resp.status_code >= 400:
            message, code = error_message(resp)
            raise ServerError(
                resp.status_code, f"{method} {path}: {resp.status_code}: {message}", code
            )
        return resp

    async def stats(self, history_s: float) -> AdminStats:
        resp = await self._request("GET", "/admin/stats", params={"history_s": f"{history_s:.1f}"})
        try:
            return msgspec.json.decode(resp.content, type=AdminStats)
        except msgspec.DecodeError as exc:
            # A server of another version: say so rather than crash.
            raise ConsoleError(f"/admin/stats: unexpected response ({exc})") from None

    async def cluster_replicas(self) -> list[ReplicaLoad] | None:
        """The replicas behind a cluster's ingress (`appliance cluster up`: GET
        /cluster/replicas); None from a single box, which has no such route (404)."""
        try:
            resp = await self._request("GET", "/cluster/replicas")
        except ServerError as exc:
            if exc.status == 404:
                return None
            raise
        try:
            return msgspec.json.decode(resp.content, type=list[ReplicaLoad])
        except msgspec.DecodeError as exc:
            raise ConsoleError(f"/cluster/replicas: unexpected response ({exc})") from None

    async def metrics(self) -> str:
        return (await self._request("GET", "/metrics")).text

    async def config(self) -> dict[str, Any]:
        return (await self._request("GET", "/admin/config")).json()

    async def reload(
        self, template: str | None, overrides: dict[str, Any] | None = None, rollback: bool = False
    ) -> dict[str, Any]:
        body = {"template": template, "overrides": overrides or {}, "rollback": rollback}
        return (
            await self._request("POST", "/admin/reload", timeout=RELOAD_TIMEOUT_S, json=body)
        ).json()

    async def patch_config(self, body: dict[str, Any]) -> dict[str, Any]:
        """Live knobs: {"changed": [{"key", "before", "after"}], ...}; 400/409 ServerError."""
        return (await self._request("PATCH", "/admin/config", json=body)).json()

    async def pause_class(self, name: str, drain: bool = False) -> dict[str, Any]:
        params = {"drain": "true"} if drain else {}
        return (await self._request("POST", f"/admin/classes/{name}/pause", params=params)).json()

    async def resume_class(self, name: str) -> dict[str, Any]:
        return (await self._request("POST", f"/admin/classes/{name}/resume")).json()

    async def audit(self, since: float = 0.0, limit: int = 200) -> list[dict[str, Any]]:
        params = {"since": f"{since:.3f}", "limit": str(limit)}
        return list((await self._request("GET", "/admin/audit", params=params)).json()["records"])

    async def abort(self, request_id: str) -> dict[str, Any]:
        return (await self._request("POST", f"/admin/abort/{request_id}")).json()
