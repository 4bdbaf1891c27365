"""Reproduce the console screenshots in docs/ (and read text back out of Textual SVGs).

    python -m appliance.tools.screenshots [--out docs] [--model DIR]

Starts `appliance up` on a free loopback port with the tiny demo model and a 16-block KV pool
(built in a temporary directory unless --model is given), drives it with concurrent long
requests of three priority classes so the pool runs full and requests get preempted, and
saves the dashboard (160x48 and 80x24) and the templates screen under that load as SVG, plus
PNG where `rsvg-convert` (Debian: librsvg2-bin) is installed. Then, as an operator would in
tmux: a live knob change on the templates screen (its confirmation with the diff) and a pause
of the batch class on the audit screen, which shows both. About a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from textual.pilot import Pilot

from appliance.console.app import ConsoleApp
from appliance.console.templates import TemplatesScreen

TEXT_RE = re.compile(
    r'<text class="([^"]*)" x="([\d.]+)" y="([\d.]+)" textLength="([\d.]+)"[^>]*>([^<]*)</text>'
)

TEMPLATE = """\
description = "console screenshots: tiny demo model, 16 KV blocks"
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
max_num_seqs = 8
max_num_batched_tokens = 512
[priority_classes]
realtime = {{ priority = 0, queue_timeout_s = 30.0 }}
interactive = {{ priority = 5 }}
batch = {{ priority = 10, queue_timeout_s = 120.0 }}
[hardware]
device = "cpu"
[server]
admin_token_file = "{token}"
state_dir = "{state}"
"""


def svg_text(svg: str) -> list[str]:
    """The screen's lines from a Textual SVG screenshot (cells placed by their x position)."""
    rows: dict[float, list[tuple[float, str, float]]] = {}
    for cls, x, y, length, body in TEXT_RE.findall(svg):
        if cls.endswith("-title"):
            continue
        text = html.unescape(body).replace("\xa0", " ")
        rows.setdefault(float(y), []).append((float(x), text, float(length)))
    widths = [length / len(t) for row in rows.values() for _, t, length in row if t]
    cell = min(widths) if widths else 1.0
    lines = []
    for y in sorted(rows):
        line = ""
        for x, text, _ in sorted(rows[y]):
            col = round(x / cell)
            line = line.ljust(col)[:col] + text
        lines.append(line.rstrip())
    return lines


async def wait_polls(app: ConsoleApp, pilot: Pilot[None], n: int, timeout_s: float = 30.0) -> None:
    target = app.polls + n
    t0 = time.monotonic()
    while app.polls < target and time.monotonic() - t0 < timeout_s:
        await pilot.pause(0.1)


async def capture(
    url: str,
    token: str,
    mode: str,
    size: tuple[int, int],
    path: Path,
    settle_polls: int = 12,
    select: str | None = None,
) -> list[str]:
    """Run the console headless at `size`, show `mode` (with template `select` chosen), save
    an SVG; return its text lines."""
    app = ConsoleApp(url, token)
    async with app.run_test(size=size) as pilot:
        await wait_polls(app, pilot, 1)
        if mode != "dashboard":
            await app.switch_mode(mode)
        await wait_polls(app, pilot, settle_polls)
        if select is not None:
            screen = app.screen
            assert isinstance(screen, TemplatesScreen), "select is for the templates screen"
            screen.select(select)
        await pilot.pause(0.3)
        app.save_screenshot(path.name, str(path.parent))
    return svg_text(path.read_text())


async def capture_operator(url: str, token: str, out: Path) -> list[Path]:
    """`k` on the templates screen: max_num_seqs 8 -> 4 (the confirmation is saved), then `p`
    on the audit screen's batch row; the audit screen is saved once both are logged."""
    app = ConsoleApp(url, token)
    saved = []
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_polls(app, pilot, 1)
        await app.switch_mode("templates")
        await wait_polls(app, pilot, 2)
        await pilot.press("k")
        await pilot.pause(0.2)
        for key in "scheduler.max_num_seqs = 4":
            await pilot.press("space" if key == " " else key)
        await pilot.press("enter")
        await pilot.pause(0.3)
        saved.append(Path(app.save_screenshot("console-knob-confirm.svg", str(out))))
        await pilot.press("y")
        await wait_polls(app, pilot, 2)
        await app.switch_mode("audit")
        await wait_polls(app, pilot, 2)
        await pilot.press("down", "down")  # the batch class: the last row
        await pilot.press("p")
        await pilot.pause(0.2)
        await pilot.press("y")
        await wait_polls(app, pilot, 4)
        await pilot.pause(2.5)  # the audit log's own refresh
        await wait_polls(app, pilot, 1)
        saved.append(Path(app.save_screenshot("console-audit.svg", str(out))))
        await pilot.press("u")  # leave the box as it was: batch serving again
        await pilot.pause(0.2)
        await pilot.press("y")
        await wait_polls(app, pilot, 1)
    return saved


def to_png(svg: Path) -> Path | None:
    exe = shutil.which("rsvg-convert")
    if exe is None:
        return None
    png = svg.with_suffix(".png")
    # librsvg drops the leading non-breaking space of a span (Textual starts many spans with
    # one), running words together: hand it plain spaces it is told to preserve.
    text = svg.read_text().replace("<text ", '<text xml:space="preserve" ').replace("&#160;", " ")
    with tempfile.NamedTemporaryFile("w", suffix=".svg") as tmp:
        tmp.write(text)
        tmp.flush()
        subprocess.run([exe, tmp.name, "-o", str(png)], check=True)
    return png


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(url: str, stop: threading.Event) -> None:
    """Long requests from three classes, 8 in flight: the 16-block pool runs out."""
    rng = random.Random(0)
    classes = ["batch", "interactive", "realtime", "batch"]

    def worker(i: int) -> None:
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                prompt = [rng.randrange(10, 4000) for _ in range(rng.choice([60, 100, 127]))]
                client.post(
                    f"{url}/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": prompt,
                        "max_tokens": rng.choice([16, 48, 96]),
                        "ignore_eos": True,
                        "priority": classes[i % len(classes)],
                    },
                )

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="docs")
    ap.add_argument("--model", help="a model directory (default: build the tiny demo model)")
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = ns.model
        if model is None:
            from appliance.models.demo_model import build_demo_model

            model = str(build_demo_model("tiny", Path(tmp) / "tiny"))
        token = "screenshot-token"
        (Path(tmp) / "admin").write_text(token + "\n")
        # Operator templates (the config directory) beside the shipped ones: the running one
        # and a variant whose diff the templates screen shows.
        tdir = Path(tmp) / "templates"
        tdir.mkdir()
        text = TEMPLATE.format(model=model, token=Path(tmp) / "admin", state=Path(tmp) / "state")
        (tdir / "console-demo.toml").write_text(text)
        (tdir / "console-demo-swap.toml").write_text(
            text.replace(
                'description = "console screenshots:', 'description = "swap instead of recompute:'
            )
            .replace('policy = "priority"', 'policy = "priority"\npreemption_mode = "swap"')
            .replace("swap_space = 0.01", "swap_space = 0.05")
            .replace("max_num_seqs = 8", "max_num_seqs = 4")
        )
        os.environ["APPLIANCE_TEMPLATE_DIR"] = str(tdir)
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        log = open(Path(tmp) / "server.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "appliance.cli",
                "up",
                "--template",
                "console-demo",
                "--port",
                str(port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ},
        )
        stop = threading.Event()
        try:
            _wait_ready(url, proc)
            _load(url, stop)
            _wait_preemptions(url, token)
            shots = [
                ("dashboard", (160, 48), "console-dashboard.svg", None),
                ("dashboard", (80, 24), "console-dashboard-80x24.svg", None),
                ("templates", (100, 30), "console-templates.svg", "console-demo-swap"),
            ]
            paths = []
            for mode, size, name, select in shots:
                asyncio.run(capture(url, token, mode, size, out / name, select=select))
                paths.append(out / name)
            paths += asyncio.run(capture_operator(url, token, out))
            for path in paths:
                png = to_png(path)
                print(f"wrote {path}" + (f" and {png}" if png else " (no rsvg-convert: no PNG)"))
        finally:
            stop.set()
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
    return 0


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"appliance up exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("appliance up did not become ready")


def _wait_preemptions(url: str, token: str, timeout_s: float = 90.0) -> None:
    """Screenshots "under load" means after the pool has run full and preempted something."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        stats = httpx.get(
            f"{url}/admin/stats",
            params={"history_s": 0},
            headers={"Authorization": f"Bearer {token}"},
            timeout=5,
        ).json()
        if stats["engine"] and stats["engine"]["counters"]["preemptions"] >= 3:
            return
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
