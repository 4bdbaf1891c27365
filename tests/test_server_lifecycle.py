"""`appliance up` as a subprocess: 503 while loading, systemd notifications (STATUS, READY,
RELOADING on SIGHUP, STOPPING), SIGTERM with requests in flight finishes them with /ready false
and 503 for new requests meanwhile, then exits 0; no API key means no non-loopback bind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import START_TIMEOUT_S, ServerProcess, wait_for, write_template

MODEL = "tiny"
DRAIN_TOKENS = 500  # "drain me" is 4 tokens; max_model_len is 512


class Notifications:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


class StreamClient(threading.Thread):
    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.first = threading.Event()
        self.chunks: list[dict[str, Any]] = []
        self.status: int | None = None
        self.done = False

    def run(self) -> None:
        import json

        body = {
            "model": MODEL,
            "prompt": "drain me",
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", self.url + "/v1/completions", json=body) as r,
        ):
            self.status = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    self.chunks.append(json.loads(line[6:]))
                    self.first.set()


def test_loading_drain_and_signals(tiny_model_dir: Path, tmp_path: Path) -> None:
    notes = Notifications(tmp_path / "notify.sock")
    template = write_template(tmp_path / "t.toml", tiny_model_dir)
    srv = ServerProcess(template, tmp_path / "log.txt", env={"NOTIFY_SOCKET": notes.path})
    try:
        srv.start(wait_ready=False)
        # Listening comes first; until the engine is up, /ready and the API answer 503.
        wait_for(lambda: _try(srv, "/health") == 200, timeout_s=60)
        gen = _try_post(srv)
        ready = _try(srv, "/ready")
        if gen == 503:
            assert ready in (200, 503)
        else:  # it became ready in between
            assert ready == 200
        srv.wait_ready()
        wait_for(lambda: "READY=1" in notes.messages)
        assert any(m.startswith("STATUS=") for m in notes.messages)

        # SIGHUP reloads the same template (systemd's ExecReload).
        n_ready = notes.messages.count("READY=1")
        srv.signal(signal.SIGHUP)
        wait_for(
            lambda: notes.messages.count("READY=1") > n_ready, timeout_s=START_TIMEOUT_S
        )  # a new engine
        assert "RELOADING=1" in notes.messages
        assert srv.get("/admin/stats").json()["server"]["engine_generation"] == 2

        # SIGTERM with requests in flight: they finish, new ones get 503, then exit 0.
        # A drain resumes a paused engine, so /admin/pause cannot hold them: they are as long as
        # the model allows (4 prompt tokens + 500 of 512), several hundred steps against the
        # test's two round trips from the first token to `late`.
        clients = [StreamClient(srv.url, DRAIN_TOKENS) for _ in range(3)]
        for c in clients:
            c.start()
        for c in clients:
            assert c.first.wait(60)
        srv.signal(signal.SIGTERM)
        r = wait_for(lambda: _ready_while_draining(srv), timeout_s=30)
        assert r == {"ready": False, "phase": "draining", "detail": r["detail"]}
        late = srv.post("/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
        assert srv.proc is not None
        assert srv.proc.wait(60) == 0
        for c in clients:
            c.join(10)
            assert c.status == 200 and c.done
            assert c.chunks[-1]["usage"]["completion_tokens"] == DRAIN_TOKENS
            reasons = [ch["choices"][0]["finish_reason"] for ch in c.chunks if ch["choices"]]
            assert reasons[-1] == "length"
        assert "STOPPING=1" in notes.messages
        log = srv.log()
        assert '"event":"request"' in log and "ready in" in log and "core.load_weights" in log
    finally:
        srv.stop()
        notes.close()


def _ready_while_draining(srv: ServerProcess) -> dict[str, Any] | None:
    """/ready's body once it answers 503 (the drain has begun), else None."""
    r = srv.get("/ready")
    return r.json() if r.status_code == 503 else None


def _try(srv: ServerProcess, path: str) -> int | None:
    try:
        return srv.get(path).status_code
    except httpx.TransportError:
        return None


def _try_post(srv: ServerProcess) -> int:
    return srv.post(
        "/v1/completions", json={"model": MODEL, "prompt": "early", "max_tokens": 2}
    ).status_code


def test_refuses_non_loopback_bind_without_api_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    template = write_template(tmp_path / "t.toml", tiny_model_dir)
    cmd = [
        sys.executable,
        "-m",
        "appliance.cli",
        "up",
        "--template",
        str(template),
        "--host",
        "0.0.0.0",
        "--port",
        "0",
    ]
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert "refusing to listen beyond loopback without an API key" in out.stderr


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_loopback_hosts_are_allowed_without_a_key(host: str) -> None:
    from appliance.server.auth import AuthKeys, check_bind

    check_bind(host, AuthKeys())
