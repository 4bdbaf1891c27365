"""The schema of `GET /admin/stats`: what the console (and any script) can rely on.

Decode a response with `msgspec.json.decode(body, type=AdminStats)`. Importing this module pulls
in neither torch nor Litestar. Times: `time` fields are Unix seconds (time.time()); ages and
durations are seconds. Counters restart at zero when the engine is rebuilt (/admin/reload);
`server.engine_generation` tells a client that this happened.
"""

from __future__ import annotations

from typing import Any

import msgspec

from appliance.stats import EngineStats, LiveRequest, PreemptionEvent, QueueInfo, StepRecord

__all__ = [
    "AdminStats",
    "ConfigRef",
    "EngineStats",
    "LiveRequest",
    "PreemptionEvent",
    "QueueInfo",
    "ServerInfo",
    "StepRecord",
]


class ConfigRef(msgspec.Struct, kw_only=True):
    """Which template the engine runs (GET /admin/config has the full values)."""

    # As given to `appliance up --template` or /admin/reload (a name or a path); None = defaults.
    template: str | None
    # The file it resolved to ("" for defaults).
    path: str
    # The --set / reload overrides applied on top, dotted keys.
    overrides: dict[str, Any]
    description: str


class ServerInfo(msgspec.Struct, kw_only=True):
    # starting | ready | draining | reloading | stopped | failed
    phase: str
    phase_detail: str
    pid: int
    # The engine core process (None while none runs).
    core_pid: int | None
    uptime_s: float
    # Seconds from process start to the first READY (None: not yet).
    ready_after_s: float | None
    # Seconds per start-up phase of the running engine ("core.load_weights", ...).
    startup_phases: dict[str, float]
    # HTTP generation requests in flight and served since start.
    requests_in_flight: int
    requests_served: int
    # Increments at every engine (re)build.
    engine_generation: int
    # Scheduling paused through /admin/pause (requests wait, nothing is lost).
    paused: bool = False
    # Requests whose output state (text, tokens, logprobs) the API process holds right now.
    requests_tracked: int = 0
    # The last /admin/reload or SIGHUP: {"ok", "time", "seconds" | "error", ...}; {} if none.
    last_reload: dict[str, Any]
    # Each priority class: serving | paused (queue held) | draining (queue served); both of
    # the latter refuse new requests (POST /admin/classes/{name}/pause).
    class_states: dict[str, str] = {}


class AdminStats(msgspec.Struct, kw_only=True):
    time: float
    model_name: str
    model_dir: str
    max_model_len: int
    device: str
    dtype: str
    # CPU engines: the CPU's features, the dtypes and matmul path picked, the native decode and
    # why (appliance.cpu.backend); {} on CUDA or while no engine runs.
    backend: dict[str, Any]
    config: ConfigRef
    server: ServerInfo
    # None while no engine runs (starting, reloading, failed).
    engine: EngineStats | None
    # Engine steps of the last `history_s` seconds, oldest first.
    history: list[StepRecord]
    history_s: float
    # Recent preemptions, oldest first (bounded log).
    preemptions: list[PreemptionEvent]
    requests: list[LiveRequest]
    # One entry per priority class, most urgent first.
    queues: list[QueueInfo]
    # Per-request objects alive in the engine process (Request, EngineOutput, Logprob), counted
    # after a garbage collection; only with ?count_objects=true (a leak check).
    engine_objects: dict[str, int] = {}
