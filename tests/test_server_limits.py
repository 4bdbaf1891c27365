"""Input limits (issue 15): bad input is a 400 (or 431) with OpenAI's error body naming the
field and its limit, never a 500 and never silently served. One test per case, against a real
`appliance up` process (uvicorn + h11, as deployed)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import ServerProcess, write_template

MODEL = "tiny"
VOCAB = 4096  # the tiny demo model's
HUGE = 2**70
INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("srv-limits")
    srv = ServerProcess(write_template(d / "t.toml", tiny_model_dir), d / "log.txt").start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def assert_error(
    r: httpx.Response, status: int, param: str | None, contains: tuple[str, ...] = ()
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    for text in contains:
        assert text in err["message"], err
    return err


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return server.post(path, json=body)


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


# -- JSON depth ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_body_nested_100000_deep_is_a_400(server: ServerProcess, path: str) -> None:
    field = b'"prompt":' if path == "/v1/completions" else b'"messages":'
    raw = b'{"model":"tiny",' + field + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = server.post(path, content=raw, headers={"content-type": "application/json"})
    err = assert_error(r, 400, None, ("nested deeper than 64",))
    assert err["code"] == "json_too_deep"


def test_body_at_the_depth_limit_is_decoded(server: ServerProcess) -> None:
    # 64 levels exactly: past the depth check, refused by the schema (a prompt of lists of
    # lists ... is no prompt), not by the depth limit.
    raw = b'{"model":"tiny","prompt":' + b"[" * 63 + b"]" * 63 + b"}"
    r = server.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    err = assert_error(r, 400, "prompt")
    assert "nested" not in err["message"]


# -- integer ranges ------------------------------------------------------------------------------
def test_prompt_token_id_2_pow_70(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/completions", completion(prompt=[1, HUGE])),
        400,
        "prompt",
        ("vocabulary [0, 4096)",),
    )


def test_prompt_token_id_just_outside_the_vocabulary(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/completions", completion(prompt=[[1], [VOCAB]])), 400, "prompt", ("4096",)
    )


def test_seed_2_pow_70(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/completions", completion(seed=HUGE)), 400, "seed", (str(INT64_MAX),)
    )


def test_seed_below_int64(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/completions", completion(seed=-(2**63) - 1)),
        400,
        "seed",
        (str(-(2**63)),),
    )


def test_seed_at_the_int64_bounds_is_served(client: openai.OpenAI) -> None:
    for seed in (INT64_MAX, -(2**63)):
        r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, seed=seed)
        assert r.choices[0].finish_reason == "length"


def test_n_2_pow_70(server: ServerProcess) -> None:
    assert_error(post(server, "/v1/completions", completion(n=HUGE)), 400, "n", ("<= 16",))


def test_max_tokens_2_pow_70(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/completions", completion(max_tokens=HUGE)),
        400,
        "max_tokens",
        ("<= 2147483647",),
    )


def test_max_completion_tokens_zero(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/chat/completions", chat(max_completion_tokens=0)),
        400,
        "max_completion_tokens",
        (">= 1",),
    )


def test_logprobs_2_pow_70(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/completions", completion(logprobs=HUGE)), 400, "logprobs", ("<= 20",)
    )


def test_top_logprobs_2_pow_70(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/chat/completions", chat(logprobs=True, top_logprobs=HUGE)),
        400,
        "top_logprobs",
        ("<= 20",),
    )


def test_min_tokens_2_pow_70(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/completions", completion(min_tokens=HUGE)),
        400,
        "min_tokens",
        ("<= 2147483647",),
    )


def test_top_k_2_pow_70(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/completions", completion(top_k=HUGE)), 400, "top_k", ("<= 2147483647",)
    )


def test_top_k_beyond_the_vocabulary(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/completions", completion(top_k=VOCAB + 1)), 400, "top_k", ("4096",)
    )


def test_top_k_below_minus_one(server: ServerProcess) -> None:
    assert_error(post(server, "/v1/completions", completion(top_k=-2)), 400, "top_k", (">= -1",))


def test_priority_int_2_pow_70(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/completions", completion(priority=HUGE)), 400, "priority", ("2147483647",)
    )


def test_best_of_2_pow_70(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/completions", completion(best_of=HUGE)), 400, "best_of", ("<= 16",)
    )


def test_stop_token_id_2_pow_70(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/completions", completion(stop_token_ids=[HUGE])),
        400,
        "stop_token_ids[0]",
        ("<= 2147483647",),
    )


def test_stop_token_id_outside_the_vocabulary(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/completions", completion(stop_token_ids=[2, VOCAB])),
        400,
        "stop_token_ids",
        ("vocabulary [0, 4096)",),
    )


def test_detokenize_token_2_pow_70(server: ServerProcess) -> None:
    assert_error(
        post(server, "/detokenize", {"tokens": [1, HUGE]}), 400, "tokens[1]", ("<= 2147483647",)
    )


# -- chat roles and tool_choice ------------------------------------------------------------------
def test_unknown_chat_role(server: ServerProcess) -> None:
    body = chat(messages=[{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}])
    assert_error(
        post(server, "/v1/chat/completions", body),
        400,
        "messages[1].role",
        ("'wizard'", "assistant", "developer", "function", "system", "tool", "user"),
    )


def test_unknown_chat_role_on_tokenize(server: ServerProcess) -> None:
    body = {"messages": [{"role": "wizard", "content": "b"}]}
    assert_error(post(server, "/tokenize", body), 400, "messages[0].role", ("'wizard'",))


def test_every_openai_role_passes_the_role_check(server: ServerProcess) -> None:
    # The demo model's chat template may still refuse an odd turn order: what matters is that
    # no OpenAI role is refused as a role.
    for role in ("system", "user", "assistant", "tool", "developer", "function"):
        r = post(server, "/v1/chat/completions", chat(messages=[{"role": role, "content": "x"}]))
        assert r.status_code == 200 or r.json()["error"]["param"] != "messages[0].role", r.text


def test_tool_choice_required_without_tools(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            tool_choice="required",
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == "tool_choice"
    assert "'required' needs `tools`" in info.value.body["message"]


def test_tool_choice_named_function_without_tools(server: ServerProcess) -> None:
    body = chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert_error(
        post(server, "/v1/chat/completions", body),
        400,
        "tool_choice",
        ("'get_weather' needs `tools`",),
    )


def test_tool_choice_unknown_string(server: ServerProcess) -> None:
    assert_error(
        post(server, "/v1/chat/completions", chat(tool_choice="always")),
        400,
        "tool_choice",
        ("'always'",),
    )


def test_tool_choice_none_and_auto_without_tools_are_served(client: openai.OpenAI) -> None:
    for choice in ("none", "auto"):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            tool_choice=choice,
        )
        assert r.choices[0].finish_reason == "length"


# -- the HTTP edge -------------------------------------------------------------------------------
def _raw_http(server: ServerProcess, request: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def test_4mb_header_gets_an_openai_error_body(server: ServerProcess) -> None:
    r = httpx.post(
        server.url + "/v1/completions",
        json=completion(),
        headers={"x-big": "a" * (4 * 1024 * 1024)},
        timeout=30,
    )
    err = assert_error(r, 431, None, ("request headers too large", "65536 bytes"))
    assert err["code"] == "request_header_too_large"


def test_malformed_request_line_gets_an_openai_error_body(server: ServerProcess) -> None:
    status, headers, body = _raw_http(server, b"GARBAGE\r\n\r\n")
    assert status == 400
    assert headers["content-type"] == "application/json"
    err = httpx.Response(400, content=body).json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_http_request"
    assert err["param"] is None


def test_server_still_serves_after_the_bad_input(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_an_idle_connection_outlives_the_clients_keepalive_expiry(server: ServerProcess) -> None:
    """A connection idle past uvicorn's default 5 s is still served, on the same socket: the
    server keeps idle connections (server.keep_alive_timeout_s) longer than its clients keep
    them in their pools (CLIENT_KEEPALIVE_EXPIRY_S, which the appliance's own clients use), so
    it never closes one as a client sends on it (a `bench serve` request was lost to that,
    ReadError)."""
    import http.client
    import time

    from appliance.config import CLIENT_KEEPALIVE_EXPIRY_S, ServerConfig

    assert CLIENT_KEEPALIVE_EXPIRY_S < 5 < ServerConfig().keep_alive_timeout_s
    port = int(server.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        statuses = []
        for pause in (0.0, 6.0):
            time.sleep(pause)
            conn.request("GET", "/health")
            response = conn.getresponse()  # RemoteDisconnected had the server closed it
            response.read()
            statuses.append(response.status)
            if pause == 0.0:
                first_socket = conn.sock
        assert statuses == [200, 200] and conn.sock is first_socket
    finally:
        conn.close()
