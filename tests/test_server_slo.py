"""Admission by SLO and length-aware classes through HTTP (tiny model): a chat whose class's
ttft_slo_s the engine expects to miss is a 429 with Retry-After and the estimate in the message;
a long unnamed prompt is batch work (no SLO) and is served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_harness import ServerProcess, write_template

CLASSES = """
[priority_classes]
interactive = { priority = 5, ttft_slo_s = 0.000001 }
batch = { priority = 10 }
"""


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("srv-slo")
    template = write_template(
        d / "t.toml",
        tiny_model_dir,
        extra=CLASSES,
        scheduler={"long_prompt_tokens": 50, "long_prompt_class": "batch"},
    )
    srv = ServerProcess(template, d / "log.txt").start()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_a_chat_its_class_would_serve_too_late_is_a_429_with_the_estimate(
    server: ServerProcess,
) -> None:
    r = server.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 10, "max_tokens": 4})
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"]
    error = r.json()["error"]
    assert error["code"] == "ttft_slo"
    assert "interactive" in error["message"] and "first token expected in" in error["message"]
    assert "ttft_slo_s 1e-06" in error["message"]
    metrics = server.get("/metrics").text
    assert 'reason="ttft_slo"' in metrics


def test_a_long_unnamed_prompt_is_batch_work_and_a_named_class_is_kept(
    server: ServerProcess,
) -> None:
    body = {"model": "tiny", "prompt": [5] * 80, "max_tokens": 4}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text  # batch: no TTFT target
    named = server.post("/v1/completions", json={**body, "priority": "interactive"})
    assert named.status_code == 429 and named.json()["error"]["code"] == "ttft_slo"
