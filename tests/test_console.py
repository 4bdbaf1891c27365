"""The Textual console driven by its pilot against a real `appliance up` (tiny demo model, a
16-block KV pool so a few long requests force preemptions): the figures on screen match
/admin/stats, preemption counters move on screen under load, requests can be aborted,
templates can be applied, rolled back and refused, and a server that is down, a wrong admin
token and a box without a GPU each get a clear message rather than a traceback."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pynvml
import pytest
from appliance.console.app import ConsoleApp
from appliance.console.dialogs import ConfirmScreen, HelpScreen
from server_harness import START_TIMEOUT_S, ServerProcess, free_port
from textual.widgets import DataTable

from appliance.tools.screenshots import svg_text

TOKEN = "console-test-token"
POLL_S = 0.25  # faster than an operator's 1 s: the tests wait on polls

TEMPLATE = """\
description = "{description}"
[model]
path = "{model}"
name = "tiny"
dtype = "float32"
max_model_len = 256
[cache]
num_blocks = 16
swap_space = 0.01
[scheduler]
policy = "priority"
max_num_seqs = {max_num_seqs}
max_num_batched_tokens = 512
[priority_classes]
realtime = {{ priority = 0, queue_timeout_s = 30.0 }}
interactive = {{ priority = 5 }}
batch = {{ priority = 10, queue_timeout_s = 120.0 }}
[hardware]
device = "cpu"
[server]
admin_token_file = "{token}"
"""


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("console")
    (d / "admin").write_text(TOKEN + "\n")
    tdir = d / "templates"
    tdir.mkdir()

    def template(name: str, description: str, max_num_seqs: int, model: Path | str) -> None:
        (tdir / f"{name}.toml").write_text(
            TEMPLATE.format(
                description=description, model=model, max_num_seqs=max_num_seqs, token=d / "admin"
            )
        )

    template("tiny-a", "console tests A", 16, tiny_model_dir)
    template("tiny-b", "console tests B: fewer sequences", 8, tiny_model_dir)
    template("tiny-broken", "a model that is not there", 16, d / "no-such-model")
    env = {"APPLIANCE_TEMPLATE_DIR": str(tdir)}
    # The console lists templates in this process: it must see the same operator directory.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("APPLIANCE_TEMPLATE_DIR", str(tdir))
        srv = ServerProcess(Path("tiny-a"), d / "log.txt", env=env).start()
        try:
            yield srv
        finally:
            assert srv.stop() == 0, srv.log()


def admin_stats(srv: ServerProcess) -> dict[str, Any]:
    return srv.get(
        "/admin/stats", params={"history_s": 0}, headers={"Authorization": f"Bearer {TOKEN}"}
    ).json()


def admin_config(srv: ServerProcess) -> dict[str, Any]:
    return srv.get("/admin/config", headers={"Authorization": f"Bearer {TOKEN}"}).json()


def screen_text(app: ConsoleApp) -> str:
    """What the terminal shows, read back out of Textual's SVG export."""
    return "\n".join(svg_text(app.export_screenshot()))


def flat(text: str) -> str:
    """Words in screen order, whatever the wrapping: for messages longer than a line."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


async def until(
    pilot: Any, predicate: Callable[[], Any], timeout_s: float = 30.0, what: str = ""
) -> Any:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        value = predicate()
        if value:
            return value
        await pilot.pause(0.1)
    raise AssertionError(f"not met in {timeout_s}s: {what}\n{screen_text(pilot.app)}")


async def polled(app: ConsoleApp, pilot: Any, n: int = 1) -> None:
    target = app.polls + n
    await until(pilot, lambda: app.polls >= target, what=f"{n} polls")
    await pilot.pause(0.05)  # the watchers run after the poll completes


def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)


def console(srv: ServerProcess, **kw: Any) -> ConsoleApp:
    return ConsoleApp(srv.url, kw.pop("token", TOKEN), poll_s=POLL_S, **kw)


def long_prompt(seed: int) -> list[int]:
    # 127 tokens: 8 blocks of 16 and one slot left; the second generated token needs a 9th
    # block, so two such requests overflow the 16-block pool and one is preempted.
    return [(seed * 131 + i * 17) % 4000 + 10 for i in range(127)]


# -- the dashboard -----------------------------------------------------------------------------


async def test_dashboard_numbers_match_admin_stats(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_nvml(monkeypatch)
    # One finished request leaves cached blocks and token totals to compare.
    server.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": long_prompt(1), "max_tokens": 4, "ignore_eos": True},
    )
    app = console(server)
    async with app.run_test(size=(160, 48)) as pilot:
        await polled(app, pilot, 2)
        ref = admin_stats(server)
        await polled(app, pilot, 1)
        text = screen_text(app)
    e = ref["engine"]
    assert e["blocks_cached"] > 0
    assert (
        f"used {e['blocks_used']} ▒ cached {e['blocks_cached']} · free {e['blocks_free']} / {e['num_blocks']}"
        in text
    )
    assert f"{e['kv_usage'] * 100:3.0f}% used" in text
    assert (
        f"running {e['num_running']} · waiting {e['num_waiting']} · swapped {e['num_swapped']}"
        in text
    )
    assert f"total {e['counters']['preemptions']} ·" in text
    assert f"· cut-in {e['counters']['cut_in_steps']}" in text
    assert (
        f"tokens: prompt {e['prompt_tokens_total']} · generated {e['generation_tokens_total']}"
        in text
    )
    assert f"tiny on cpu (float32), max_model_len {ref['max_model_len']}" in text
    assert "1 block/cell" in text and "per block" in text  # 16 blocks, real per-block states
    assert "● tiny · ready · tiny-a" in text
    # Per class: waiting, the estimated wait of a new arrival, the oldest wait / the limit.
    assert re.search(r"class\s+wait\s+est\s+oldest/limit", text)
    for q in ref["queues"]:
        assert re.search(rf"{q['priority_class']}\s+{q['waiting']}\s+\S+\s+\S+/", text), q


async def test_snapshot_80x24(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    no_nvml(monkeypatch)
    app = console(server)
    async with app.run_test(size=(80, 24)) as pilot:
        await polled(app, pilot, 2)
        path = Path(app.save_screenshot("dash-80x24.svg", str(tmp_path)))
    lines = svg_text(path.read_text())
    text = "\n".join(lines)
    assert len(lines) <= 24 and max(len(line) for line in lines) <= 80
    for title in (
        "KV cache",
        "Batch",
        "Preemptions",
        "Throughput · latency",
        "Why slow",
        "GPU · host",
    ):
        assert title in text, title
    assert "no GPU" in text and "host CPU" in text and "host mem" in text
    assert "prompt tok/s" in text and "TTFT p50" in text and "TPOT p50" in text
    assert "seqs per step" in text and "oldest/limit" in text
    assert "bound: KV" in text or "no steps in the last minute" in text
    # Every key of the dashboard fits the 80-column footer.
    assert "d Dashboard  t Templates  r Requests  l Audit  ? Help  q Quit" in lines[-1]
    assert "Engine" not in text  # the engine panel needs a wide terminal


async def test_snapshot_160x48(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    no_nvml(monkeypatch)
    app = console(server)
    async with app.run_test(size=(160, 48)) as pilot:
        await polled(app, pilot, 2)
        path = Path(app.save_screenshot("dash-160x48.svg", str(tmp_path)))
    lines = svg_text(path.read_text())
    text = "\n".join(lines)
    assert len(lines) <= 48 and max(len(line) for line in lines) <= 160
    for title in ("KV cache", "Batch", "Preemptions", "Why slow", "GPU · host", "Engine"):
        assert title in text, title
    assert "blocks of 16 tokens" in text and "template tiny-a" in text
    # The block map: 16 blocks, one cell each, drawn with the bar's glyphs.
    map_rows = [ln for ln in lines if re.fullmatch(r"│ [█▒·]+ *│", ln)]
    assert map_rows and sum(len(re.sub(r"[^█▒·]", "", r)) for r in map_rows) == 16


async def test_preemptions_move_on_screen_and_requests_screen(server: ServerProcess) -> None:
    app = console(server)
    async with app.run_test(size=(100, 30)) as pilot:
        await polled(app, pilot, 1)
        shown = lambda: int(re.search(r"total (\d+) ·", screen_text(app)).group(1))  # noqa: E731
        before = shown()
        assert before == admin_stats(server)["engine"]["counters"]["preemptions"]
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:

            async def live(prompt_tokens: int, n: int = 1) -> None:
                """Until the engine holds `n` requests with this prompt length (any status)."""
                while True:
                    reqs = (
                        await http.get("/admin/stats", params={"history_s": 0}, headers=auth)
                    ).json()["requests"]
                    if sum(r["prompt_tokens"] == prompt_tokens for r in reqs) >= n:
                        return
                    await asyncio.sleep(0.01)

            def req(i: int, max_tokens: int, cls: str) -> Any:
                return asyncio.create_task(
                    http.post(
                        "/v1/completions",
                        json={
                            "model": "tiny",
                            "prompt": long_prompt(10 + i),
                            "max_tokens": max_tokens,
                            "ignore_eos": True,
                            "priority": cls,
                        },
                    )
                )

            # Queued together while paused, the three are admitted together on resume: two of
            # them overflow the pool, whatever the machine's speed (none can finish alone first).
            assert (await http.post("/admin/pause", headers=auth)).json() == {"paused": True}
            tasks = [req(i, 12, cls) for i, cls in enumerate(["batch", "interactive", "batch"])]
            await asyncio.wait_for(live(127, 3), 30)
            assert (await http.post("/admin/resume", headers=auth)).json() == {"paused": False}
            await until(pilot, lambda: shown() > before, 60, "preemptions counted on screen")
            assert shown() <= admin_stats(server)["engine"]["counters"]["preemptions"]
            assert re.search(r"cmpl-\S+ (batch|interactive) recompute", screen_text(app))

            # The requests screen lists what the engine holds, with the same figures. The engine
            # is paused before the long request is sent, so that it cannot finish (or be missed
            # between two polls) on a fast machine: a tiny model's 240 steps take well under a
            # second. The three above, preempted or not, finish first.
            done = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in done)
            assert (await http.post("/admin/pause", headers=auth)).json() == {"paused": True}
            victim = asyncio.create_task(
                http.post(
                    "/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": [5, 6, 7, 8],
                        "max_tokens": 240,
                        "ignore_eos": True,
                    },
                )
            )
            await app.switch_mode("requests")
            listed = asyncio.create_task(live(4))
            await asyncio.wait({listed, victim}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            assert not victim.done(), f"answered before it was listed: {victim.result().text}"
            assert listed.done(), "the long request was never listed"
            await until(
                pilot,
                lambda: any(r.prompt_tokens == 4 for r in app.snapshot.stats.requests),
                30,
                "the long request listed",
            )
            await polled(app, pilot, 2)
            assert admin_stats(server)["server"]["paused"] is True
            assert "PAUSED" in screen_text(app)
            snap = app.snapshot
            text = screen_text(app)
            for r in snap.stats.requests:
                assert re.search(
                    rf"{re.escape(r.request_id)}\s+{r.priority_class}\s+{r.status}\s+"
                    rf"{r.prompt_tokens}\s+{r.output_tokens}\s+{r.blocks_held}",
                    text,
                ), r

            # Abort the long request through the admin API, after a confirmation.
            target = next(r.request_id for r in snap.stats.requests if r.prompt_tokens == 4)
            table = app.screen.query_one(DataTable)
            table.move_cursor(row=table.get_row_index(target), animate=False)
            await pilot.press("x")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            resp = await asyncio.wait_for(victim, 60)
            assert resp.json()["choices"][0]["finish_reason"] == "abort"
            assert resp.json()["usage"]["completion_tokens"] < 240
            await until(pilot, lambda: f"aborted {target}" in screen_text(app), 10, "abort outcome")
            # It is gone while still paused; after a resume the engine serves again.
            assert all(r["request_id"] != target for r in admin_stats(server)["requests"])
            assert (await http.post("/admin/resume", headers=auth)).json() == {"paused": False}
            after = await http.post(
                "/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 3}
            )
            assert after.json()["usage"]["completion_tokens"] >= 1


# -- templates -----------------------------------------------------------------------------------


async def select_template(app: ConsoleApp, pilot: Any, name: str) -> None:
    await app.switch_mode("templates")
    screen = app.screen
    await until(pilot, lambda: any(t.name == name for t in screen.templates), 30, "template list")
    screen.select(name)
    await pilot.pause(0.1)


async def test_apply_template_then_roll_back(server: ServerProcess) -> None:
    assert admin_config(server)["template"] == "tiny-a"
    app = console(server)
    async with app.run_test(size=(100, 30)) as pilot:
        await polled(app, pilot, 1)
        await select_template(app, pilot, "tiny-b")
        await until(pilot, lambda: "scheduler.max_num_seqs: 16 → 8" in screen_text(app), 10, "diff")
        assert "▶ tiny-a" in screen_text(app)
        await pilot.press("a")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await until(
            pilot, lambda: "applied tiny-b" in screen_text(app), START_TIMEOUT_S, "apply outcome"
        )
        cfg = admin_config(server)
        assert cfg["template"] == "tiny-b" and cfg["config"]["scheduler"]["max_num_seqs"] == 8
        await until(pilot, lambda: "▶ tiny-b" in screen_text(app), 10, "running marker")
        assert "b rolls back to tiny-a" in screen_text(app)

        await pilot.press("b")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await until(
            pilot,
            lambda: "rolled back to tiny-a" in screen_text(app),
            START_TIMEOUT_S,
            "rollback outcome",
        )
    cfg = admin_config(server)
    assert cfg["template"] == "tiny-a" and cfg["config"]["scheduler"]["max_num_seqs"] == 16
    audit = server.get("/admin/audit", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert [(r["action"], r["actor"], r["outcome"]) for r in audit["records"][-2:]] == [
        ("template_apply", "console", "ok"),
        ("rollback", "console", "ok"),
    ]


async def test_failed_apply_keeps_the_old_template_and_says_why(server: ServerProcess) -> None:
    generation = admin_stats(server)["server"]["engine_generation"]
    app = console(server)
    async with app.run_test(size=(100, 30)) as pilot:
        await polled(app, pilot, 1)
        await select_template(app, pilot, "tiny-broken")
        await pilot.press("a")
        await pilot.press("y")
        await until(pilot, lambda: "apply failed" in screen_text(app), 60, "failure outcome")
        text = flat(screen_text(app))
    assert "the previous configuration is still running" in text
    assert "holds no Hugging Face model" in text  # the server's reason, shown as given
    stats = admin_stats(server)
    assert stats["config"]["template"] == "tiny-a" and stats["server"]["phase"] == "ready"
    assert stats["server"]["engine_generation"] == generation  # refused before draining


async def test_readonly_hides_every_change(server: ServerProcess) -> None:
    app = console(server, readonly=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await polled(app, pilot, 1)
        assert "read-only" in screen_text(app)
        await select_template(app, pilot, "tiny-b")
        footer = screen_text(app).splitlines()[-1]
        assert "Apply" not in footer and "Roll back" not in footer and "Templates" in footer
        await pilot.press("a")
        assert not isinstance(app.screen, ConfirmScreen)
        await app.switch_mode("requests")
        await pilot.pause(0.1)
        assert "Abort" not in screen_text(app).splitlines()[-1]
        await pilot.press("x")
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "read-only" in screen_text(app)
    assert admin_config(server)["template"] == "tiny-a"


# -- failures shown in words -----------------------------------------------------------------


async def test_server_down_says_so_and_keeps_retrying() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    app = ConsoleApp(url, TOKEN, poll_s=0.1)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.polls >= 3)
        text = flat(screen_text(app))
        assert f"server unreachable at {url}" in text and "retrying every 0.1 s (attempt" in text
        for mode in ("templates", "requests"):
            await app.switch_mode(mode)
            await pilot.pause(0.2)
            assert "server unreachable" in flat(screen_text(app))
        assert app.is_running


async def test_wrong_admin_token_is_named(server: ServerProcess) -> None:
    app = console(server, token="not-the-token")
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.polls >= 1)
        await pilot.pause(0.05)
        text = flat(screen_text(app))
    assert f"admin token refused by {server.url} (401): the token given was rejected" in text


async def test_gpu_panel_with_and_without_gpu(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_nvml(monkeypatch)
    app = console(server)
    async with app.run_test(size=(80, 24)) as pilot:
        await polled(app, pilot, 1)
        text = screen_text(app)
        assert "no GPU on this machine" in text and "(NVML Shared Library Not Found)" in text
        assert "host CPU" in text and "host mem" in text

    class Mem:
        used, total = 20 * 1024**3, 24 * 1024**3

    class Util:
        gpu = 87

    fake = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": lambda h: "NVIDIA A10",
        "nvmlDeviceGetUtilizationRates": lambda h: Util,
        "nvmlDeviceGetMemoryInfo": lambda h: Mem,
        "nvmlDeviceGetTemperature": lambda h, sensor: 64,
        "nvmlDeviceGetPowerUsage": lambda h: 140_000,
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: 150_000,
    }
    for name, fn in fake.items():
        monkeypatch.setattr(pynvml, name, fn)
    app = console(server)
    async with app.run_test(size=(80, 24)) as pilot:
        await polled(app, pilot, 1)
        text = screen_text(app)
    assert "GPU0  87% 20.0G/24.0G 64°C 140W" in text and "GPU1" in text and "no GPU" not in text


def test_console_command_is_registered(tmp_path: Path) -> None:
    from appliance.cli import build_parser, main

    ns = build_parser().parse_args(["console", "--url", "http://127.0.0.1:1", "--readonly"])
    assert (
        ns.readonly
        and ns.url == "http://127.0.0.1:1"
        and ns.func.__module__ == "appliance.console.cli"
    )
    assert main(["console", "--admin-token-file", str(tmp_path / "missing")]) == 2
