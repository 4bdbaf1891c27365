"""`appliance up`: validate the template, listen at once (/health answers, /ready says 503
while the engine loads), start the engine core, then serve until SIGTERM drains it.

Signals: SIGTERM / SIGINT drain and exit 0; SIGHUP reloads the running template from disk
(systemd's ExecReload=kill -HUP $MAINPID). systemd is told STATUS= during loading, READY=1,
RELOADING=1 and STOPPING=1, and gets WATCHDOG=1 only while the engine loop answers pings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator

import msgspec
import uvicorn

from appliance.config import ConfigError, load_config
from appliance.engine.client import EngineError
from appliance.server import audited, sdnotify
from appliance.server.app import create_app
from appliance.server.auth import check_bind
from appliance.server.edge import OpenAIErrorH11Protocol
from appliance.server.reqlog import configure_json_lines
from appliance.server.state import ServerState

log = logging.getLogger("appliance.server")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: SIGTERM must drain first, not stop at once
    (and uvicorn re-raises the captured signal after serving, which would end the process with
    status 143 instead of 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def cmd_up(ns: argparse.Namespace) -> int:
    from appliance.config_sources import model_override, parse_sets

    t0 = time.monotonic()
    overrides = parse_sets(ns.set)
    if ns.model:
        overrides = {**model_override(ns.model), **overrides}
    if ns.host:
        overrides["server.host"] = ns.host
    if ns.port is not None:
        overrides["server.port"] = ns.port
    config = load_config(ns.template, overrides)
    configure_json_lines()
    state = ServerState.create(config, ns.template, overrides, log_level=ns.log_level)
    check_bind(config.server.host, state.auth)
    state.startup_phases["validate"] = time.monotonic() - t0
    return asyncio.run(serve(state, t0))


async def serve(state: ServerState, t0: float | None = None) -> int:
    """Run the server until it is stopped (SIGTERM, or state.stop_event); returns the exit code."""
    t0 = time.monotonic() if t0 is None else t0
    state.started_at = t0
    cfg = state.config.server
    server = _Server(
        uvicorn.Config(
            create_app(state),
            host=cfg.host,
            port=cfg.port,
            log_level="warning",
            access_log=False,  # one JSON line per request comes from the API itself
            lifespan="off",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=cfg.keep_alive_timeout_s,
            # Requests uvicorn refuses before the app runs still get OpenAI's error body.
            http=OpenAIErrorH11Protocol,
            h11_max_incomplete_event_size=cfg.max_header_bytes,
        )
    )
    _install_signals(state)
    serving = asyncio.create_task(_uvicorn(server), name="uvicorn")
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if serving.done():  # could not bind (uvicorn logged why)
        log.error("cannot listen on %s:%d: %s", cfg.host, cfg.port, serving.exception())
        return 1
    log.info(
        "listening on http://%s:%d (%.2fs); loading the engine",
        cfg.host,
        cfg.port,
        time.monotonic() - t0,
    )
    state.start_task = asyncio.create_task(_start(state, t0), name="engine-start")
    watchdog = asyncio.create_task(_watchdog(state), name="watchdog")
    await state.stop_event.wait()
    watchdog.cancel()
    server.should_exit = True
    await serving
    if state.start_task is not None and not state.start_task.done():
        state.start_task.cancel()
        with contextlib.suppress(BaseException):
            await state.start_task
    await state.stop_engine()
    log.info("stopped (exit code %d)", state.exit_code)
    return state.exit_code


async def _uvicorn(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit as exc:  # uvicorn exits the process on start-up failures; report instead
        raise RuntimeError(f"uvicorn start-up failed (status {exc.code})") from None


async def _start(state: ServerState, t0: float) -> None:
    sdnotify.notify("STATUS=loading the engine")
    try:
        await state.start_engine(state.config)
    except (EngineError, ConfigError, OSError) as exc:
        log.error("the engine failed to start: %s", exc)
        state.set_phase("failed", str(exc))
        state.exit_code = 1
        state.stop_event.set()
        return
    if state.phase != "starting":  # a SIGTERM arrived while loading
        return
    state.ready_after_s = time.monotonic() - t0
    state.set_phase("ready")
    info = state.info
    assert info is not None
    phases = {k: round(v, 3) for k, v in state.startup_phases.items()}
    log.info(
        "ready in %.2fs: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d; phases %s",
        state.ready_after_s,
        info.model_name,
        info.device,
        info.dtype,
        info.num_blocks,
        info.block_size,
        info.max_model_len,
        msgspec.json.encode(phases).decode(),
    )
    sdnotify.notify("READY=1")
    sdnotify.notify(f"STATUS=serving {info.model_name}")


def _install_signals(state: ServerState) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # embedded (tests): the owner stops it through state.stop_event
    loop = asyncio.get_running_loop()

    def on_term(signame: str) -> None:
        log.info("%s: draining", signame)
        if state.phase == "starting":
            state.set_phase("stopped", f"{signame} while loading")
            state.stop_event.set()
            return
        if state.phase == "draining":
            # A second signal: the operator will not wait; end the in-flight requests now.
            log.warning("%s again: aborting %d in-flight requests", signame, len(state.inflight))
            for gen in list(state.inflight):
                gen.cut(
                    f"the server is stopping ({signame} during the drain)", code="server_stopping"
                )
            return
        asyncio.ensure_future(audited.drain_and_stop(state, audited.signal_actor()))

    def on_hup() -> None:
        if state.phase != "ready":
            log.warning("SIGHUP ignored while %s", state.phase)
            return
        asyncio.ensure_future(_reload_same(state))

    loop.add_signal_handler(signal.SIGTERM, on_term, "SIGTERM")
    loop.add_signal_handler(signal.SIGINT, on_term, "SIGINT")
    loop.add_signal_handler(signal.SIGHUP, on_hup)


async def _reload_same(state: ServerState) -> None:
    log.info("SIGHUP: reloading %s", state.template)
    try:
        result = await audited.reload(
            state, state.template, state.overrides, audited.signal_actor(), "reload"
        )
        log.info("reloaded in %.2fs", result["seconds"])
    except (ConfigError, EngineError) as exc:
        log.error("reload failed: %s", exc)


async def _watchdog(state: ServerState) -> None:
    """WATCHDOG=1 only while the engine loop answers: a wedged core gets the unit restarted."""
    interval = sdnotify.watchdog_interval_s()
    if interval is None:
        return
    while True:
        client = state.client
        try:
            # A deliberate drain or reload stops the engine on purpose, bounded by
            # drain_timeout_s and TimeoutStopSec: an engine busy shutting down (seconds on a
            # loaded box) is not a wedged one, and systemd would kill the unit mid-stop.
            stopping = state.phase in ("draining", "stopped", "reloading")
            if client is not None and not client.dead and not stopping:
                await client.ping(timeout_s=interval)
            sdnotify.watchdog_ping()
        except (TimeoutError, EngineError):
            log.warning("watchdog: the engine loop did not answer within %.1fs", interval)
        await asyncio.sleep(interval)
