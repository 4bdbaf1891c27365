"""Helpers for the server tests: a real `appliance up` process on 127.0.0.1 and a free port,
with the tiny demo model and a template written per test module."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_template(
    path: Path, model_dir: Path, extra: str = "", scheduler: dict[str, Any] | None = None
) -> Path:
    """A small CPU template for the tiny model; `extra` appends TOML tables, `scheduler`
    overrides keys of [scheduler]."""
    sched = {"max_num_seqs": 16, "max_num_batched_tokens": 512, **(scheduler or {})}
    sched_lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in sched.items())
    path.write_text(
        f"""
description = "server tests: tiny model"
[model]
path = "{model_dir}"
name = "tiny"
dtype = "float32"
max_model_len = 512
[cache]
kv_cache_memory = 0.02
swap_space = 0.01
[scheduler]
{sched_lines}
[hardware]
device = "cpu"
{extra}
"""
    )
    return path


class ServerProcess:
    def __init__(
        self,
        template: Path | None,
        log_path: Path,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
    ) -> None:
        """template None: `appliance up` without --template (the default, cpu-demo)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.template = template
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.args = args or []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_ready: bool = True) -> ServerProcess:
        chosen = ["--template", str(self.template)] if self.template is not None else []
        cmd = [
            sys.executable,
            "-m",
            "appliance.cli",
            "up",
            *chosen,
            "--port",
            str(self.port),
            *self.args,
        ]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        if wait_ready:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        # /admin/reload starts a whole engine: as long as a start may take on a slow machine.
        return httpx.post(self.url + path, timeout=START_TIMEOUT_S, **kw)


def wait_for(predicate: Any, timeout_s: float = 30.0, interval_s: float = 0.05) -> Any:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError("condition not met in time")
