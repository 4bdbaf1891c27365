"""The whole-engine actions, as the audit log records them: a template apply or reload (with
its rollback when the new engine fails) and a drain. The admin routes and the daemon's signal
handlers call these, so each is recorded once, whoever started it."""

from __future__ import annotations

import os
from typing import Any

from appliance.config import ConfigError
from appliance.engine.client import EngineError
from appliance.server.live_config import config_diff
from appliance.server.state import ServerState


def signal_actor() -> str:
    """Who sent a signal: systemd when it runs this process (it sets INVOCATION_ID), else
    whoever holds the terminal."""
    return "systemd" if os.environ.get("INVOCATION_ID") else "signal"


async def reload(
    state: ServerState, template: str | None, overrides: dict[str, Any], actor: str, action: str
) -> dict[str, Any]:
    """state.reload, recorded: outcome ok, refused (nothing changed), rolled_back (the new
    engine failed and the previous one serves again) or failed."""
    before = state.config
    what = {"template": template, "overrides": overrides}
    with state.audit.action(actor, action, what) as act:
        try:
            result = await state.reload(template, overrides)
        except ConfigError as exc:
            act.fail("refused", str(exc))
            raise
        except EngineError as exc:
            act.fail("rolled_back" if state.phase == "ready" else "failed", str(exc))
            raise
        act.diff = config_diff(before, state.config)
    return result


async def drain_and_stop(state: ServerState, actor: str) -> None:
    in_flight = len(state.inflight)
    with state.audit.action(actor, "drain", {"requests_in_flight": in_flight}):
        await state.drain_and_stop()
