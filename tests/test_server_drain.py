"""A drain that has to cut says so (issue 15). With every step slowed (0.2 s, the core's
fault-injection hook) long requests cannot finish within drain_timeout_s 2: a cut stream ends
with a last chunk whose finish_reason is "abort" and an SSE error event that the OpenAI SDK
raises; a cut request not yet answered gets a 503 with OpenAI's body and Retry-After; a short
request finishes. /metrics and the request log count drained and cut requests. The drain runs
on a reload (the server stays up to be scraped) and on SIGTERM (the process exits 0)."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, wait_for, write_template

from appliance.server.state import STOP_AFTER_DRAIN_S

MODEL = "tiny"
DRAIN_S = 2.0


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("srv-drain")
    template = write_template(
        d / "t.toml",
        tiny_model_dir,
        extra=f"""
[server]
drain_timeout_s = {DRAIN_S}
retry_after_s = 4
""",
    )
    srv = ServerProcess(template, d / "log.txt", env={"APPLIANCE_TEST_STEP_DELAY_S": "0.2"}).start()
    yield srv
    srv.stop()


class SdkStream(threading.Thread):
    """A streamed completion through the official SDK; keeps its chunks and what it raised."""

    def __init__(self, server: ServerProcess, max_tokens: int = 480) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        self.max_tokens = max_tokens
        self.chunks: list[Any] = []
        self.error: BaseException | None = None
        self.first = threading.Event()

    def run(self) -> None:
        try:
            for chunk in self.client.completions.create(
                model=MODEL,
                prompt="a long story",
                max_tokens=self.max_tokens,
                stream=True,
                temperature=0,
                extra_body={"ignore_eos": True},
            ):
                self.chunks.append(chunk)
                self.first.set()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            self.error = exc


def _drain_counts(server: ServerProcess) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(server.get("/metrics").text):
        for s in fam.samples:
            if s.name == "appliance_drain_requests_total":
                out[s.labels["outcome"]] = s.value
    return out


def _request_lines(server: ServerProcess) -> list[dict[str, Any]]:
    lines = []
    for line in server.log().splitlines():
        if line.startswith("{") and '"event":"request"' in line:
            lines.append(json.loads(line))
    return lines


def _assert_cut_stream(stream: SdkStream) -> None:
    assert isinstance(stream.error, openai.APIError), stream.error
    assert stream.error.body["code"] == "drain_timeout", stream.error.body
    assert f"drain_timeout_s {DRAIN_S}" in stream.error.body["message"]
    assert stream.error.body["type"] == "server_error"
    assert stream.chunks, "no chunk before the cut"
    assert stream.chunks[-1].choices[0].finish_reason == "abort"
    assert all(c.choices[0].finish_reason is None for c in stream.chunks[:-1])


def test_reload_drain_cuts_with_reasons_and_counts(server: ServerProcess) -> None:
    stream = SdkStream(server)
    stream.start()
    assert stream.first.wait(60)
    with ThreadPoolExecutor(2) as pool:
        long_plain = pool.submit(
            httpx.post,
            server.url + "/v1/completions",
            timeout=120,
            json={"model": MODEL, "prompt": "plain", "max_tokens": 480, "ignore_eos": True},
        )
        short = pool.submit(
            httpx.post,
            server.url + "/v1/completions",
            timeout=120,
            json={"model": MODEL, "prompt": "short", "max_tokens": 2, "ignore_eos": True},
        )
        wait_for(lambda: server.get("/admin/stats").json()["server"]["requests_in_flight"] == 3)
        t0 = time.monotonic()
        r = server.post("/admin/reload", json={})
        assert r.status_code == 200, r.text
        stream.join(30)
        assert not stream.is_alive()
        _assert_cut_stream(stream)
        plain = long_plain.result(30)
        assert plain.status_code == 503, plain.text
        assert plain.headers["retry-after"] == "4"
        err = plain.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "drain_timeout" and err["type"] == "server_error"
        assert short.result(30).status_code == 200  # finished within the drain
    assert time.monotonic() - t0 >= DRAIN_S
    assert _drain_counts(server) == {"drained": 1.0, "cut": 2.0}
    lines = {ln["id"]: ln for ln in _request_lines(server)}
    drains = sorted(
        (ln["drain"], ln["status"], ln["stream"]) for ln in lines.values() if "drain" in ln
    )
    assert drains == [("cut", 200, True), ("cut", 503, False), ("drained", 200, False)], drains
    assert all(
        ln["finish_reason"] == ["abort"] for ln in lines.values() if ln.get("drain") == "cut"
    )
    assert "drain: 1 requests finished, 2 cut" in server.log()


def test_sigterm_drain_cuts_streams_and_exits_0(server: ServerProcess) -> None:
    stream = SdkStream(server)
    stream.start()
    assert stream.first.wait(60)
    t0 = time.monotonic()
    server.signal(signal.SIGTERM)
    stream.join(30)
    assert not stream.is_alive()
    _assert_cut_stream(stream)
    assert server.proc is not None
    assert server.proc.wait(DRAIN_S + STOP_AFTER_DRAIN_S) == 0
    assert DRAIN_S <= time.monotonic() - t0 <= DRAIN_S + STOP_AFTER_DRAIN_S
    log = server.log()
    assert "drain: 0 requests finished, 1 cut" in log
    cut = [ln for ln in _request_lines(server) if ln.get("drain") == "cut" and ln["stream"]]
    assert len(cut) == 2  # the reload's stream and this one
