"""`appliance route`: one OpenAI endpoint in front of the pool instances.

Each request goes to one pool: a priority class mapped to a pool (`batch` -> the batch
instance) first, else a prompt longer than `long_prompt_tokens` to the long-context instance,
else the default (real-time) pool. The body is forwarded byte for byte and the answer streamed
back as it comes, status and headers included, so a pool's 429 reaches the client with its
Retry-After and SSE streams flow chunk by chunk. A client that disconnects closes the upstream
stream, which aborts the request in the instance.

Why a small ASGI app rather than nginx or HAProxy: the routing key is in the JSON body (prompt
length in tokens, the `priority` class), which neither reads without Lua/njs scripting, and
this keeps the router in the package, configured by one TOML table and tested like the rest.

Prompt length: exact with a tokenizer (`tokenizer` = a model directory holding
tokenizer.json), else estimated as characters / `chars_per_token` (1.0 makes the threshold a
character count). Token-id prompts are counted exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import tomllib
from pathlib import Path
from typing import Annotated, Any

import httpx
import msgspec
from msgspec import Meta

from appliance.config import CLIENT_KEEPALIVE_EXPIRY_S, ConfigError
from appliance.tools.asgi_proxy import (
    Receive,
    Scope,
    Send,
    proxied_request_headers,
    proxied_response_headers,
    pump_until_disconnect,
    read_body,
    reply,
    router_error,
)

log = logging.getLogger("appliance.router")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    # Pool name -> base URL of its instance, e.g. realtime = "http://127.0.0.1:8001".
    pools: dict[str, str] = {}
    # Where everything else goes; empty = the first pool listed.
    default_pool: str = ""
    # Pool for prompts longer than long_prompt_tokens; empty = no length routing.
    long_pool: str = ""
    long_prompt_tokens: Annotated[int, Meta(ge=1)] = 2048
    # An appliance template (name or path) whose scheduler.long_prompt_tokens sets the
    # threshold: the router's length routing and a single box's length class
    # (scheduler.long_prompt_class) then read one setting, with one rule (longer than).
    template: str = ""
    # Characters per token when no tokenizer is given (the estimate).
    chars_per_token: Annotated[float, Meta(gt=0.0)] = 4.0
    # Model directory (tokenizer.json) to count prompt tokens exactly.
    tokenizer: str = ""
    # Priority class (the request's "priority" string) -> pool; checked before length.
    classes: dict[str, str] = {}
    # Longest a request may take upstream (a long generation streams for minutes).
    timeout_s: Annotated[float, Meta(gt=0.0)] = 900.0
    connect_timeout_s: Annotated[float, Meta(gt=0.0)] = 5.0
    max_request_body_bytes: Annotated[int, Meta(ge=1)] = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.pools:
            raise ConfigError('router.pools: no pools (name = "http://host:port")')
        for name, url in self.pools.items():
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"router.pools.{name}: {url!r} is not an http(s) URL")
        if not self.default_pool:
            self.default_pool = next(iter(self.pools))
        refs = {"router.default_pool": self.default_pool, "router.long_pool": self.long_pool}
        refs.update({f"router.classes.{c}": p for c, p in self.classes.items()})
        for key, pool in refs.items():
            if pool and pool not in self.pools:
                raise ConfigError(f"{key}: unknown pool {pool!r}; pools: {', '.join(self.pools)}")


def load_router_config(path: str | None, overrides: dict[str, Any]) -> RouterConfig:
    """The [router] table of a TOML file (or nothing), with command-line values on top."""
    raw: dict[str, Any] = {}
    if path:
        try:
            doc = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
        raw = dict(doc.get("router", {}))
    for key, value in overrides.items():
        if isinstance(value, dict):
            raw[key] = {**raw.get(key, {}), **value}
        elif value is not None:
            raw[key] = value
    if raw.get("template"):
        from appliance.config import load_config

        threshold = load_config(raw["template"]).scheduler.long_prompt_tokens
        if not threshold:
            raise ConfigError(
                f"router.template {raw['template']!r} sets no scheduler.long_prompt_tokens"
            )
        if overrides.get("long_prompt_tokens") is None and "long_prompt_tokens" not in raw:
            raw["long_prompt_tokens"] = threshold
    try:
        return msgspec.convert(raw, RouterConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"router: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Routing policy (pure)


class TokenCounter:
    """Prompt length in tokens: exact with a tokenizer, else characters / chars_per_token."""

    def __init__(self, chars_per_token: float = 4.0, tokenizer_dir: str = "") -> None:
        self.chars_per_token = chars_per_token
        self._tok: Any = None
        if tokenizer_dir:
            from tokenizers import Tokenizer

            file = Path(tokenizer_dir).expanduser() / "tokenizer.json"
            if not file.is_file():
                raise ConfigError(f"router.tokenizer: no tokenizer.json in {tokenizer_dir!r}")
            self._tok = Tokenizer.from_file(str(file))

    def count(self, text: str) -> int:
        if self._tok is not None:
            return len(self._tok.encode(text, add_special_tokens=False).ids)
        return math.ceil(len(text) / self.chars_per_token)


def prompt_tokens(body: Any, counter: TokenCounter) -> int:
    """Longest prompt of a completions request, or the whole conversation of a chat request."""
    if not isinstance(body, dict):
        return 0
    if "messages" in body:
        parts: list[str] = []
        for msg in body.get("messages") or []:
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [
                    p["text"]
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                ]
        return counter.count("\n".join(parts))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return counter.count(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)
        return max(
            (len(p) if isinstance(p, list) else counter.count(p) if isinstance(p, str) else 0)
            for p in prompt
        )
    return 0


def choose_pool(cfg: RouterConfig, body: Any, counter: TokenCounter) -> tuple[str, str]:
    """(pool, why) for a generation request: its class first, then its prompt length."""
    if isinstance(body, dict):
        cls = body.get("priority")
        if isinstance(cls, str) and cls in cfg.classes:
            return cfg.classes[cls], "class"
        if cfg.long_pool and prompt_tokens(body, counter) > cfg.long_prompt_tokens:
            return cfg.long_pool, "long"
    return cfg.default_pool, "default"


# ---------------------------------------------------------------------------------------------
# The ASGI app


class Router:
    """A plain ASGI app: /health, /ready and /metrics of its own, everything else proxied."""

    def __init__(
        self,
        cfg: RouterConfig,
        counter: TokenCounter | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter

        self.cfg = cfg
        self.counter = counter or TokenCounter(cfg.chars_per_token, cfg.tokenizer)
        self._transport = transport
        self.client: httpx.AsyncClient | None = None
        self.registry = CollectorRegistry()
        self.routed = Counter(
            "appliance_router_requests",
            "Requests routed, by pool, reason and status.",
            ["pool", "reason", "status"],
            registry=self.registry,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.open()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def open(self) -> None:
        timeout = httpx.Timeout(self.cfg.timeout_s, connect=self.cfg.connect_timeout_s, pool=None)
        limits = httpx.Limits(
            max_connections=None,
            max_keepalive_connections=64,
            keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S,
        )
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=self._transport)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/health":
            return await reply(send, 200, b'{"status":"ok"}')
        if path == "/ready":
            return await self._ready(send)
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return await reply(
                send, 200, generate_latest(self.registry), CONTENT_TYPE_LATEST.encode()
            )
        if path.startswith("/admin"):
            return await reply(
                send,
                404,
                router_error(
                    404, "admin endpoints are per instance: ask the pool's port", "not_found"
                ),
            )
        body = await read_body(receive, self.cfg.max_request_body_bytes)
        if body is None:
            limit = self.cfg.max_request_body_bytes
            return await reply(
                send,
                413,
                router_error(413, f"request body over {limit} bytes", "invalid_request_error"),
            )
        pool, why = self.cfg.default_pool, "default"
        if method == "POST" and path in GENERATE_PATHS:
            try:
                parsed = msgspec.json.decode(body)
            except msgspec.DecodeError:
                parsed = None  # the pool answers the 400
            pool, why = choose_pool(self.cfg, parsed, self.counter)
        status = await self._forward(scope, receive, send, body, pool)
        self.routed.labels(pool, why, str(status)).inc()
        log.info("%s %s -> %s (%s): %d", method, path, pool, why, status)

    async def _forward(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, pool: str
    ) -> int:
        assert self.client is not None, "the router was not opened (lifespan)"
        url = (
            self.cfg.pools[pool].rstrip("/")
            + scope.get("raw_path", scope["path"].encode()).decode()
        )
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode()
        headers = proxied_request_headers(scope)
        request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            log.warning("pool %s (%s) unreachable: %s", pool, url, exc)
            await reply(
                send,
                502,
                router_error(
                    502, f"pool {pool!r} unreachable: {type(exc).__name__}", "upstream_error"
                ),
            )
            return 502
        try:
            out = proxied_response_headers(response)
            out.append((b"x-appliance-pool", pool.encode()))
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": out}
            )
            await _relay(response, receive, send)
        finally:
            await response.aclose()
        return response.status_code

    async def _ready(self, send: Send) -> None:
        assert self.client is not None
        client = self.client

        async def probe(url: str) -> bool:
            try:
                r = await client.get(url.rstrip("/") + "/ready", timeout=2.0)
                return r.status_code == 200
            except httpx.HTTPError:
                return False

        names = list(self.cfg.pools)
        results = await asyncio.gather(*(probe(self.cfg.pools[n]) for n in names))
        pools = dict(zip(names, results, strict=True))
        ok = pools[self.cfg.default_pool]
        await reply(send, 200 if ok else 503, msgspec.json.encode({"ready": ok, "pools": pools}))


async def _relay(response: httpx.Response, receive: Receive, send: Send) -> None:
    """Stream the upstream body to the client; a client disconnect stops it (and so closes
    the upstream connection, which aborts the request in the pool)."""

    async def pump() -> None:
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    error = await pump_until_disconnect(pump(), receive)
    if isinstance(error, httpx.HTTPError):
        log.warning("upstream stream broke: %s", error)
    elif error is not None:
        raise error


# ---------------------------------------------------------------------------------------------
# Command line


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"{flag} {item!r}: expected NAME=VALUE")
        out[key.strip()] = value.strip()
    return out


def cmd_route(ns: argparse.Namespace) -> int:
    import uvicorn

    cfg = load_router_config(
        ns.config,
        {
            "host": ns.host,
            "port": ns.port,
            "default_pool": ns.default_pool,
            "long_pool": ns.long_pool,
            "long_prompt_tokens": ns.long_prompt_tokens,
            "chars_per_token": ns.chars_per_token,
            "tokenizer": ns.tokenizer,
            "template": ns.template,
            "pools": _pairs(ns.pool, "--pool"),
            "classes": _pairs(ns.cls, "--class"),
        },
    )
    app = Router(cfg)
    log.info(
        "routing on http://%s:%d: pools %s; default %s; long (> %d tokens) %s; classes %s",
        cfg.host,
        cfg.port,
        cfg.pools,
        cfg.default_pool,
        cfg.long_prompt_tokens,
        cfg.long_pool or "-",
        cfg.classes or "-",
    )
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level="warning",
        lifespan="on",
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=60,
    )
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "route", help="route OpenAI requests to pool instances by prompt length and class"
    )
    p.add_argument(
        "--config", help="TOML file with a [router] table (e.g. /etc/appliance/router.toml)"
    )
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="an upstream pool (repeatable)",
    )
    p.add_argument("--default-pool")
    p.add_argument("--long-pool", help="pool for long prompts")
    p.add_argument("--long-prompt-tokens", type=int, help="prompts longer than this are long")
    p.add_argument(
        "--template",
        help="an appliance template whose scheduler.long_prompt_tokens sets the threshold",
    )
    p.add_argument("--chars-per-token", type=float, help="token estimate without a tokenizer")
    p.add_argument("--tokenizer", help="model directory whose tokenizer.json counts tokens exactly")
    p.add_argument(
        "--class",
        dest="cls",
        action="append",
        default=[],
        metavar="CLASS=POOL",
        help="send a priority class to a pool (repeatable)",
    )
    p.set_defaults(func=cmd_route)
