"""The console as an operator uses it for issue 29's levers, against a real `appliance up`: a
live knob typed on the templates screen is confirmed with its diff and lands without a
rebuild, a refused one says why and changes nothing, the batch class is paused and resumed from
the audit screen, and the audit screen lists both actions under the console's name."""

from __future__ import annotations

from typing import Any

import httpx
import test_console
from appliance.console.audit import AuditScreen
from appliance.console.dialogs import ConfirmScreen, InputScreen
from server_harness import ServerProcess
from test_console import TOKEN, admin_config, admin_stats, console, polled, screen_text, until

# The console tests' server (its templates tiny-a, tiny-b), started once for this module too.
server = test_console.server


async def type_line(pilot: Any, line: str) -> None:
    for key in line:
        await pilot.press("space" if key == " " else key)
    await pilot.press("enter")


async def test_knob_change_and_class_pause_from_the_console(server: ServerProcess) -> None:
    generation = admin_stats(server)["server"]["engine_generation"]
    app = console(server)
    async with app.run_test(size=(100, 30)) as pilot:
        await polled(app, pilot, 1)
        await app.switch_mode("templates")
        await polled(app, pilot, 1)
        # A refused value: the server's 400 on screen, nothing changed.
        await pilot.press("k")
        assert isinstance(app.screen, InputScreen)
        await type_line(pilot, "scheduler.max_num_seqs = 0")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await until(pilot, lambda: "nothing changed" in screen_text(app), 10, "refusal")
        assert "scheduler.max_num_seqs" in screen_text(app)
        assert admin_config(server)["config"]["scheduler"]["max_num_seqs"] == 16
        # A valid one: the confirmation shows the diff against the running value.
        await pilot.press("k")
        await type_line(pilot, "scheduler.max_num_seqs = 4")
        assert isinstance(app.screen, ConfirmScreen)
        assert "scheduler.max_num_seqs: 16 → 4" in screen_text(app)
        await pilot.press("y")
        await until(pilot, lambda: "max_num_seqs 16 → 4" in screen_text(app), 10, "outcome")
        assert admin_config(server)["config"]["scheduler"]["max_num_seqs"] == 4
        # The audit screen: pause the batch class (the last row).
        await app.switch_mode("audit")
        assert isinstance(app.screen, AuditScreen)
        await polled(app, pilot, 1)
        await pilot.press("down", "down")
        await pilot.press("p")
        assert isinstance(app.screen, ConfirmScreen) and "batch" in screen_text(app)
        await pilot.press("y")
        await until(pilot, lambda: "batch: paused" in screen_text(app), 10, "paused")
        assert admin_stats(server)["server"]["class_states"]["batch"] == "paused"
        await until(pilot, lambda: "batch paused" in screen_text(app), 10, "status line")
        await until(pilot, lambda: "class_pause" in screen_text(app), 10, "audit rows")
        text = screen_text(app)
        assert "knob_change" in text and "refused" in text and "console" in text
        await pilot.press("u")
        await pilot.press("y")
        await until(pilot, lambda: "batch: serving" in screen_text(app), 10, "resumed")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    records = server.get("/admin/audit", headers=headers).json()["records"]
    assert [(r["action"], r["actor"], r["outcome"]) for r in records[-4:]] == [
        ("knob_change", "console", "refused"),
        ("knob_change", "console", "ok"),
        ("class_pause", "console", "ok"),
        ("class_resume", "console", "ok"),
    ]
    # A live knob is no rebuild: the same engine serves on.
    assert admin_stats(server)["server"]["engine_generation"] == generation
    # Leave the module's server as its other tests expect it.
    restore = {"scheduler": {"max_num_seqs": 16}}
    assert httpx.patch(server.url + "/admin/config", json=restore, headers=headers).is_success
