"""The cluster's pure parts, without Ray: the routing order (queue depth, prefix affinity and
its load guard), the autoscaling decision, the settings' refusals, the stream guard's ending,
the merged /metrics, and the ingress's retries against replicas answered by httpx transports."""

from __future__ import annotations

import random

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.cluster.autoscale import desired_replicas
from appliance.cluster.ingress import ClusterIngress
from appliance.cluster.metrics_merge import render
from appliance.cluster.routing import ReplicaLoad, affinity_key, replica_order
from appliance.cluster.settings import ClusterConfig, check_gpus, cluster_config
from appliance.cluster.stream_guard import StreamGuard
from appliance.config import ConfigError


def load(rid: str, waiting: int = 0, phase: str = "ready", pool: str = "default") -> ReplicaLoad:
    return ReplicaLoad(
        replica_id=rid,
        url=f"http://{rid}",
        phase=phase,
        template="t",
        num_waiting=waiting,
        pool=pool,
    )


def test_queue_order_is_by_reported_waiting_plus_inflight() -> None:
    replicas = [load("a", 3), load("b", 0), load("c", 1), load("d", 0, phase="reloading")]
    order = replica_order(replicas, {"b": 2}, "queue", None, 4, random.Random(0))
    assert [r.replica_id for r in order] == ["c", "b", "a"]  # d is not ready


def test_prefix_affinity_is_stable_and_spreads_keys() -> None:
    replicas = [load("a"), load("b"), load("c")]
    homes = {}
    for i in range(30):
        key = f"system prompt {i}"
        first = {replica_order(replicas, {}, "prefix", key, 4)[0].replica_id for _ in range(5)}
        assert len(first) == 1  # one home per key
        homes[key] = first.pop()
    assert set(homes.values()) == {"a", "b", "c"}
    # A replica gone moves only the keys it was home to (rendezvous hashing).
    without_c = [r for r in replicas if r.replica_id != "c"]
    for key, home in homes.items():
        if home != "c":
            assert replica_order(without_c, {}, "prefix", key, 4)[0].replica_id == home


def test_prefix_affinity_yields_to_load_beyond_the_imbalance() -> None:
    replicas = [load("a"), load("b")]
    key = "shared"
    home = replica_order(replicas, {}, "prefix", key, 2)[0].replica_id
    other = "b" if home == "a" else "a"
    assert replica_order(replicas, {home: 2}, "prefix", key, 2)[0].replica_id == home
    assert replica_order(replicas, {home: 3}, "prefix", key, 2)[0].replica_id == other


def test_affinity_key_reads_chat_messages_and_prompts() -> None:
    sys_msg = {"role": "system", "content": "You are a helpful assistant. " * 20}
    a = affinity_key({"messages": [sys_msg, {"role": "user", "content": "one"}]}, 64)
    b = affinity_key({"messages": [sys_msg, {"role": "user", "content": "two"}]}, 64)
    assert a == b and a is not None and len(a) == 64
    assert affinity_key({"prompt": "abc"}, 64) == "abc"
    assert affinity_key({"prompt": [[1, 2, 3]]}, 64) == "[1, 2, 3]"
    assert affinity_key("not a body", 64) is None


@pytest.mark.parametrize(
    ("current", "waiting", "running", "wait_s", "want"),
    [
        (1, 9, 4, None, 3),  # 9 waiting at 4 per replica: 3
        (2, 3, 8, 5.0, 3),  # few waiting but each waits 5 s > 2 s: one more
        (2, 3, 8, 1.0, 2),  # within both targets: stay
        (3, 0, 2, None, 3),  # running but nothing waits: stay
        (3, 0, 0, None, 2),  # idle: one fewer (Ray Serve's downscale delay holds it)
    ],
)
def test_autoscaling_decision(
    current: int, waiting: int, running: int, wait_s: float | None, want: int
) -> None:
    assert desired_replicas(current, waiting, running, wait_s, 4.0, 2.0) == want


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"replicas": 0}, "replicas 0"),
        ({"replicas": 2, "max_replicas": 1}, "max_replicas 1 is below min_replicas 2"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas 2 is below min_replicas 3"),
        ({"routing": "random"}, "routing"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_settings_name_the_value(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cluster_config(raw)


def test_more_gpus_than_the_cluster_has_is_refused() -> None:
    cfg = ClusterConfig(template="7b-a10", replicas=2)
    with pytest.raises(
        ConfigError, match=r"2 GPU\(s\) per replica x 2 replicas = 4 GPUs; the cluster has 3"
    ):
        check_gpus(cfg, 2, 3.0)
    check_gpus(cfg, 2, 4.0)


def test_stream_guard_ends_open_choices_then_raises_in_the_sdk() -> None:
    import openai
    from openai._streaming import Stream
    from openai.types.chat import ChatCompletionChunk

    guard = StreamGuard()
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    chunks = [
        {**head, "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]},
        {**head, "choices": [{"index": 1, "delta": {"content": "b"}, "finish_reason": "stop"}]},
    ]
    relayed = b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in chunks)
    guard.feed(relayed[:50])
    guard.feed(relayed[50:])
    body = relayed + guard.tail("replica r1 was lost")

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    client = openai.OpenAI(
        base_url="http://x/v1",
        api_key="k",
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    stream = client.chat.completions.create(model="m", messages=[], stream=True)
    assert isinstance(stream, Stream)
    got: list[ChatCompletionChunk] = []
    with pytest.raises(openai.APIError, match="replica r1 was lost"):
        for chunk in stream:
            got.append(chunk)
    assert [c.choices[0].finish_reason for c in got] == [None, "stop", "abort"]
    assert got[-1].choices[0].index == 0  # only the open choice is ended


def test_merged_metrics_keep_vllm_names_with_a_replica_label() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    def exported(running: int, prompt: int) -> str:
        """A replica's /metrics as prometheus_client writes it (as the appliance's does)."""
        reg = CollectorRegistry()
        Gauge("vllm:num_requests_running", "Running.", ["model_name"], registry=reg).labels(
            "m"
        ).set(running)
        Counter("vllm:prompt_tokens", "Prompt tokens.", ["model_name"], registry=reg).labels(
            "m"
        ).inc(prompt)
        Histogram("vllm:e2e_request_latency_seconds", "E2E.", ["model_name"], registry=reg).labels(
            "m"
        ).observe(0.5)
        return generate_latest(reg).decode()

    out = render({"r1": exported(2, 10), "r2": exported(3, 5)}, []).decode()
    fams = {f.name: f for f in text_string_to_metric_families(out)}
    running = {s.labels["replica"]: s.value for s in fams["vllm:num_requests_running"].samples}
    assert running == {"r1": 2.0, "r2": 3.0}
    prompt = fams["vllm:prompt_tokens"]
    assert prompt.type == "counter"
    totals = {s.labels["replica"]: s.value for s in prompt.samples if s.name.endswith("_total")}
    assert totals == {"r1": 10.0, "r2": 5.0}
    e2e = fams["vllm:e2e_request_latency_seconds"]
    assert e2e.type == "histogram"
    counts = [s for s in e2e.samples if s.name.endswith("_count")]
    assert {s.labels["replica"] for s in counts} == {"r1", "r2"}
    assert all(s.labels["model_name"] == "m" for s in prompt.samples)


def _answer(
    status: int, body: dict[str, object], headers: dict[str, str] | None = None
) -> httpx.Response:
    """A replica's answer as it arrives over the network: a body still to be streamed."""
    content = msgspec.json.encode(body)
    return httpx.Response(
        status,
        headers={"content-type": "application/json", **(headers or {})},
        stream=httpx.ByteStream(content),
    )


async def test_ingress_moves_429_503_and_dead_replicas_to_the_next() -> None:
    seen: list[str] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        seen.append(host)
        assert request.headers["authorization"] == "Bearer k"  # passed on to the replica
        if host == "full":
            return _answer(429, {"error": {"message": "full"}}, {"Retry-After": "2"})
        if host == "draining":
            return _answer(503, {"error": {"message": "draining"}})
        if host == "dead":
            raise httpx.ConnectError("refused", request=request)
        return _answer(200, {"ok": host})

    replicas = [load("full", 0), load("draining", 1), load("dead", 2), load("good", 3)]

    async def snapshot() -> list[ReplicaLoad]:
        return replicas

    cfg = ClusterConfig(routing="queue", wait_for_replica_s=0.6, report_interval_s=0.25)
    ingress = ClusterIngress(snapshot, cfg, httpx.MockTransport(upstream))
    transport = httpx.ASGITransport(app=ingress)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        got = await client.post(
            "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer k"}
        )
        assert got.status_code == 200 and got.json() == {"ok": "good"}
        assert got.headers["x-appliance-replica"] == "good"
        assert seen == ["full", "draining", "dead", "good"]
        # The dead replica is skipped from now on. With the others refusing and one of them
        # not ready (503), rounds repeat on fresh views until wait_for_replica_s, then the
        # client gets the last refusal with its own headers.
        replicas.remove(replicas[3])
        seen.clear()
        got = await client.post(
            "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer k"}
        )
        assert got.status_code == 503 and got.json()["error"]["message"] == "draining"
        assert seen[:2] == ["full", "draining"] and len(seen) >= 4 and len(seen) % 2 == 0
        # Every queue full (429 only): answered at once, Retry-After passed on.
        replicas.remove(replicas[1])
        seen.clear()
        got = await client.post(
            "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer k"}
        )
        assert seen == ["full"]
        assert got.status_code == 429 and got.headers["retry-after"] == "2"
    await ingress.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas", "0"], "replicas 0: a cluster needs at least 1 replica"),
        (["--replicas", "2", "--max-replicas", "1"], "max_replicas 1 is below min_replicas 2"),
        (["--set", "scheduler.max_num_seqs=0"], "max_num_seqs"),
    ],
)
def test_cluster_up_refuses_bad_input_before_ray_starts(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from appliance.cli import main

    assert main(["cluster", "up", "--template", "cpu-demo", *args]) == 2
    assert message in capsys.readouterr().err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_long_prompts_go_to_the_long_pool_by_the_routers_rule() -> None:
    """`appliance route`'s length rule (its prompt_tokens, longer than the threshold) as the
    ingress's pool choice; the default pool stays a fallback when the long one cannot take it."""
    replicas = [load("d1"), load("l1", pool="long")]

    async def snapshot() -> list[ReplicaLoad]:
        return replicas

    cfg = ClusterConfig(long_prompt_tokens=10, chars_per_token=1.0, routing="queue")
    ingress = ClusterIngress(snapshot, cfg)
    ingress.replicas = replicas
    assert [r.replica_id for r in ingress.candidates({"prompt": "x" * 10})] == ["d1"]
    assert [r.replica_id for r in ingress.candidates({"prompt": "x" * 11})] == ["l1", "d1"]
    chat = {"messages": [{"role": "user", "content": "y" * 11}]}
    assert [r.replica_id for r in ingress.candidates(chat)][0] == "l1"


def test_the_serve_config_file_rebuilds_the_same_settings() -> None:
    """`appliance cluster config` writes what `serve deploy` needs: the builder's import path
    and the settings as its args, which validate back to the same ClusterConfig."""
    import importlib

    from appliance.cluster.app import app_builder, serve_config

    cfg = cluster_config(
        {
            "template": "cpu-demo",
            "replicas": 2,
            "max_replicas": 4,
            "port": 8123,
            "overrides": {"scheduler.max_num_seqs": 8},
        }
    )
    doc = serve_config(cfg)
    assert doc["http_options"] == {"host": "127.0.0.1", "port": 8123}
    (app,) = doc["applications"]
    module, _, attr = app["import_path"].partition(":")
    assert getattr(importlib.import_module(module), attr) is app_builder
    assert cluster_config(msgspec.json.decode(msgspec.json.encode(app["args"]))) == cfg


async def test_admin_reads_one_steady_replica_and_refuses_levers() -> None:
    seen: list[str] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        return _answer(200, {"replica": request.url.host})

    replicas = [load("b"), load("a"), load("c", phase="reloading")]

    async def snapshot() -> list[ReplicaLoad]:
        return replicas

    ingress = ClusterIngress(snapshot, ClusterConfig(), httpx.MockTransport(upstream))
    transport = httpx.ASGITransport(app=ingress)
    async with httpx.AsyncClient(transport=transport, base_url="http://ingress") as client:
        for _ in range(3):
            assert (await client.get("/admin/stats")).json() == {"replica": "a"}
        named = await client.get("/admin/stats", headers={"x-appliance-replica": "b"})
        assert named.json() == {"replica": "b"}
        gone = await client.get("/admin/stats", headers={"x-appliance-replica": "c"})
        assert gone.status_code == 503 and "'c' is not ready" in gone.text
        lever = await client.post("/admin/reload", json={"template": "x"})
        assert lever.status_code == 405 and "appliance cluster apply" in lever.text
    assert seen == ["a", "a", "a", "b"]
    await ingress.close()
