"""`appliance console`: the Textual app, its polling loop and its command line.

One poll a second runs in an exclusive worker (`@work(exclusive=True)`), so the UI never waits
for the network: it fetches /admin/stats (only the last few seconds of step history, the
console keeps the minute), /metrics and the local GPU/host figures concurrently, folds them
into a `Snapshot`, and assigns it to the reactive `snapshot` that every screen watches.
"""

from __future__ import annotations

import asyncio
import time

from appliance.console.audit import AuditScreen
from appliance.console.client import AdminClient, ConsoleError, ServerError
from appliance.console.dashboard import DashboardScreen
from appliance.console.dialogs import HelpScreen
from appliance.console.hostinfo import read_host
from appliance.console.requests import RequestsScreen
from appliance.console.state import Snapshot
from appliance.console.templates import TemplatesScreen
from textual import work
from textual.app import App
from textual.binding import Binding
from textual.reactive import reactive

from appliance.stats import ReplicaLoad

POLL_S = 1.0
# History asked for on each poll beyond the time since the last good one: covers a late poll.
HISTORY_MARGIN_S = 3.0


class ConsoleApp(App[None]):
    TITLE = "appliance console"
    MODES = {
        "dashboard": DashboardScreen,
        "templates": TemplatesScreen,
        "requests": RequestsScreen,
        "audit": AuditScreen,
    }
    DEFAULT_MODE = "dashboard"
    # The palette's footer entry would push the screens' own keys off an 80-column footer.
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("d", "switch_mode('dashboard')", "Dashboard"),
        Binding("t", "switch_mode('templates')", "Templates"),
        Binding("r", "switch_mode('requests')", "Requests"),
        Binding("l", "switch_mode('audit')", "Audit"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
    ]

    snapshot: reactive[Snapshot | None] = reactive(None, always_update=True, init=False)

    def __init__(
        self,
        url: str,
        token: str | None = None,
        readonly: bool = False,
        poll_s: float = POLL_S,
        client: AdminClient | None = None,
    ) -> None:
        super().__init__()
        self.url = url.rstrip("/")
        self.readonly = readonly
        self.poll_s = poll_s
        self.client = client or AdminClient(self.url, token)
        self._snap = Snapshot(url=self.url, poll_s=poll_s, readonly=readonly)
        self._polling = False
        self._config_generation: int | None = None
        self._single_box = False
        self.polls = 0  # completed polls, for tests and screenshots

    def on_mount(self) -> None:
        self.set_interval(self.poll_s, self._tick)
        self._tick()

    async def on_unmount(self) -> None:
        await self.client.aclose()

    def _tick(self) -> None:
        # A poll still in flight (slow server) is left to finish: cancelling it every second
        # would mean no poll ever completes against a server slower than the period.
        if not self._polling:
            self._polling = True
            self.poll()

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.readonly))

    def refresh_now(self) -> None:
        """Poll at once (after an apply or an abort) instead of waiting for the next tick."""
        self._tick()

    @work(exclusive=True, group="poll")
    async def poll(self) -> None:
        try:
            await self._poll_once()
        finally:
            self._polling = False
            self.polls += 1
            self.snapshot = self._snap

    async def _poll_once(self) -> None:
        snap = self._snap
        since = snap.age_s
        history_s = 60.0 if since is None else min(60.0, since + HISTORY_MARGIN_S)
        stats, metrics, host, replicas = await asyncio.gather(
            self.client.stats(history_s),
            self.client.metrics(),
            asyncio.to_thread(read_host),
            self._cluster_replicas(),
            return_exceptions=True,
        )
        snap.replicas = None if isinstance(replicas, BaseException) else replicas
        if isinstance(host, BaseException):
            snap.host = None
        else:
            snap.host = host
        if isinstance(stats, BaseException):
            if not isinstance(stats, ConsoleError):
                stats = ConsoleError(f"{type(stats).__name__}: {stats}")
            snap.error = stats
            snap.failures += 1
            return
        snap.error, snap.failures = None, 0
        snap.stats = stats
        snap.updated = time.monotonic()
        snap.window.merge(stats.history, stats.server.engine_generation, stats.time)
        snap.steps = snap.window.steps
        if isinstance(metrics, BaseException):
            snap.metrics_error = str(metrics)
        else:
            snap.metrics_error = ""
            snap.latency.add(stats.time, metrics)
        if stats.server.engine_generation != self._config_generation and stats.engine is not None:
            await self._read_config(stats.server.engine_generation)

    async def _cluster_replicas(self) -> list[ReplicaLoad] | None:
        """Asked until a 404 says this is a single box (then never again)."""
        if self._single_box:
            return None
        replicas = await self.client.cluster_replicas()
        self._single_box = replicas is None
        return replicas

    async def read_config_now(self) -> None:
        """After a live knob change: the running config changed without a new engine."""
        await self._read_config(self._config_generation or 0)

    async def _read_config(self, generation: int) -> None:
        try:
            self._snap.running = await self.client.config()
            self._config_generation = generation
        except (ConsoleError, ServerError):
            pass  # retried next poll; the dashboard only uses it for max_num_seqs
