"""Schemathesis over the OpenAPI schema the server publishes (/openapi.json): whatever the
generated request, no 5xx, and every 4xx is OpenAI's error body. Bounded so that it fits CI: a
fixed number of examples per operation, no shrinking, no example database, and a wall-clock
budget after which the remaining examples are not sent."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from server_harness import ServerProcess, write_template

from appliance.server.routes import ROUTES

EXAMPLES_PER_MODE = 25  # per operation, in each of positive and negative generation
BUDGET_S = 50.0  # all operations together
REQUEST_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("srv-fuzz")
    # A short context keeps every generated request cheap, whatever max_tokens and n it asks.
    template = write_template(d / "t.toml", tiny_model_dir)
    text = template.read_text().replace("max_model_len = 512", "max_model_len = 64")
    template.write_text(text)
    srv = ServerProcess(template, d / "log.txt").start()
    yield srv
    assert srv.stop() == 0, srv.log()


def check_openai_shape(response: Any, where: str) -> None:
    status = response.status_code
    assert status < 500, f"{where}: {status} {response.text[:500]}"
    if 400 <= status < 500:
        assert response.headers["content-type"][0].startswith("application/json"), where
        body = response.json()
        assert set(body) == {"error"}, f"{where}: {body}"
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, f"{where}: {err}"
        assert isinstance(err["message"], str) and err["message"], where
        assert err["type"] in ("invalid_request_error", "rate_limit_error"), where
        assert err["param"] is None or isinstance(err["param"], str), where


def test_fuzz_published_schema(server: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert paths == {r.path for r in ROUTES}  # every endpoint of the table is fuzzed
    deadline = time.monotonic() + BUDGET_S
    sent: dict[str, int] = {}
    statuses: dict[int, int] = {}

    def fuzz(op: Any, mode: GenerationMode) -> None:
        where = f"{mode.value} {op.method.upper()} {op.path}"

        @settings(
            max_examples=EXAMPLES_PER_MODE,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case: Any) -> None:
            if time.monotonic() > deadline:
                return  # over budget: the examples left are not sent
            response = case.call(base_url=server.url, timeout=REQUEST_TIMEOUT_S)
            sent[where] = sent.get(where, 0) + 1
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            check_openai_shape(response, f"{where} {case.body!r:.300}")

        run()

    for op in operations:
        # Negative generation needs inputs to break: GET /v1/models has none.
        modes = (
            (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
            if op.body
            else (GenerationMode.POSITIVE,)
        )
        for mode in modes:
            fuzz(op, mode)
    print(f"fuzz: {sent} statuses {statuses}")
    # The budget must leave every operation with a body examples of its own in both modes (a
    # fuzz that sent nothing would pass anything); GET /v1/models has no inputs to vary.
    for op in operations:
        for mode in ("positive", "negative") if op.body else ("positive",):
            assert sent.get(f"{mode} {op.method.upper()} {op.path}", 0) >= (10 if op.body else 1), (
                sent
            )
    assert server.get("/health").status_code == 200
