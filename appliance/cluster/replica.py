"""A replica: one appliance server (the Litestar app of `appliance up`) and its engine, inside
one Ray Serve replica. Nothing of the server is rewritten: priority classes, 429 admission with
Retry-After, prefix caching, drain, /metrics are the server's own; the replica starts it on a
free port of its node, reports its load to the directory, and maps Ray Serve's hooks onto the
server's life cycle:

- reconfigure(user_config): the template and overrides. The first call starts the engine; a
  later one reloads it (ServerState.reload: drain, swap, the previous engine restored on
  failure). Ray Serve calls it one replica at a time on `cluster apply` (its rolling update),
  and the ingress routes around a replica that is not `ready`.
- record_autoscaling_stats: the engine's waiting requests and estimated wait, for autoscale.py.
- check_health: a failed engine makes Ray Serve replace the replica.
- __del__ (Ray Serve's graceful stop): leave the directory, then drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import Any

from appliance.cluster.routing import ReplicaLoad
from appliance.config import ConfigError, load_config

log = logging.getLogger("appliance.cluster")

# Stats the engine core must answer (KV usage, prefix hits) are asked every this many reports;
# the queue figures come from the engine client's own view of each frame, for free.
STATS_EVERY = 4
LEAVE_TIMEOUT_S = 1.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class ApplianceReplica:
    def __init__(self, directory: Any, pool: str = "default", report_interval_s: float = 0.25):
        from ray import serve

        self.directory = directory
        self.pool = pool
        self.report_interval_s = report_interval_s
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.state: Any = None
        # The template and overrides of the last reconfigure, as Ray Serve gave them.
        self.applied: tuple[str, dict[str, Any]] | None = None
        self.serving: asyncio.Task[int] | None = None
        self.reporting: asyncio.Task[None] | None = None
        self.url = ""
        self.port = 0
        self._kv_usage = 0.0
        self._prefix = (0, 0)

    # -- Ray Serve's hooks -----------------------------------------------------------------------
    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        template = str(user_config["template"])
        overrides = dict(user_config.get("overrides") or {})
        if self.state is None:
            await self._start(template, overrides)
        elif (template, overrides) != self.applied:
            log.info("replica %s: reloading %s", self.replica_id, template)
            # The server keeps listening where it started (its port: a start-up override).
            await self.state.reload(template, {**overrides, "server.port": self.port})
        self.applied = (template, overrides)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        load = self.load()
        wait = load.estimated_wait_s
        return {
            "waiting": float(load.num_waiting),
            "running": float(load.num_running),
            "estimated_wait_s": -1.0 if wait is None else wait,
        }

    def check_health(self) -> None:
        if self.state is None or self.state.phase == "failed":
            detail = self.state.phase_detail if self.state is not None else "not started"
            raise RuntimeError(f"the replica's engine failed: {detail}")

    async def __del__(self) -> None:
        if self.reporting is not None:
            self.reporting.cancel()
        # Bounded: when the whole application is deleted the directory stops too, and a call
        # to a deployment without replicas would wait out Ray Serve's graceful stop.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.directory.leave.remote(self.replica_id), LEAVE_TIMEOUT_S)
        if self.state is not None:
            await self.state.drain_and_stop()
            if self.serving is not None:
                with contextlib.suppress(BaseException):
                    await self.serving

    # -- what the ingress and `cluster status` read ------------------------------------------------
    def load(self) -> ReplicaLoad:
        state = self.state
        client = state.client if state is not None else None
        waiting = running = 0
        wait: float | None = None
        if client is not None and not client.dead:
            classes = sorted(set(client.waiting_by_class) | set(client.in_transit))
            waiting = sum(client.queued(c) for c in classes)
            running = client.num_running
            wait = client.estimated_wait_s(classes)
        return ReplicaLoad(
            replica_id=self.replica_id,
            url=self.url,
            phase=state.phase if state is not None else "starting",
            template=str(state.template) if state is not None else "",
            num_waiting=waiting,
            num_running=running,
            estimated_wait_s=wait,
            kv_usage=self._kv_usage,
            prefix_cache_queries=self._prefix[0],
            prefix_cache_hits=self._prefix[1],
            pool=self.pool,
            pid=os.getpid(),
            node=socket.gethostname(),
        )

    # -- internals ---------------------------------------------------------------------------------
    async def _start(self, template: str, overrides: dict[str, Any]) -> None:
        from appliance.server.auth import check_bind
        from appliance.server.daemon import serve
        from appliance.server.state import ServerState

        host = str(overrides.get("server.host") or load_config(template, overrides).server.host)
        self.port = _free_port(host)
        overrides = {**overrides, "server.port": self.port}
        config = load_config(template, overrides)
        state = ServerState.create(config, template, overrides)
        check_bind(config.server.host, state.auth)
        self.state = state
        # A replica on another node is reached at its node's address.
        reach = host if host not in ("0.0.0.0", "::") else _node_ip()
        self.url = f"http://{reach}:{config.server.port}"
        self.serving = asyncio.create_task(serve(state), name="appliance-server")
        t0 = time.monotonic()
        while state.phase == "starting" and not self.serving.done():
            await asyncio.sleep(0.05)
        if state.phase != "ready":
            raise ConfigError(f"replica: the engine did not start ({state.phase_detail})")
        log.info(
            "replica %s ready at %s in %.1fs", self.replica_id, self.url, time.monotonic() - t0
        )
        self.reporting = asyncio.create_task(self._report_loop(), name="replica-report")

    async def _report_loop(self) -> None:
        n = 0
        while True:
            if n % STATS_EVERY == 0:
                await self._refresh_engine_stats()
            n += 1
            try:
                await self.directory.report.remote(self.load())
            except Exception as exc:  # the directory restarting: the next report retries
                log.warning("replica %s: report failed: %s", self.replica_id, exc)
            await asyncio.sleep(self.report_interval_s)

    async def _refresh_engine_stats(self) -> None:
        client = self.state.client if self.state is not None else None
        if client is None or client.dead:
            return
        try:
            engine = (await client.stats(timeout_s=2.0)).snapshot.engine
        except Exception:
            return
        self._kv_usage = engine.kv_usage
        self._prefix = (engine.prefix_cache_queries, engine.prefix_cache_hits)


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())
