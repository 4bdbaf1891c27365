"""Bearer API keys for the OpenAI routes and a separate admin token for /admin/*.

Secrets come from a file (one per line, `#` comments) or an environment variable (comma
separated) named in the template, never from the template itself. In the admin token file a
comment line `# name: alice` names the token on the next line: the audit log records actions
under that name (an unnamed token as `token-` and the first 8 hex digits of its SHA-256). Every configured secret is
compared with hmac.compare_digest, without stopping at the first match, so timing does not
reveal which (or whether a prefix) matched.
"""

from __future__ import annotations

import hashlib
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

NAME_COMMENT = "# name:"


def _read_named_secrets(file: str, env: str, what: str) -> list[tuple[str, str]]:
    """(secret, name) pairs; name "" where no `# name:` line precedes the secret."""
    secrets: list[tuple[str, str]] = []
    if file:
        path = Path(os.path.expanduser(file))
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(
                f"server.{what}_file: cannot read {str(path)!r}: {exc.strerror}"
            ) from None
        name = ""
        for line in (ln.strip() for ln in text.splitlines()):
            if line.lower().startswith(NAME_COMMENT):
                name = line[len(NAME_COMMENT) :].strip()
            elif line and not line.startswith("#"):
                secrets.append((line, name))
                name = ""
    if env:
        value = os.environ.get(env, "")
        secrets += [(s.strip(), "") for s in value.split(",") if s.strip()]
    return secrets


def _read_secrets(file: str, env: str, what: str) -> list[str]:
    return [secret for secret, _ in _read_named_secrets(file, env, what)]


def token_name(secret: bytes, name: str) -> str:
    return name or f"token-{hashlib.sha256(secret).hexdigest()[:8]}"


@dataclass
class AuthKeys:
    api_keys: list[bytes] = field(default_factory=list)
    admin_tokens: list[bytes] = field(default_factory=list)
    # Each admin token's name for the audit log (token_name), in the same order.
    admin_names: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, server: ServerConfig) -> AuthKeys:
        admin = _read_named_secrets(server.admin_token_file, server.admin_token_env, "admin_token")
        return cls(
            [s.encode() for s in _read_secrets(server.api_key_file, server.api_key_env, "api_key")],
            [s.encode() for s, _ in admin],
            [token_name(s.encode(), name) for s, name in admin],
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

    def admin_name(self, presented: bytes | None) -> str:
        """The name of the admin token presented ("local" when none is configured: the guard
        let a loopback caller in; "" when it matches none)."""
        if not self.admin_tokens:
            return "local"
        found = ""
        for i, secret in enumerate(self.admin_tokens):
            if presented is not None and hmac.compare_digest(presented, secret):
                found = self.admin_names[i] if i < len(self.admin_names) else token_name(secret, "")
        return found


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
