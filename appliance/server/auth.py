"""Bearer API keys for the OpenAI routes and a separate admin token for /admin/*.

Secrets come from a file (one per line, `#` comments) or an environment variable (comma
separated) named in the template, never from the template itself. Every configured secret is
compared with hmac.compare_digest, without stopping at the first match, so timing does not
reveal which (or whether a prefix) matched.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from appliance.config import ConfigError, ServerConfig
from appliance.server.errors import APIError


def _read_secrets(file: str, env: str, what: str) -> list[str]:
    secrets: list[str] = []
    if file:
        path = Path(os.path.expanduser(file))
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(
                f"server.{what}_file: cannot read {str(path)!r}: {exc.strerror}"
            ) from None
        secrets += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    if env:
        value = os.environ.get(env, "")
        secrets += [s.strip() for s in value.split(",") if s.strip()]
    return secrets


@dataclass
class AuthKeys:
    api_keys: list[bytes] = field(default_factory=list)
    admin_tokens: list[bytes] = field(default_factory=list)

    @classmethod
    def from_config(cls, server: ServerConfig) -> AuthKeys:
        return cls(
            [s.encode() for s in _read_secrets(server.api_key_file, server.api_key_env, "api_key")],
            [
                s.encode()
                for s in _read_secrets(
                    server.admin_token_file, server.admin_token_env, "admin_token"
                )
            ],
        )

    @staticmethod
    def _matches(presented: bytes, secrets: list[bytes]) -> bool:
        ok = False
        for secret in secrets:
            ok |= hmac.compare_digest(presented, secret)
        return ok

    def check_api_key(self, presented: bytes | None) -> bool:
        if not self.api_keys:
            return True
        return presented is not None and self._matches(presented, self.api_keys)

    def check_admin(self, presented: bytes | None, client_host: str | None) -> bool:
        if not self.admin_tokens:
            # No admin token configured: the admin API answers the local machine only.
            return is_loopback(client_host)
        return presented is not None and self._matches(presented, self.admin_tokens)


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer(connection: ASGIConnection[Any, Any, Any, Any]) -> bytes | None:
    value = connection.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode()


def _keys(connection: ASGIConnection[Any, Any, Any, Any]) -> AuthKeys:
    return connection.app.state.server.auth


def api_key_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    if not _keys(connection).check_api_key(bearer(connection)):
        raise APIError(
            401,
            "invalid or missing API key: send 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    client = connection.client.host if connection.client else None
    if not _keys(connection).check_admin(bearer(connection), client):
        raise APIError(
            401,
            "invalid or missing admin token: send 'Authorization: Bearer <admin token>'",
            code="invalid_admin_token",
            headers={"WWW-Authenticate": "Bearer"},
        )


def check_bind(host: str, keys: AuthKeys) -> None:
    """With no API key the server answers anyone who can reach it: loopback only."""
    if not keys.api_keys and not is_loopback(host):
        raise ConfigError(
            f"server.host {host!r}: refusing to listen beyond loopback without an API key; "
            "set server.api_key_file or server.api_key_env (or bind to 127.0.0.1)"
        )
