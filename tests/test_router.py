"""`appliance route`: the routing policy, the proxy's edges (in process, a mock upstream), and
the real thing: two `appliance up` instances and the router as a subprocess; a short prompt and
a long one land on different instances, a stream flows through, the batch class goes to its
pool, a full queue's 429 comes back with its Retry-After, a client that hangs up aborts the
upstream request. The Grafana dashboard's metrics are checked against a live /metrics."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, free_port, write_template

from appliance.config import ConfigError
from appliance.tools.router import (
    Router,
    RouterConfig,
    TokenCounter,
    choose_pool,
    load_router_config,
    prompt_tokens,
)

REPO = Path(__file__).resolve().parents[1]
POOLS = {
    "realtime": "http://127.0.0.1:1",
    "long": "http://127.0.0.1:2",
    "batch": "http://127.0.0.1:3",
}


def cfg(**kw: object) -> RouterConfig:
    base: dict[str, object] = {
        "pools": POOLS,
        "long_pool": "long",
        "long_prompt_tokens": 10,
        "chars_per_token": 1.0,
        "classes": {"batch": "batch"},
    }
    return load_router_config(None, {**base, **kw})


# ---------------------------------------------------------------------------------------------
# Policy


def test_policy_class_first_then_length_then_default() -> None:
    c, n = cfg(), TokenCounter(1.0)
    assert choose_pool(c, {"prompt": "short"}, n) == ("realtime", "default")
    assert choose_pool(c, {"prompt": "x" * 10}, n) == ("realtime", "default")  # not longer
    assert choose_pool(c, {"prompt": "x" * 11}, n) == ("long", "long")
    assert choose_pool(c, {"prompt": "x" * 11, "priority": "batch"}, n) == ("batch", "class")
    assert choose_pool(c, {"prompt": "x" * 11, "priority": "realtime"}, n) == ("long", "long")
    assert choose_pool(c, {"prompt": "short", "priority": 3}, n) == ("realtime", "default")
    assert choose_pool(c, None, n) == ("realtime", "default")  # not JSON: the pool answers 400
    assert choose_pool(cfg(long_pool=""), {"prompt": "x" * 99}, n) == ("realtime", "default")


def test_prompt_length_of_every_prompt_shape(tiny_model_dir: Path) -> None:
    est = TokenCounter(4.0)
    assert prompt_tokens({"prompt": "abcdefgh"}, est) == 2
    assert prompt_tokens({"prompt": ["ab", "abcdefghijkl"]}, est) == 3  # the longest
    assert prompt_tokens({"prompt": [1, 2, 3, 4, 5]}, est) == 5  # token ids: exact
    assert prompt_tokens({"prompt": [[1, 2], [1, 2, 3]]}, est) == 3
    chat = {
        "messages": [
            {"role": "system", "content": "abcd"},
            {"role": "user", "content": [{"type": "text", "text": "efgh"}, {"type": "image_url"}]},
        ]
    }
    assert prompt_tokens(chat, est) == 3  # "abcd\nefgh"
    exact = TokenCounter(tokenizer_dir=str(tiny_model_dir))
    from tokenizers import Tokenizer

    text = "The quick brown fox jumps over the lazy dog. " * 5
    want = len(
        Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
        .encode(text, add_special_tokens=False)
        .ids
    )
    assert prompt_tokens({"prompt": text}, exact) == want


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="router.pools"):
        load_router_config(None, {})
    with pytest.raises(ConfigError, match="long_pool"):
        cfg(long_pool="nope")
    with pytest.raises(ConfigError, match=r"classes\.batch"):
        cfg(classes={"batch": "nope"})
    with pytest.raises(ConfigError, match="not an http"):
        load_router_config(None, {"pools": {"a": "127.0.0.1:80"}})
    f = tmp_path / "r.toml"
    f.write_text(
        '[router]\nport = 9\nlong_pool = "long"\n[router.pools]\nrealtime = "http://a:1"\nlong = "http://b:2"\n'
    )
    c = load_router_config(str(f), {"port": 10, "classes": {}})  # flags win over the file
    assert (c.port, c.default_pool, c.long_pool) == (10, "realtime", "long")
    with pytest.raises(ConfigError, match="tokenizer.json"):
        TokenCounter(tokenizer_dir=str(tmp_path))


# ---------------------------------------------------------------------------------------------
# The proxy in process, against a mock upstream


async def proxy(c: RouterConfig, handler: object) -> tuple[Router, httpx.AsyncClient]:
    router = Router(c, transport=httpx.MockTransport(handler))  # type: ignore[arg-type]
    router.open()
    return router, httpx.AsyncClient(
        transport=httpx.ASGITransport(app=router), base_url="http://router"
    )


async def test_proxy_passes_status_headers_and_body_through() -> None:
    seen: list[httpx.Request] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = json.dumps(
            {"error": {"message": "queue full", "type": "rate_limit", "code": 429}}
        ).encode()
        # A stream, as a real connection gives it (the proxy relays raw bytes).
        return httpx.Response(
            429, headers={"Retry-After": "7", "X-Up": "1"}, stream=httpx.ByteStream(body)
        )

    router, client = await proxy(cfg(), upstream)
    body = {"prompt": "x" * 50, "max_tokens": 3}
    r = await client.post("/v1/completions?x=1", json=body, headers={"Authorization": "Bearer k"})
    assert r.status_code == 429 and r.headers["retry-after"] == "7" and r.headers["x-up"] == "1"
    assert r.headers["x-appliance-pool"] == "long" and r.json()["error"]["code"] == 429
    assert str(seen[0].url) == "http://127.0.0.1:2/v1/completions?x=1"
    assert seen[0].headers["authorization"] == "Bearer k" and json.loads(seen[0].content) == body
    r = await client.get("/v1/models")
    assert r.headers["x-appliance-pool"] == "realtime"
    metrics = (await client.get("/metrics")).text
    assert 'appliance_router_requests_total{pool="long",reason="long",status="429"} 1.0' in metrics
    await router.close()


async def test_proxy_unreachable_pool_413_and_admin() -> None:
    def upstream(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    router, client = await proxy(cfg(max_request_body_bytes=100), upstream)
    r = await client.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 502 and "realtime" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", json={"prompt": "x" * 200})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert (await client.get("/admin/stats")).status_code == 404
    assert (await client.get("/health")).json() == {"status": "ok"}
    r = await client.get("/ready")
    assert r.status_code == 503 and r.json()["pools"]["realtime"] is False
    await router.close()


# ---------------------------------------------------------------------------------------------
# Real instances

LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the appliance keeps serving. " * 8
THRESHOLD = 64


@pytest.fixture(scope="module")
def pools(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    """Two instances of the tiny model under different names; the long one takes one running
    and one waiting request at most, and says Retry-After: 7 when full."""
    tmp = tmp_path_factory.mktemp("pools")
    short = ServerProcess(
        write_template(tmp / "short.toml", tiny_model_dir),
        tmp / "short.log",
        args=["--set", "model.name=short-pool"],
    )
    long = ServerProcess(
        write_template(
            tmp / "long.toml",
            tiny_model_dir,
            scheduler={"max_num_seqs": 1, "max_waiting_requests": 1},
        ),
        tmp / "long.log",
        args=[
            "--set",
            "model.name=long-pool",
            "--set",
            "server.retry_after_s=7",
            "--set",
            "model.max_model_len=4096",
        ],
    )
    procs = {"realtime": short, "long": long}
    try:
        for p in procs.values():
            p.start(wait_ready=False)
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():  # drain both at once
            if p.proc is not None and p.proc.poll() is None:
                p.signal(signal.SIGTERM)
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def router_url(
    pools: dict[str, ServerProcess], tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("router")
    port = free_port()
    conf = tmp / "router.toml"
    conf.write_text(
        f'[router]\nhost = "127.0.0.1"\nport = {port}\ndefault_pool = "realtime"\nlong_pool = "long"\n'
        f'long_prompt_tokens = {THRESHOLD}\ntokenizer = "{tiny_model_dir}"\n'
        f'[router.pools]\nrealtime = "{pools["realtime"].url}"\nlong = "{pools["long"].url}"\n'
        '[router.classes]\nbatch = "long"\n'
    )
    log = open(tmp / "router.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "appliance.cli", "route", "--config", str(conf)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120  # as ServerProcess: only a slow machine waits long
        while True:
            assert proc.poll() is None, (tmp / "router.log").read_text()
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp / "router.log").read_text()
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def complete(url: str, prompt: str, **kw: object) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"model": kw.pop("model", "x"), "prompt": prompt, "max_tokens": 4, **kw},
    )


@pytest.mark.slow
def test_short_and_long_prompts_land_on_different_instances(
    router_url: str, tiny_model_dir: Path
) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert len(tok.encode(LONG_PROMPT, add_special_tokens=False).ids) >= THRESHOLD
    models = httpx.get(router_url + "/v1/models", timeout=10).json()["data"]
    short = complete(router_url, "Hello there", model=models[0]["id"])
    assert short.status_code == 200, short.text
    assert (short.headers["x-appliance-pool"], short.json()["model"]) == ("realtime", "short-pool")
    # The model name is the long instance's own; the router does not rewrite bodies.
    long = complete(router_url, LONG_PROMPT, model="long-pool")
    assert long.status_code == 200, long.text
    assert (long.headers["x-appliance-pool"], long.json()["model"]) == ("long", "long-pool")
    assert (
        long.json()["usage"]["prompt_tokens"] >= THRESHOLD > short.json()["usage"]["prompt_tokens"]
    )
    batch = complete(router_url, "Hello there", model="long-pool", priority="batch")
    assert (batch.status_code, batch.headers["x-appliance-pool"]) == (200, "long")


@pytest.mark.slow
def test_streaming_flows_chunk_by_chunk(router_url: str) -> None:
    body = {
        "model": "short-pool",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream("POST", router_url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-appliance-pool"] == "realtime"
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert (
        sum(
            1
            for c in chunks
            if c["choices"] and c["choices"][0]["delta"].get("content") is not None
        )
        >= 2
    )


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def wait_until(pred: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_full_queue_429_passes_through_and_a_hangup_aborts_upstream(
    router_url: str, pools: dict[str, ServerProcess]
) -> None:
    long = pools["long"].url
    aborts0 = metric(long, "vllm:request_success_total", finished_reason="abort")
    # A holds the only running slot while B and C arrive: the long instance is paused from A's
    # first token until A is gone, so A cannot finish first however fast the machine.
    body = {
        "model": "long-pool",
        "prompt": "Once",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
        "priority": "batch",
    }
    waiting: list[httpx.Response] = []
    b = threading.Thread(
        target=lambda: waiting.append(complete(long, "Twice", model="long-pool", max_tokens=1))
    )
    try:
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", router_url + "/v1/completions", json=body) as a,
        ):
            assert a.status_code == 200 and a.headers["x-appliance-pool"] == "long"
            lines = a.iter_lines()  # (kept: a dropped iterator closes the connection)
            next(lines)  # A runs (max_num_seqs = 1) ...
            assert httpx.post(long + "/admin/pause", timeout=10).json() == {"paused": True}
            b.start()  # ... B waits (max_waiting_requests = 1) ...
            wait_until(lambda: metric(long, "vllm:num_requests_waiting") == 1)
            c = complete(router_url, LONG_PROMPT, model="long-pool")  # ... and C is refused.
            assert c.status_code == 429, c.text
            assert c.headers["retry-after"] == "7" and c.headers["x-appliance-pool"] == "long"
            assert c.json()["error"]["code"] in (429, "queue_full") or c.json()["error"]["type"]
        # A's client hung up mid-stream: the router closed the upstream stream, the instance
        # aborted A (still paused: A cannot have ended any other way).
        wait_until(
            lambda: (
                metric(long, "vllm:request_success_total", finished_reason="abort") == aborts0 + 1
            )
        )
    finally:
        httpx.post(long + "/admin/resume", timeout=10)
    b.join(30)
    assert waiting and waiting[0].status_code == 200


@pytest.mark.slow
def test_every_dashboard_metric_is_exported_by_a_live_server(
    pools: dict[str, ServerProcess],
) -> None:
    dash = json.loads((REPO / "templates/observability/grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    queried = {m for e in exprs for m in re.findall(r"\b((?:vllm:|appliance_)[a-zA-Z0-9_:]+)", e)}
    assert len(queried) >= 15
    exported: set[str] = set()
    for fam in text_string_to_metric_families(pools["realtime"].get("/metrics").text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(
            fam.type, [""]
        )
        exported |= {fam.name + s for s in suffixes}
    assert queried <= exported, sorted(queried - exported)


def test_the_router_reads_the_length_threshold_of_a_template() -> None:
    """One setting for the box's length class and the router's length routing."""
    from appliance.config import load_config

    pools = {"realtime": "http://127.0.0.1:1", "long": "http://127.0.0.1:2"}
    c = load_router_config(None, {"pools": pools, "long_pool": "long", "template": "cpu-demo"})
    assert c.long_prompt_tokens == load_config("cpu-demo").scheduler.long_prompt_tokens == 512
    # An explicit threshold still wins.
    c = load_router_config(
        None,
        {"pools": pools, "long_pool": "long", "template": "cpu-demo", "long_prompt_tokens": 99},
    )
    assert c.long_prompt_tokens == 99
    with pytest.raises(ConfigError, match="sets no scheduler.long_prompt_tokens"):
        load_router_config(None, {"pools": pools, "long_pool": "long", "template": "cpu-bench"})
