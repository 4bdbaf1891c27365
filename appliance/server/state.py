"""What the server knows at run time, and its life cycle: start the engine, drain, reload, stop.

Phases: starting (engine loading) -> ready <-> reloading; ready -> draining -> stopped; failed
when the engine cannot be started. Only `ready` takes new generation requests; everything else
answers 503, which is what a load balancer needs to route around this box.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.config import (
    ApplianceConfig,
    ConfigError,
    load_config,
    served_model_name,
)
from appliance.config_sources import resolve_template
from appliance.engine import ipc
from appliance.engine.client import EngineClient, EngineError
from appliance.metrics import Metrics
from appliance.server import sdnotify
from appliance.server.audit import AuditLog, state_dir
from appliance.server.auth import AuthKeys
from appliance.server.reqlog import RequestLog
from appliance.server.response_store import ResponseStore

if TYPE_CHECKING:
    from appliance.server.generate import Generation

log = logging.getLogger("appliance.server")

# After a drain ends, the most the stop can still take, in seconds: cut streams writing their
# last chunk (CUT_FLUSH_S), the engine core's shutdown (EngineClient.shutdown: 10 s, then a kill
# and 5 s to reap it) and uvicorn closing connections (daemon.py, timeout_graceful_shutdown 5).
# systemd's TimeoutStopSec must leave drain_timeout_s plus this (tests/test_systemd.py).
CUT_FLUSH_S = 2.0
STOP_AFTER_DRAIN_S = CUT_FLUSH_S + 10.0 + 5.0 + 5.0


@dataclass
class ServerState:
    config: ApplianceConfig
    # The template as given (name or path) and the overrides, for /admin/config and SIGHUP.
    template: str | None
    overrides: dict[str, Any]
    auth: AuthKeys
    metrics: Metrics
    log_level: str = "INFO"
    phase: str = "starting"
    phase_detail: str = ""
    client: EngineClient | None = None
    info: ipc.CoreInfo | None = None
    tokenizer: Any = None
    # Start-up `server.*` overrides (API key and admin token files, bind address) that every
    # reload keeps: a template applied from the console must not drop the unit's keys.
    pinned_overrides: dict[str, Any] = field(default_factory=dict)
    # Token id -> text for logprobs (format.TokenText), rebuilt when the tokenizer changes.
    token_text: Any = None
    inflight: set[Generation] = field(default_factory=set)
    request_log: RequestLog = field(default_factory=RequestLog)
    # The Responses API's stored responses (in memory: a restart forgets them).
    responses: ResponseStore = field(default_factory=ResponseStore)
    started_at: float = field(default_factory=time.monotonic)
    ready_after_s: float | None = None
    startup_phases: dict[str, float] = field(default_factory=dict)
    last_reload: dict[str, Any] = field(default_factory=dict)
    engine_generation: int = 0
    # Scheduling paused by the operator; a rebuilt engine starts unpaused.
    paused: bool = False
    # Priority classes paused by the operator (admin_live.py): name -> "paused" (queued requests
    # held) or "draining" (queued requests served); both refuse new ones. Kept across reloads.
    class_states: dict[str, str] = field(default_factory=dict)
    audit: AuditLog = field(default_factory=lambda: AuditLog(state_dir("")))
    start_task: asyncio.Task[None] | None = None
    # Set when the engine dies or a stop is requested; the daemon waits on it.
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int = 0
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def create(
        cls,
        config: ApplianceConfig,
        template: str | None,
        overrides: dict[str, Any],
        log_level: str = "INFO",
    ) -> ServerState:
        state = cls(
            config,
            template,
            dict(overrides),
            AuthKeys.from_config(config.server),
            Metrics(served_model_name(config)),
            log_level,
        )
        state.pinned_overrides = {k: v for k, v in overrides.items() if k.startswith("server.")}
        state.audit = AuditLog(state_dir(config.server.state_dir), config.server.audit_max_bytes)
        return state

    # -- identity --------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    @property
    def model_name(self) -> str:
        return self.info.model_name if self.info else served_model_name(self.config)

    def lora_adapters(self) -> dict[str, str]:
        """LoRA adapters requests may name as `model` (name -> path), as the core last said."""
        return (self.info.lora_adapters or {}) if self.info else {}

    @property
    def template_path(self) -> str:
        if self.template is None:
            return ""
        try:
            return str(resolve_template(self.template))
        except ConfigError:
            return str(self.template)

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{os.getpid():x}{next(self._ids):06d}"

    def set_phase(self, phase: str, detail: str = "") -> None:
        self.phase, self.phase_detail = phase, detail
        log.info("phase: %s%s", phase, f" ({detail})" if detail else "")

    # -- engine ----------------------------------------------------------------------------------
    def _status(self, text: str) -> None:
        log.info("engine: %s", text)
        sdnotify.notify(f"STATUS={text}")

    def _on_frame(self, frame: ipc.Frame) -> None:
        if frame.steps:
            self.metrics.observe_steps(frame.steps)

    def _on_death(self, reason: str) -> None:
        if self.phase in ("ready", "draining"):
            self.set_phase("failed", reason)
            self.exit_code = 1
            self.stop_event.set()

    async def start_engine(self, config: ApplianceConfig, replace: bool = False) -> None:
        """Start a core for `config` and load the tokenizer; raises EngineError/ConfigError.
        With `replace`, the running core keeps going until the new one is up, then stops."""
        t0 = time.monotonic()
        client = EngineClient(config, self.log_level, self._status, self._on_frame, self._on_death)
        # The tokenizer loads here while the core loads the weights (the model directory is
        # usually there already; a demo model built on first start is read afterwards).
        expected_dir = Path(os.path.expanduser(config.model.path))
        early = asyncio.create_task(asyncio.to_thread(_load_tokenizer_if_present, expected_dir))
        try:
            info = await client.start()
        except BaseException:
            early.cancel()
            raise
        t_core = time.monotonic() - t0
        t = time.monotonic()
        try:
            tokenizer = await early
            if tokenizer is None or Path(info.model_dir) != expected_dir:
                tokenizer = await asyncio.to_thread(_load_tokenizer, Path(info.model_dir))
        except Exception:
            await client.shutdown()
            raise
        self.startup_phases.update(
            {
                **{f"core.{k}": v for k, v in info.phase_times.items()},
                "core_total": t_core,
                "api_tokenizer_wait": time.monotonic() - t,
            }
        )
        client.output.tokenizer = tokenizer
        old = self.client if replace else None
        self.client, self.info, self.tokenizer, self.config = client, info, tokenizer, config
        self.engine_generation += 1
        self.paused = False
        for name, how in self.class_states.items():
            client.hold_class(name, how == "paused")
        if old is not None:
            await old.shutdown()
        cache = config.cache
        self.metrics.engine_rebuilt(
            info.model_name,
            {
                "block_size": info.block_size,
                "cache_dtype": cache.kv_cache_dtype,
                "enable_prefix_caching": cache.enable_prefix_caching,
                "num_gpu_blocks": info.num_blocks,
                "num_cpu_blocks": info.num_swap_blocks,
                "swap_space_gib": cache.swap_space,
            },
            # Class labels to create at zero: the configured classes; with none, "0" (what a
            # preempted request of the default priority 0 is counted under).
            list(config.priority_classes) or [config.class_of(0)],
        )
        for name, how in self.class_states.items():
            self.metrics.set_class_state(name, how)

    async def stop_engine(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.shutdown()

    def set_paused(self, paused: bool) -> None:
        """Stop or restart the engine core's steps (/admin/pause, /admin/resume)."""
        client = self.client
        if client is None or client.dead:
            raise EngineError(f"no engine running ({self.phase})")
        client.set_paused(paused)
        self.paused = paused

    # -- draining --------------------------------------------------------------------------------
    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no generation is in flight; False (after cutting them) on timeout. Cut
        requests end with finish_reason "abort" and an error (SSE event or 503); both kinds
        are counted (appliance_drain_requests_total) and logged."""
        deadline = time.monotonic() + timeout_s
        if self.paused:
            with contextlib.suppress(EngineError):  # a dead engine has nothing left to finish
                self.set_paused(False)  # a drain finishes work; a paused engine never would
        draining = list(self.inflight)
        for gen in draining:
            gen.drain_outcome = "drained"
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cut = list(self.inflight)
        if cut:
            log.warning("drain timeout (%.0fs): cutting %d requests", timeout_s, len(cut))
            why = f"the server is {self.phase}: request cut after drain_timeout_s {timeout_s}"
            for gen in cut:
                gen.cut(why)
            # Let the streams write their last chunk and error event (bounded: a client that
            # does not read cannot hold the stop).
            flush_until = time.monotonic() + CUT_FLUSH_S
            while self.inflight and time.monotonic() < flush_until:
                await asyncio.sleep(0.02)
        drained = sum(1 for gen in draining if gen.drain_outcome == "drained")
        self.metrics.count_drain(drained, len(cut))
        log.info("drain: %d requests finished, %d cut", drained, len(cut))
        return not cut

    async def drain_and_stop(self) -> None:
        """SIGTERM: refuse new work (503), let in-flight requests finish, stop the engine."""
        if self.phase in ("draining", "stopped"):
            return
        async with self._lock:  # a reload in progress completes first
            self.set_phase("draining", f"{len(self.inflight)} requests in flight")
            sdnotify.notify("STOPPING=1")
            await self.wait_idle(self.config.server.drain_timeout_s)
            await self.stop_engine()
            self.set_phase("stopped")
            self.stop_event.set()

    # -- reload ----------------------------------------------------------------------------------
    async def reload(self, template: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
        """Validate, drain, rebuild the engine, resume. Raises ConfigError (nothing changed) or
        EngineError (the previous engine was restored). Returns a summary."""
        new = load_config(template, overrides)  # ConfigError: nothing touched yet
        _check_model_path(new)
        if new.server.host != self.config.server.host or new.server.port != self.config.server.port:
            log.warning("reload: server.host/port changes apply at the next start only")
        new_auth = AuthKeys.from_config(new.server)
        if self._lock.locked():
            raise ConfigError("a reload is already in progress")
        async with self._lock:
            return await self._swap(new, new_auth, template, overrides)

    async def _swap(
        self,
        new: ApplianceConfig,
        new_auth: AuthKeys,
        template: str | None,
        overrides: dict[str, Any],
    ) -> dict[str, Any]:
        old_config, old_template, old_overrides = self.config, self.template, self.overrides
        sdnotify.notify("RELOADING=1")
        self.set_phase("reloading", f"draining {len(self.inflight)} requests")
        t0 = time.monotonic()
        await self.wait_idle(old_config.server.drain_timeout_s)
        # On the CPU the new engine loads beside the idle old one, which simply stays when the
        # new one fails. On a GPU two copies of the weights may not fit: stop first, and
        # restart the previous configuration on failure.
        overlap = old_config.hardware.device == "cpu" and new.hardware.device == "cpu"
        if not overlap:
            await self.stop_engine()
        try:
            await self.start_engine(new, replace=overlap)
        except (EngineError, ConfigError, OSError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.error("reload failed (%s); keeping the previous engine", reason)
            try:
                if not overlap:
                    await self.start_engine(old_config)
            except Exception as again:
                self.set_phase("failed", f"restoring the previous engine failed too: {again}")
                self.exit_code = 1
                self.stop_event.set()
                raise
            self._finish_reload(old_config, old_template, old_overrides)
            self.last_reload = {"ok": False, "error": reason, "time": time.time()}
            raise EngineError(f"reload failed, previous configuration restored: {reason}") from exc
        self.auth = new_auth
        self._finish_reload(new, template, overrides)
        self.last_reload = {
            "ok": True,
            "template": template,
            "overrides": overrides,
            "seconds": time.monotonic() - t0,
            "time": time.time(),
        }
        return self.last_reload

    def _finish_reload(
        self, config: ApplianceConfig, template: str | None, overrides: dict[str, Any]
    ) -> None:
        self.config, self.template, self.overrides = config, template, dict(overrides)
        self.set_phase("ready")
        sdnotify.notify("READY=1")
        sdnotify.notify(f"STATUS=serving {self.model_name}")


def _load_tokenizer(model_dir: Path) -> Any:
    from appliance.models.hf_files import load_tokenizer

    return load_tokenizer(model_dir)


def _load_tokenizer_if_present(model_dir: Path) -> Any:
    if not (model_dir / "config.json").is_file():
        return None
    try:
        return _load_tokenizer(model_dir)
    except Exception:  # the core reports the real problem; retried after it is up
        return None


def _check_model_path(config: ApplianceConfig) -> None:
    """Refuse before draining anything when the new model cannot be found."""
    if not config.model.path:
        raise ConfigError("model.path: no model directory given")
    from appliance.models.gguf_meta import find_gguf

    path = Path(os.path.expanduser(config.model.path))
    try:
        gguf = find_gguf(path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if (
        not (path / "config.json").is_file()
        and gguf is None
        and not (config.model.demo_shape or config.model.packaged)
    ):
        raise ConfigError(
            f"model.path: {str(path)!r} holds no Hugging Face model (config.json) and no GGUF file"
        )
