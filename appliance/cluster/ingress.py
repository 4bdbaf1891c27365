"""The cluster's ingress: the same OpenAI API as `appliance up` (every route is the replicas'
own Litestar app, reached over HTTP), in front of the replicas the directory lists.

A request goes to the pool its prompt length picks (`appliance route`'s rule and code:
tools/router.py `prompt_tokens`), then to the replicas of that pool in routing.py's order. A
429 or 503 (queue full, draining, reloading) or an unreachable replica moves the request to the
next replica before anything reaches the client; the last refusal is answered when every
replica refused. A stream whose replica dies after its first token ends with each open
choice's finish reason and an error event (stream_guard.py), never silently. The answer is
relayed as it comes (status, headers, SSE chunk by chunk); a client that disconnects closes
the upstream stream, which aborts the request in its replica.

Plain ASGI, so it runs under Ray Serve's HTTP proxy (app.py) and under uvicorn in tests."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import httpx
import msgspec

from appliance.cluster.directory import STALE_AFTER_S
from appliance.cluster.metrics_merge import render
from appliance.cluster.routing import ReplicaLoad, affinity_key, replica_order
from appliance.cluster.settings import ClusterConfig
from appliance.cluster.stream_guard import StreamGuard
from appliance.config import CLIENT_KEEPALIVE_EXPIRY_S
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
from appliance.tools.router import GENERATE_PATHS, TokenCounter, prompt_tokens

log = logging.getLogger("appliance.cluster")

Snapshot = Callable[[], Awaitable[list[ReplicaLoad]]]
# A refusal to answer if no replica takes the request: status, headers, body.
Refusal = tuple[int, list[tuple[bytes, bytes]], bytes]
# Statuses a replica answers when another may serve the request: its class queue is full
# (429) or it is not ready (503: draining, reloading, starting).
RETRY_ELSEWHERE = (429, 503)
MAX_BODY_BYTES = 16 * 1024 * 1024


class ClusterIngress:
    def __init__(
        self,
        snapshot: Snapshot,
        cfg: ClusterConfig,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        from prometheus_client import CollectorRegistry
        from prometheus_client import Counter as PromCounter

        self.snapshot = snapshot
        self.cfg = cfg
        self.counter = TokenCounter(cfg.chars_per_token)
        self.replicas: list[ReplicaLoad] = []
        # Requests this ingress has in flight at each replica: load the reports cannot see yet.
        self.inflight: Counter[str] = Counter()
        # Replicas that refused a connection or broke a stream: skipped until the directory drops
        # them (a restarted replica comes back under a new id).
        self.unreachable: dict[str, float] = {}
        self._transport = transport
        self.client: httpx.AsyncClient | None = None
        self._refresher: asyncio.Task[None] | None = None
        self.registry = CollectorRegistry()
        self.routed = PromCounter(
            "appliance_cluster_requests",
            "Requests the ingress answered, by replica and status.",
            ["replica", "status"],
            registry=self.registry,
        )
        self.retried = PromCounter(
            "appliance_cluster_retries",
            "Requests moved to another replica, by why (429, 503, unreachable).",
            ["reason"],
            registry=self.registry,
        )
        self.streams_lost = PromCounter(
            "appliance_cluster_streams_lost",
            "Streams whose replica was lost after the first token (ended with an error event).",
            registry=self.registry,
        )

    # -- ASGI ------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await self.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elif scope["type"] == "http":
            await self._open()
            await self._http(scope, receive, send)

    async def _open(self) -> None:
        if self.client is not None:
            return
        timeout = httpx.Timeout(900.0, connect=5.0, pool=None)
        limits = httpx.Limits(
            max_connections=None,
            max_keepalive_connections=256,
            keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S,
        )
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, transport=self._transport)
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_loop(), name="ingress-refresh")

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    async def refresh(self) -> None:
        try:
            self.replicas = await self.snapshot()
        except Exception as exc:  # the directory restarting: keep the last view
            log.warning("ingress: no directory snapshot: %s", exc)
        now = time.monotonic()
        live = {r.replica_id for r in self.replicas}
        self.unreachable = {
            rid: t for rid, t in self.unreachable.items() if rid in live and t > now
        }

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.report_interval_s)
            await self.refresh()

    # -- routing -----------------------------------------------------------------------------------
    def candidates(self, body: object) -> list[ReplicaLoad]:
        pool, key = "default", None
        if isinstance(body, dict):
            key = affinity_key(body, self.cfg.prefix_chars)
            long_limit = self.cfg.long_prompt_tokens
            if long_limit and prompt_tokens(body, self.counter) > long_limit:
                pool = "long"
        usable = [r for r in self.replicas if r.replica_id not in self.unreachable]
        order = replica_order(
            [r for r in usable if r.pool == pool],
            self.inflight,
            self.cfg.routing,
            key,
            self.cfg.imbalance,
        )
        if pool != "default":  # the long pool full or gone: the others still answer
            order += replica_order(
                [r for r in usable if r.pool != pool], self.inflight, "queue", None, 0
            )
        return order

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/health":
            return await reply(send, 200, b'{"status":"ok"}')
        if path == "/ready":
            ready = [r.replica_id for r in self.replicas if r.phase == "ready"]
            body = msgspec.json.encode({"ready": bool(ready), "replicas": ready})
            return await reply(send, 200 if ready else 503, body)
        if path == "/metrics":
            return await self._metrics(send)
        if path == "/cluster/replicas":
            # As this ingress sees them: one it could not reach is "unreachable" here before
            # its last report goes stale in the directory.
            view = [
                msgspec.structs.replace(r, phase="unreachable")
                if r.replica_id in self.unreachable
                else r
                for r in self.replicas
            ]
            return await reply(send, 200, msgspec.json.encode(view))
        if path.startswith("/admin"):
            return await self._admin(scope, receive, send)
        received = await read_body(receive, MAX_BODY_BYTES)
        if received is None:
            err = router_error(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid_request")
            return await reply(send, 413, err)
        body = received
        parsed: object = None
        if method == "POST" and path in GENERATE_PATHS:
            try:
                parsed = msgspec.json.decode(body)
            except msgspec.DecodeError:
                parsed = None  # a replica answers the 400
        await self._route(scope, receive, send, body, parsed)

    async def _route(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, parsed: object
    ) -> None:
        """Rounds over the replicas in routing order. A round where every replica refused
        because it was not ready (503: reloading, draining, starting) or unreachable is tried
        again on a fresh view, for up to wait_for_replica_s: during a rolling apply the view
        can be a report behind (the replica that just reloaded still looks busy while the next
        one has begun). A round of 429s only (every queue full) is answered at once: admission
        refuses fast, with Retry-After."""
        deadline = time.monotonic() + self.cfg.wait_for_replica_s
        refusal: Refusal | None = None
        while True:
            order = self.candidates(parsed)
            if order:
                outcome = await self._forward(scope, receive, send, body, order)
                if outcome is None:
                    return
                refusal, not_ready = outcome
                if not not_ready:
                    break
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(self.cfg.report_interval_s)
            await self.refresh()
        if refusal is None:
            err = router_error(503, "no replica is ready", "service_unavailable")
            refusal = (503, [(b"content-type", b"application/json"), (b"retry-after", b"1")], err)
        status, out_headers, content = refusal
        self.routed.labels("", str(status)).inc()
        await reply(send, status, content, headers=out_headers)

    async def _forward(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, order: list[ReplicaLoad]
    ) -> tuple[Refusal, bool] | None:
        """Try the replicas in order; None once one answered (relayed to the client), else the
        last refusal and whether any replica was not ready or unreachable (worth a new round)."""
        assert self.client is not None
        refusal: Refusal | None = None
        not_ready = False
        target = scope.get("raw_path", scope["path"].encode()).decode()
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode()
        headers = proxied_request_headers(scope)
        for replica in order:
            rid = replica.replica_id
            request = self.client.build_request(
                scope["method"], replica.url + target, headers=headers, content=body
            )
            self.inflight[rid] += 1
            try:
                try:
                    response = await self.client.send(request, stream=True)
                except httpx.TransportError as exc:
                    # Dead (killed, its node lost) before any answer: nothing was sent to the
                    # client, so another replica takes the request whole.
                    log.warning("replica %s unreachable: %s", rid, exc)
                    self._mark_unreachable(rid)
                    self.retried.labels("unreachable").inc()
                    refusal = (502, [], router_error(502, f"replica {rid} unreachable", "upstream"))
                    not_ready = True
                    continue
                if response.status_code in RETRY_ELSEWHERE:
                    content = await response.aread()
                    await response.aclose()
                    refusal = (response.status_code, proxied_response_headers(response), content)
                    not_ready = not_ready or response.status_code == 503
                    self.retried.labels(str(response.status_code)).inc()
                    continue
                await self._relay(response, receive, send, rid)
                self.routed.labels(rid, str(response.status_code)).inc()
                return None
            finally:
                self.inflight[rid] -= 1
                if self.inflight[rid] <= 0:
                    del self.inflight[rid]
        assert refusal is not None
        return refusal, not_ready

    async def _admin(self, scope: Scope, receive: Receive, send: Send) -> None:
        """/admin/* reads one replica's view, the console's: the replica the
        `x-appliance-replica` header names, else the first ready one by id (a steady choice, so
        a console polling the cluster watches one replica). The levers (reload, pause, abort)
        act on one replica only, which through the cluster's address would look like acting on
        all: they are refused here, naming `appliance cluster apply` and the replicas' own URLs."""
        if scope["method"] != "GET":
            urls = ", ".join(f"{r.replica_id} {r.url}" for r in self.replicas)
            err = router_error(
                405,
                "admin actions act on one replica: use `appliance cluster apply` for the "
                f"template, or a replica's own address ({urls})",
                "invalid_request_error",
            )
            return await reply(send, 405, err)
        wanted = dict(scope["headers"]).get(b"x-appliance-replica", b"").decode()
        ready = sorted(
            (
                r
                for r in self.replicas
                if r.phase == "ready" and r.replica_id not in self.unreachable
            ),
            key=lambda r: r.replica_id,
        )
        chosen = [r for r in ready if r.replica_id == wanted] if wanted else ready[:1]
        if not chosen:
            what = f"replica {wanted!r} is not ready" if wanted else "no replica is ready"
            return await reply(send, 503, router_error(503, what, "service_unavailable"))
        outcome = await self._forward(scope, receive, send, b"", chosen)
        if outcome is not None:
            status, headers, content = outcome[0]
            await reply(send, status, content, headers=headers)

    def _mark_unreachable(self, rid: str) -> None:
        self.unreachable[rid] = time.monotonic() + STALE_AFTER_S + 1.0

    async def _relay(
        self, response: httpx.Response, receive: Receive, send: Send, rid: str
    ) -> None:
        out = proxied_response_headers(response) + [(b"x-appliance-replica", rid.encode())]
        await send({"type": "http.response.start", "status": response.status_code, "headers": out})
        is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
        guard = StreamGuard() if is_sse else None

        async def pump() -> None:
            try:
                async for chunk in response.aiter_raw():
                    if guard is not None:
                        guard.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as exc:
                log.warning("replica %s lost mid-response: %s", rid, exc)
                self._mark_unreachable(rid)
                if guard is not None:
                    self.streams_lost.inc()
                    tail = guard.tail(f"replica {rid} was lost mid-stream ({type(exc).__name__})")
                    await send({"type": "http.response.body", "body": tail, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            error = await pump_until_disconnect(pump(), receive)
        finally:
            await response.aclose()
        if error is not None:
            raise error

    async def _metrics(self, send: Send) -> None:
        assert self.client is not None
        client = self.client

        async def scrape(r: ReplicaLoad) -> tuple[str, str]:
            try:
                got = await client.get(r.url + "/metrics", timeout=3.0)
                return r.replica_id, got.text if got.status_code == 200 else ""
            except httpx.HTTPError:
                return r.replica_id, ""

        texts = dict(await asyncio.gather(*(scrape(r) for r in self.replicas)))
        from prometheus_client import CONTENT_TYPE_LATEST

        body = render({k: v for k, v in texts.items() if v}, [self.registry])
        await reply(send, 200, body, ctype=CONTENT_TYPE_LATEST.encode())
