"""What the console knows after each poll, and the status line that says it in words."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from appliance.console.client import ConsoleError
from appliance.console.figures import LatencyWindow, StepWindow
from appliance.console.hostinfo import HostInfo
from appliance.console.widgets import BAD, DIM, OK, WARN, secs
from rich.text import Text

from appliance.server.admin_schema import AdminStats, StepRecord
from appliance.stats import ReplicaLoad


@dataclass
class Snapshot:
    url: str
    poll_s: float
    readonly: bool
    # The last stats that came back; kept (and shown as stale) while the server is unreachable.
    stats: AdminStats | None = None
    # The last poll's failure, None when it succeeded.
    error: ConsoleError | None = None
    # Consecutive failed polls.
    failures: int = 0
    # time.monotonic() of the last good poll.
    updated: float | None = None
    metrics_error: str = ""
    host: HostInfo | None = None
    steps: list[StepRecord] = field(default_factory=list)
    latency: LatencyWindow = field(default_factory=LatencyWindow)
    window: StepWindow = field(default_factory=StepWindow)
    # GET /admin/config of the running engine (re-read when engine_generation changes).
    running: dict[str, Any] | None = None
    # The replicas behind a cluster's ingress, as it last listed them; None on a single box
    # (the stats above are then the one replica the ingress reads /admin/* from).
    replicas: list[ReplicaLoad] | None = None

    @property
    def config_max_num_seqs(self) -> int | None:
        if not self.running:
            return None
        return self.running.get("config", {}).get("scheduler", {}).get("max_num_seqs")

    @property
    def age_s(self) -> float | None:
        return None if self.updated is None else time.monotonic() - self.updated


def status_line(snap: Snapshot | None) -> tuple[Text, str]:
    """The text and CSS class ("", "-warn", "-error") of the status line."""
    if snap is None:
        return Text("connecting …"), ""
    ro = Text(" · read-only", DIM) if snap.readonly else Text("")
    if snap.error is not None:
        text = Text("✗ ", BAD).append(str(snap.error))
        if snap.error.kind == "auth":
            text.append("; retrying", DIM)
        else:
            text.append(f"; retrying every {snap.poll_s:g} s (attempt {snap.failures})", DIM)
        if snap.stats is not None and snap.age_s is not None:
            text.append(f"; figures below are {secs(snap.age_s)} old", DIM)
        return text + ro, "-error"
    stats = snap.stats
    if stats is None:
        return Text(f"connecting to {snap.url} …") + ro, ""
    phase = stats.server.phase
    colour = (
        OK if phase == "ready" else WARN if phase in ("starting", "reloading", "draining") else BAD
    )
    text = Text.assemble(("● ", colour), (stats.model_name, "bold"), " · ", (phase, colour))
    if stats.server.phase_detail:
        text.append(f" ({stats.server.phase_detail})", colour)
    if stats.server.paused:
        text.append(" · PAUSED (no steps until /admin/resume)", WARN)
    held = [f"{name} {how}" for name, how in stats.server.class_states.items() if how != "serving"]
    if held:
        text.append(" · " + ", ".join(held), WARN)
    if snap.replicas is not None:
        ready = sum(r.phase == "ready" for r in snap.replicas)
        text.append(
            f" · cluster: {ready} of {len(snap.replicas)} replicas ready",
            OK if ready == len(snap.replicas) and ready else WARN,
        )
    template = stats.config.template or "defaults"
    text.append(f" · {template.rsplit('/', 1)[-1]} · {snap.url.removeprefix('http://')}", DIM)
    text.append(f" · up {secs(stats.server.uptime_s)}", DIM)
    calm = phase == "ready" and not stats.server.paused and not held
    return text + ro, "" if calm else "-warn"
