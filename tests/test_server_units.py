"""Server pieces without a server: IPC framing, auth, sd_notify, metrics counters across engine
rebuilds, error bodies, the routes against /openapi.json, and the serving benchmark's workload
and statistics."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import re
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.config import ConfigError, ServerConfig
from appliance.engine import ipc
from appliance.engine.outputs import EngineOutput, Logprob
from appliance.metrics import Metrics
from appliance.sampling_params import SamplingParams
from appliance.server import sdnotify
from appliance.server.auth import AuthKeys, check_bind, is_loopback
from appliance.server.errors import from_validation
from appliance.server.schemas import CompletionRequest


def test_frames_match_multiprocessing_connection() -> None:
    """The asyncio side writes and reads exactly what Connection.send_bytes/recv_bytes do."""
    a, b = mp.Pipe(duplex=True)
    payload = ipc.encode(
        ipc.AddRequest(
            request_id="r1",
            prompt_token_ids=[1, 2, 3],
            params=SamplingParams(max_tokens=4, stop=["x"]),
            priority="batch",
            arrival_time=1.5,
        )
    )
    a.send_bytes(payload)
    raw = os.read(b.fileno(), 1 << 16)
    assert raw == ipc.frame(payload)
    os.write(a.fileno(), ipc.frame(payload))
    msg = ipc.decode_to_core(b.recv_bytes())
    assert isinstance(msg, ipc.AddRequest) and msg.params.stop == ["x"] and msg.priority == "batch"


def test_frame_roundtrip_of_outputs() -> None:
    out = EngineOutput(
        request_id="r",
        new_token_ids=[7],
        new_logprobs=[Logprob(7, -0.1, [(7, -0.1), (9, -2.0)])],
        finished=True,
        finish_reason="stop",
        queue_time_s=0.01,
        num_preemptions=2,
    )
    frame = ipc.Frame(
        added=[ipc.AddResult("r")],
        outputs=[out, EngineOutput(request_id="q", new_token_ids=[3])],
        steps=[(12, 3)],
        waiting_by_class={"batch": 2},
    )
    back = ipc.decode_from_core(ipc.encode(frame))
    assert back == frame


async def test_asyncio_reader_reads_connection_frames() -> None:
    a, b = socket.socketpair()
    conn = mp.connection.Connection(os.dup(b.fileno()))
    reader, writer = await asyncio.open_unix_connection(sock=a)
    conn.send_bytes(ipc.encode(ipc.Pong(5)))
    (n,) = ipc.HEADER.unpack(await reader.readexactly(4))
    assert ipc.decode_from_core(await reader.readexactly(n)) == ipc.Pong(5)
    writer.close()
    conn.close()
    b.close()


def test_api_keys_from_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "keys").write_text("# comment\nkey-a\n\nkey-b\n")
    monkeypatch.setenv("KEYS", "key-c, key-d")
    keys = AuthKeys.from_config(
        ServerConfig(api_key_file=str(tmp_path / "keys"), api_key_env="KEYS")
    )
    assert keys.api_keys == [b"key-a", b"key-b", b"key-c", b"key-d"]
    assert keys.check_api_key(b"key-d") and not keys.check_api_key(b"key-")
    assert not keys.check_api_key(None)
    # No admin token configured: loopback clients only.
    assert keys.check_admin(None, "127.0.0.1") and not keys.check_admin(None, "10.0.0.2")
    with pytest.raises(ConfigError, match="api_key_file"):
        AuthKeys.from_config(ServerConfig(api_key_file=str(tmp_path / "missing")))


def test_bind_check() -> None:
    assert is_loopback("::1") and is_loopback("127.0.0.5") and not is_loopback("0.0.0.0")
    with pytest.raises(ConfigError, match="loopback"):
        check_bind("0.0.0.0", AuthKeys())
    check_bind("0.0.0.0", AuthKeys(api_keys=[b"k"]))


def test_sdnotify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False  # not under systemd: a no-op
    path = str(tmp_path / "n.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert sdnotify.notify("STATUS=loading")
    assert sock.recv(100) == b"STATUS=loading"
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval_s() == 2.0
    assert sdnotify.watchdog_ping() and sock.recv(100) == b"WATCHDOG=1"
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert sdnotify.watchdog_interval_s() is None
    sock.close()


def _sample(m: Metrics, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_engine_counters_stay_monotonic_across_rebuilds() -> None:
    from appliance.stats import EngineStats, SchedulerCounters

    def stats(preemptions: int, hits: int) -> EngineStats:
        c = SchedulerCounters(
            preemptions=preemptions,
            preemptions_by={"recompute/batch": preemptions},
            rejected_by={"queue_timeout/realtime": 1},
            tpot_stretched_steps=preemptions,
        )
        return EngineStats(
            model_name="m",
            step=0,
            num_running=1,
            num_waiting=2,
            num_swapped=0,
            num_blocks=10,
            block_size=16,
            blocks_used=3,
            blocks_cached=2,
            blocks_free=5,
            kv_usage=0.3,
            slots_holding_tokens=0,
            slots_allocated=0,
            slot_utilisation=1.0,
            slot_utilisation_at_peak=1.0,
            swap_blocks_total=0,
            swap_blocks_used=0,
            prefix_cache_queries=100,
            prefix_cache_hits=hits,
            prompt_tokens_total=0,
            generation_tokens_total=0,
            requests_finished={},
            counters=c,
            last_step=None,
        )

    m = Metrics("m")
    m.engine_rebuilt("m", {"block_size": 16})
    m.update_engine(stats(3, 40))
    m.update_engine(stats(5, 60))
    assert _sample(m, "vllm:num_preemptions_total") == 5
    m.engine_rebuilt("m", {"block_size": 16})  # a reload: the new engine counts from zero
    m.update_engine(stats(2, 10))
    assert _sample(m, "vllm:num_preemptions_total") == 7
    assert _sample(m, "vllm:prefix_cache_hits_total") == 70
    assert _sample(m, "appliance_preemptions_total", mode="recompute", priority_class="batch") == 7
    assert _sample(m, "appliance_requests_rejected_total", reason="queue_timeout") == 2
    assert _sample(m, "vllm:num_requests_waiting") == 2
    assert _sample(m, "appliance_kv_blocks", state="cached") == 2
    assert _sample(m, "appliance_tpot_stretched_steps_total") == 7


def test_series_exist_at_zero_from_the_engine_start_and_a_reload_keeps_them() -> None:
    from appliance.core.request import FinishReason
    from appliance.metrics.labels import FINISH_REASONS

    # Every reason a request can finish with has its series from the start.
    assert set(FINISH_REASONS) == {r.value for r in FinishReason}
    m = Metrics("m")
    m.engine_rebuilt("m", {"block_size": 16}, ["realtime", "batch"])
    for reason in FINISH_REASONS:
        assert _sample(m, "vllm:request_success_total", finished_reason=reason) == 0
    assert _sample(m, "vllm:time_to_first_token_seconds_count") == 0
    assert _sample(m, "appliance_preemptions_total", mode="swap", priority_class="batch") == 0
    assert _sample(m, "appliance_drain_requests_total", outcome="cut") == 0
    m.observe_finish("stop", 0.5, 0.1)
    m.engine_rebuilt("m", {"block_size": 16}, ["realtime", "batch"])  # a reload: no reset
    assert _sample(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert _sample(m, "vllm:e2e_request_latency_seconds_count") == 1


def test_validation_errors_name_the_field() -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(b'{"prompt": "x", "n": 0}', type=CompletionRequest)
    err = from_validation(info.value)
    assert err.status == 400 and err.param == "n" and ">= 1" in err.message


def test_workload_is_deterministic_and_mixed() -> None:
    from appliance.bench.workload import make_workload

    a = make_workload("mixed", 200, "poisson", 4.0, seed=3)
    b = make_workload("mixed", 200, "poisson", 4.0, seed=3)
    assert [(i.prompt, i.output_len, i.arrival_s) for i in a] == [
        (i.prompt, i.output_len, i.arrival_s) for i in b
    ]
    share = sum(i.priority_class == "realtime" for i in a) / len(a)
    assert 0.7 < share < 0.9
    assert all(len(i.prompt) + i.output_len <= 2048 for i in a)
    burst = make_workload("chat", 5, "burst", 1.0, seed=0)
    assert {i.arrival_s for i in burst} == {0.0}
    fixed = make_workload("chat", 4, "burst", 1.0, seed=0, prompt_len=128, output_len=64)
    assert {(len(i.prompt), i.output_len) for i in fixed} == {(128, 64)}


def test_bench_summary_percentiles_and_goodput() -> None:
    from appliance.bench.serve import SLO, Result, pct, summarize

    assert pct([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0 and pct([], 50) is None
    results = [
        Result(i, "realtime", 10, output_tokens=11, status=200, ttft_s=0.1 * (i + 1), e2e_s=1.0 + i)
        for i in range(4)
    ]
    results.append(Result(9, "batch", 10, status=429))
    s = summarize(results, 2.0, SLO(ttft_ms=250))
    assert s.ok == 4 and s.requests == 5
    assert s.goodput == 1.0  # two of the four met TTFT <= 250 ms, over 2 s
    assert s.output_token_throughput == 22.0
    assert s.tpot_ms["p50"] is not None


def test_a_refusal_names_the_field_the_engine_validation_named() -> None:
    from appliance.sampling_params import SamplingParams, invalid_field

    cases = [
        ({"temperature": -1.0}, "temperature"),
        ({"max_tokens": 4, "min_tokens": 8}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 50}, "logprobs"),
    ]
    for bad, field in cases:
        with pytest.raises(ValueError) as info:
            SamplingParams(**bad).validate()  # type: ignore[arg-type]
        assert invalid_field(str(info.value)) == field
    assert invalid_field("prompt: token id 9 is outside the vocabulary [0, 4)") == "prompt"
    assert invalid_field("the pool is full") is None


def test_bench_audit_classifies_outcomes_and_late_answers() -> None:
    from appliance.bench.audit import GRACE_S, Outcome, classify, late

    limits = {"realtime": 10.0, "batch": 0.0}
    assert classify(Outcome("realtime", 200, False, 1.0)) == "completed"
    assert classify(Outcome("realtime", 429, True, 10.1)) == "429 with Retry-After"
    assert classify(Outcome("realtime", 503, False, 0.1)) == "503 WITHOUT Retry-After"
    assert classify(Outcome("realtime", "ReadTimeout", False, None)) == "other: ReadTimeout"
    assert late(Outcome("realtime", 429, True, 10.0 + GRACE_S - 0.1), limits) is None
    assert late(Outcome("realtime", 429, True, 10.0 + GRACE_S + 2.0), limits) == pytest.approx(2.0)
    assert late(Outcome("realtime", 200, False, 30.0), limits) == pytest.approx(20.0 - GRACE_S)
    assert late(Outcome("batch", 200, False, 999.0), limits) is None  # no limit for the class


def test_bench_serve_max_concurrency_bounds_the_requests_in_flight() -> None:
    """--max-concurrency 2: a burst of 6 reaches the server at most two at a time, and each
    request's latency counts from when it was sent, not from the burst's start."""
    import argparse
    import asyncio

    from appliance.bench.serve import _one
    from appliance.bench.workload import make_workload

    in_flight, peak = 0, 0

    class Response:
        status_code = 200
        headers: dict[str, str] = {}

        async def aiter_lines(self):  # type: ignore[no-untyped-def]
            await asyncio.sleep(0.2)
            yield 'data: {"choices": [{"text": "x"}]}'
            yield 'data: {"choices": [], "usage": {"completion_tokens": 1}}'
            yield "data: [DONE]"

    class Stream:
        async def __aenter__(self) -> Response:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            return Response()

        async def __aexit__(self, *exc: object) -> None:
            nonlocal in_flight
            in_flight -= 1

    class Client:
        def stream(self, method: str, url: str, json: object) -> Stream:
            return Stream()

    ns = argparse.Namespace(model="m", prompt_format="tokens", allow_eos=False, no_priority=True)
    items = make_workload("chat", 6, "burst", 1.0, seed=0, prompt_len=8, output_len=1)

    async def run() -> list:  # type: ignore[type-arg]
        import time

        slots = asyncio.Semaphore(2)
        t0 = time.perf_counter()
        return await asyncio.gather(*(_one(Client(), "u", it, ns, t0, slots) for it in items))

    results = asyncio.run(run())
    assert peak == 2
    assert all(r.status == 200 and r.output_tokens == 1 for r in results)
    # Three waves of 0.2 s: counted from the burst, the last wave would show >= 0.6 s.
    assert max(r.e2e_s for r in results) < 0.4


def _served_but_undocumented(app: Any) -> list[str]:
    """Routes the app serves with include_in_schema (Litestar's default) that /openapi.json
    does not describe."""
    from appliance.server.openapi_doc import openapi_document

    paths = openapi_document()["paths"]
    return [
        f"{method} {r.path}"
        for r in app.routes
        for handler in r.route_handlers
        if handler.resolve_include_in_schema()
        for method in sorted(handler.http_methods)
        if method.lower() not in paths.get(_openapi_path(r.path), {})
    ]


def _openapi_path(litestar_path: str) -> str:
    """Litestar's /x/{name:str} is OpenAPI's /x/{name}."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", litestar_path)


def test_every_served_route_is_in_the_openapi_document() -> None:
    from litestar import Litestar, post

    from appliance.config import ApplianceConfig
    from appliance.server.app import create_app
    from appliance.server.routes import ROUTES

    app = create_app(SimpleNamespace(config=ApplianceConfig()))  # type: ignore[arg-type]
    assert _served_but_undocumented(app) == []
    served = {
        (m, _openapi_path(r.path))
        for r in app.routes
        for h in r.route_handlers
        for m in h.http_methods
    }
    assert {(r.method, r.path) for r in ROUTES} <= served

    # An endpoint registered outside the route table is caught.
    @post("/v1/audio/speech")
    async def speech() -> None: ...

    stray = Litestar(route_handlers=[speech], openapi_config=None)
    assert _served_but_undocumented(stray) == ["POST /v1/audio/speech"]


def test_the_engines_prompt_checks_name_the_field_and_the_limit() -> None:
    from appliance.engine.request_checks import InvalidRequest, check_prompt

    cases = [
        ([], "must contain at least one token", ""),
        ([1, 9], "token id 9 is outside the vocabulary [0, 8)", ""),
        (
            [1] * 16,
            "16 tokens; this model's maximum context length is 16",
            "context_length_exceeded",
        ),
        ([1] * 12, "12 tokens need 4 KV blocks, the pool has 3", ""),
    ]
    for ids, words, code in cases:
        with pytest.raises(InvalidRequest) as info:
            check_prompt(ids, vocab_size=8, max_model_len=16, block_size=4, num_blocks=3)
        assert str(info.value).startswith("prompt: ") and words in str(info.value)
        assert info.value.code == code


def test_an_engine_refusal_becomes_the_400_naming_the_requests_own_field() -> None:
    from appliance.server.prepare import PreparedRequest
    from appliance.server.scoring import ResponsePlan

    req = PreparedRequest(
        chat=True,
        prompts=[[1]],
        params=SamplingParams(),
        n=1,
        stream=False,
        priority=None,
        priority_class="",
        logprobs=None,
        include_usage=False,
        plan=ResponsePlan(),
        prompt_param="messages",
        constraint_param="response_format.json_schema.schema",
    )
    err = req.refusal("prompt: 600 tokens; this model's ...", "context_length_exceeded")
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    assert err.message == "messages: 600 tokens; this model's ..."
    err = req.refusal("structured: unsupported JSON schema feature 'not' at /")
    assert err.param == "response_format.json_schema.schema"
    assert (
        err.message
        == "response_format.json_schema.schema: unsupported JSON schema feature 'not' at /"
    )
    err = req.refusal("min_tokens cannot be combined with structured outputs")
    assert (err.param, err.code, err.message.split()[0]) == ("min_tokens", None, "min_tokens")
