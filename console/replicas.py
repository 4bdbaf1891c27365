"""The replicas panel: pointed at a cluster's ingress (`appliance cluster up`), the console lists
the replicas it routes to, each with its phase, queue, KV use and estimated wait, in the place of
the GPU/host panel (which reads the console's own machine, not the cluster's)."""

from __future__ import annotations

from appliance.console.panels import host_text
from appliance.console.state import Snapshot
from appliance.console.widgets import BAD, DIM, OK, WARN, secs
from rich.text import Text

HOST_TITLE = "GPU · host"
REPLICAS_TITLE = "Replicas"


def replicas_text(snap: Snapshot, width: int, rows: int) -> Text:
    """One line per replica, the least ready first, then a line of totals."""
    replicas = sorted(snap.replicas or [], key=lambda r: (r.phase == "ready", r.replica_id))
    text = Text(no_wrap=True, overflow="crop")
    if not replicas:
        return text.append("no replica has reported yet", WARN)
    shown = replicas if len(replicas) <= max(1, rows - 1) else replicas[: max(1, rows - 2)]
    for r in shown:
        colour = OK if r.phase == "ready" else BAD if r.phase == "unreachable" else WARN
        wait = "" if r.estimated_wait_s is None else f" · wait {secs(r.estimated_wait_s)}"
        pool = "" if r.pool == "default" else f" [{r.pool}]"
        text.append("● ", colour).append(f"{r.replica_id[:10]}{pool} ")
        text.append(r.phase, colour)
        text.append(
            f" · run {r.num_running} · queue {r.num_waiting} · KV {r.kv_usage * 100:.0f}%{wait}\n"
        )
    if len(shown) < len(replicas):
        text.append(f"… {len(replicas) - len(shown)} more\n", DIM)
    templates = {r.template.rsplit("/", 1)[-1] for r in replicas}
    running = sum(r.num_running for r in replicas)
    waiting = sum(r.num_waiting for r in replicas)
    text.append(f"{len(replicas)} replicas · run {running} · queue {waiting}", DIM)
    if len(templates) > 1:
        # A rolling `cluster apply` in progress: replicas on two templates at once.
        text.append(f" · templates {', '.join(sorted(templates))}", WARN)
    return text


def host_or_replicas_text(snap: Snapshot, width: int, rows: int) -> Text:
    if snap.replicas is not None:
        return replicas_text(snap, width, rows)
    return host_text(snap, width, rows)
