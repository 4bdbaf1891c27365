"""Every error path of the API answers with its status and OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`: 400 naming the field and its limit, 401 for
API keys and the separate admin token, 404 for an unknown model or route, 413 for a large
body, and 429 with Retry-After for a full queue (checked before tokenization) and for a
queue timeout."""

from __future__ import annotations

import json
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

KEY = "sk-test-key-1"
ADMIN = "admin-token-1"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("srv-errors")
    (d / "admin.token").write_text(f"# the console's token\n{ADMIN}\n")
    template = write_template(
        d / "t.toml",
        tiny_model_dir,
        # One sequence at a time, in arrival order: easy to saturate on purpose.
        scheduler={"policy": "fcfs", "max_num_seqs": 1},
        extra=f"""
[server]
api_key_env = "APPLIANCE_TEST_KEYS"
admin_token_file = "{d / "admin.token"}"
max_request_body_bytes = 65536
retry_after_s = 3
[priority_classes]
realtime = {{ priority = 0, queue_timeout_s = 0.3 }}
batch = {{ priority = 10, max_waiting_requests = 1 }}
""",
    )
    srv = ServerProcess(
        template, d / "log.txt", env={"APPLIANCE_TEST_KEYS": f"other-key,{KEY}"}
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def assert_error(
    r: httpx.Response,
    status: int,
    param: str | None = None,
    code: str | None = None,
    contains: tuple[str, ...] = (),
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    for text in contains:
        assert text in err["message"], err
    return err


def complete(
    server: ServerProcess, body: dict[str, Any], headers: dict[str, str] = AUTH
) -> httpx.Response:
    return server.post("/v1/completions", json={"model": MODEL, **body}, headers=headers)


# -- 401 -----------------------------------------------------------------------------------------
def test_401_without_or_with_a_wrong_api_key(server: ServerProcess) -> None:
    assert_error(complete(server, {"prompt": "x"}, headers={}), 401, code="invalid_api_key")
    assert_error(complete(server, {"prompt": "x"}, headers={"Authorization": "Bearer nope"}), 401)
    assert_error(server.get("/v1/models", headers={"Authorization": "Basic abc"}), 401)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    # Either configured key works (the env var holds a comma-separated list).
    assert (
        server.get("/v1/models", headers={"Authorization": "Bearer other-key"}).status_code == 200
    )


def test_tokenize_and_detokenize_take_the_same_api_keys(server: ServerProcess) -> None:
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5, 6]})):
        assert_error(server.post(path, json=body), 401, code="invalid_api_key")
        assert_error(server.post(path, json=body, headers=ADMIN_AUTH), 401)
        assert server.post(path, json=body, headers=AUTH).status_code == 200
    r = server.post(
        "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=AUTH
    ).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] > 0


def test_admin_token_is_separate_from_api_keys(server: ServerProcess) -> None:
    assert_error(server.get("/admin/stats", headers=AUTH), 401, code="invalid_admin_token")
    assert_error(server.get("/admin/stats"), 401)
    assert server.get("/admin/stats", headers=ADMIN_AUTH).status_code == 200
    assert_error(server.get("/v1/models", headers=ADMIN_AUTH), 401)


def test_ops_endpoints_need_no_key(server: ServerProcess) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert server.get(path).status_code == 200


# -- 400 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param", "contains"),
    [
        ({"prompt": "x", "n": 0}, "n", (">= 1",)),
        ({"prompt": "x", "n": 1000}, "n", ("<= 16",)),
        ({"prompt": "x", "max_tokens": 600}, "max_tokens", ("512",)),
        ({"prompt": list(range(20, 620))}, "prompt", ("512",)),
        ({"prompt": "x", "temperature": -1}, "temperature", (">= 0",)),
        ({"prompt": "x", "top_p": 0}, "top_p", ("(0, 1]",)),
        ({"prompt": "x", "priority": "vip"}, "priority", ("realtime", "batch")),
        ({"prompt": "x", "logprobs": 50}, "logprobs", ("<= 20",)),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens", ("int",)),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", ("not supported",)),
        ({"prompt": [[]]}, "prompt", ()),
        ({"prompt": [999_999]}, "prompt", ("vocabulary",)),
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 8}, "min_tokens", ("max_tokens",)),
    ],
)
def test_400_names_the_field_and_its_limit(
    server: ServerProcess, body: dict[str, Any], param: str, contains: tuple[str, ...]
) -> None:
    err = assert_error(complete(server, body), 400, param=param, contains=contains)
    assert err["type"] == "invalid_request_error"


def test_a_prompt_with_no_room_left_is_a_400_naming_the_requests_field(
    server: ServerProcess,
) -> None:
    # The engine checks the prompt's length (offline too), before max_tokens; the answer names
    # the request's own field: a chat request's is `messages`.
    text = "word " * 600
    err = assert_error(
        complete(server, {"prompt": text, "max_tokens": 600}),
        400,
        param="prompt",
        code="context_length_exceeded",
        contains=("maximum context length is 512 tokens, which leaves no room to generate",),
    )
    assert err["message"].startswith("prompt: ")
    messages = [{"role": "user", "content": text}]
    r = server.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages}, headers=AUTH
    )
    err = assert_error(r, 400, param="messages", code="context_length_exceeded")
    assert err["message"].startswith("messages: ") and "leaves no room" in err["message"]
    err = assert_error(complete(server, {"prompt": "x", "max_tokens": 0}), 400, param="max_tokens")
    assert err["message"] == "max_tokens must be at least 1, got 0"


def test_a_refused_request_gets_its_request_log_line(server: ServerProcess) -> None:
    headers = {**AUTH, "x-request-id": "refused-1"}
    assert_error(complete(server, {"prompt": "x", "temperature": -1}, headers=headers), 400)

    def line() -> dict[str, Any] | None:
        for text in server.log().splitlines():
            if text.startswith("{") and '"refused-1"' in text:
                return json.loads(text)
        return None

    got = wait_for(line, timeout_s=10)
    assert (got["event"], got["endpoint"], got["status"]) == ("request", "/v1/completions", 400)
    assert "temperature" in got["message"]


def test_400_bad_json_and_bad_chat(server: ServerProcess) -> None:
    r = server.post(
        "/v1/completions",
        content=b"{not json",
        headers={**AUTH, "content-type": "application/json"},
    )
    assert_error(r, 400)
    r = server.post("/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=AUTH)
    assert_error(r, 400, param="messages")
    r = server.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user"}], "max_completion_tokens": 999},
        headers=AUTH,
    )
    assert_error(r, 400, param="max_completion_tokens", contains=("512",))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", n=0)
    assert info.value.body["param"] == "n"


# -- 404, 413 ------------------------------------------------------------------------------------
def test_404_unknown_model_and_route(server: ServerProcess) -> None:
    assert_error(
        complete(server, {"model": "gpt-4", "prompt": "x"}),
        404,
        param="model",
        code="model_not_found",
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert_error(server.get("/v1/nothing", headers=AUTH), 404)


def test_413_body_too_large(server: ServerProcess) -> None:
    assert_error(complete(server, {"prompt": "word " * 20_000}), 413)


# -- 429 -----------------------------------------------------------------------------------------
class Streamer(threading.Thread):
    """A streaming request in the background; `first` is set once a data line arrived."""

    def __init__(self, server: ServerProcess, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.server, self.body = server, body
        self.first = threading.Event()
        self.stop = threading.Event()
        self.status: int | None = None

    def run(self) -> None:
        body = {"model": MODEL, "stream": True, "temperature": 0, "ignore_eos": True, **self.body}
        with (
            httpx.Client(timeout=60, headers=AUTH) as http,
            http.stream("POST", self.server.url + "/v1/completions", json=body) as r,
        ):
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.first.set()
                if self.stop.is_set():
                    return  # closing the connection aborts the request


def _stats(server: ServerProcess) -> dict[str, Any]:
    return server.get("/admin/stats", headers=ADMIN_AUTH).json()


def _waiting(server: ServerProcess, cls: str) -> int:
    return next(q["waiting"] for q in _stats(server)["queues"] if q["priority_class"] == cls)


def _rejections(server: ServerProcess) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(server.get("/metrics").text):
        for s in fam.samples:
            if s.name == "appliance_requests_rejected_total":
                out[(s.labels["reason"], s.labels["priority_class"])] = s.value
    return out


def _pause(server: ServerProcess, paused: bool) -> None:
    r = server.post("/admin/pause" if paused else "/admin/resume", headers=ADMIN_AUTH)
    assert r.json() == {"paused": paused}, r.text


def test_429_queue_full_is_refused_before_tokenizing(server: ServerProcess) -> None:
    running = Streamer(server, {"prompt": "a", "max_tokens": 480, "priority": "batch"})
    running.start()
    assert running.first.wait(30)
    # Paused, `running` holds the only slot until the test lets it go, however fast the machine.
    _pause(server, True)
    try:
        queued = Streamer(server, {"prompt": "b", "max_tokens": 2, "priority": "batch"})
        queued.start()
        wait_for(lambda: _waiting(server, "batch") == 1)
        r = complete(server, {"prompt": "c", "max_tokens": 2, "priority": "batch"})
        err = assert_error(r, 429, code="queue_full", contains=("batch",))
        assert err["type"] == "rate_limit_error"
        assert r.headers["retry-after"] == "3"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(
                model=MODEL, prompt="d", max_tokens=2, extra_body={"priority": "batch"}
            )
        assert _rejections(server)[("queue_full", "batch")] >= 2
        running.stop.set()  # it hangs up at its next token, after the resume
    finally:
        _pause(server, False)
    running.join(30)
    queued.join(30)
    assert not running.is_alive() and not queued.is_alive()
    assert queued.status == 200


def test_429_queue_timeout(server: ServerProcess) -> None:
    running = Streamer(server, {"prompt": "a", "max_tokens": 480, "priority": "realtime"})
    running.start()
    assert running.first.wait(30)
    # Paused, `running` holds the only slot however fast the machine, and no step runs: the
    # queue timeout is a timer in the API process, it does not wait for a step boundary.
    _pause(server, True)

    def late(stream: bool) -> tuple[httpx.Response, float]:
        body = {
            "model": MODEL,
            "prompt": "late",
            "max_tokens": 2,
            "priority": "realtime",
            "stream": stream,
        }
        with httpx.Client(timeout=60, headers=AUTH) as http:
            t0 = time.monotonic()
            r = http.post(server.url + "/v1/completions", json=body)
            return r, time.monotonic() - t0

    with ThreadPoolExecutor(2) as pool:
        try:
            plain, streamed = pool.submit(late, False), pool.submit(late, True)
            r, waited = plain.result(60)
            assert_error(r, 429, code="queue_timeout", contains=("queue_timeout_s",))
            assert r.headers["retry-after"] == "3"
            assert 0.3 <= waited < 1.3, waited  # queue_timeout_s 0.3, while paused
            # A stream refused while queued still gets a real 429 (the status line waits for it).
            r, waited = streamed.result(60)
            assert_error(r, 429, code="queue_timeout")
            assert 0.3 <= waited < 1.3, waited
            # Refused in the engine too: nothing of them is left queued.
            wait_for(lambda: _waiting(server, "realtime") == 0)
        finally:
            _pause(server, False)
    running.stop.set()
    running.join(30)
    assert not running.is_alive()
    wait_for(lambda: _rejections(server).get(("queue_timeout", "realtime"), 0) >= 2)
