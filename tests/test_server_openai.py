"""The official openai SDK (sync and async) against a real `appliance up` on 127.0.0.1 with the
tiny demo model: completions and chat, streaming and not, n=2, stop strings, seeds, logprobs,
usage in the last stream chunk, models.list(), tokenize/detokenize, and a client that
disconnects mid-stream freeing its KV blocks."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, wait_for, write_template

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("srv-openai")
    srv = ServerProcess(write_template(d / "t.toml", tiny_model_dir), d / "log.txt").start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_greedy_is_deterministic(client: openai.OpenAI) -> None:
    kw = dict(
        model=MODEL,
        prompt="The appliance",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text
    assert a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 12
    assert a.usage.total_tokens == a.usage.prompt_tokens + 12


def test_completion_token_prompt_and_batch(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.prompt_tokens == 5


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kw = dict(
        model=MODEL,
        prompt="Hello world",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_n2_with_seed_is_reproducible_and_distinct(client: openai.OpenAI) -> None:
    kw = dict(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=10,
        temperature=1.0,
        seed=1234,
        n=2,
        extra_body={"ignore_eos": True},
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # seeds differ per choice
    assert a.usage.completion_tokens == 20


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    base = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    stop = text[5:8]
    assert stop.strip(), text
    out = client.completions.create(
        model=MODEL,
        prompt="abc",
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(
        model=MODEL,
        prompt="abc",
        max_tokens=24,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert val <= 0.0
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(val, abs=1e-4)
        assert tok in top
    assert "".join(lp.tokens) == out.choices[0].text


def test_chat_non_stream_and_stream(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    full = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_logprobs_and_priority(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"priority": "batch", "top_k": 5, "ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)


async def test_async_sdk_concurrent_streams(aclient: openai.AsyncOpenAI) -> None:
    import asyncio

    async def one(i: int) -> tuple[str, int]:
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"number {i}"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage

    results = await asyncio.gather(*(one(i) for i in range(6)))
    assert all(u == 8 and t for t, u in results)
    out = await aclient.completions.create(model=MODEL, prompt="async", max_tokens=3, temperature=0)
    assert out.choices[0].text is not None
    await aclient.close()


def test_tokenize_detokenize_roundtrip(server: ServerProcess) -> None:
    r = server.post("/tokenize", json={"prompt": "hello appliance", "add_special_tokens": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    back = server.post("/detokenize", json={"tokens": body["tokens"]}).json()
    assert back["prompt"] == "hello appliance"
    chat = server.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > body["count"] - 2


def _blocks_used(server: ServerProcess) -> int:
    return server.get("/admin/stats").json()["engine"]["blocks_used"]


def test_disconnect_mid_stream_frees_blocks(server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "prompt": "long " * 40,
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        # Paused, the request is still in flight when the client goes, however fast the machine.
        assert server.post("/admin/pause").status_code == 200
        stats = server.get("/admin/stats").json()
        live = [q for q in stats["requests"] if q["request_id"].startswith(rid)]
        assert live and live[0]["blocks_held"] > 0
    try:
        # The connection is closed: the server aborts the request and frees its blocks.
        wait_for(lambda: not server.get("/admin/stats").json()["requests"], timeout_s=10)
        assert _blocks_used(server) == 0
    finally:
        server.post("/admin/resume")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(server.get("/metrics").text)
        for s in fam.samples
    }
    assert samples[("appliance_kv_blocks", (("model_name", MODEL), ("state", "used")))] == 0
    assert (
        samples[
            ("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", MODEL)))
        ]
        >= 1
    )


def test_disconnect_while_waiting_for_a_full_answer_aborts(server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "prompt": "slow",
        "max_tokens": 450,
        "temperature": 0,
        "ignore_eos": True,
    }
    # Paused, the answer cannot be complete before the client gives up, however fast the machine.
    assert server.post("/admin/pause").status_code == 200
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5)
            )
        wait_for(lambda: not server.get("/admin/stats").json()["requests"], timeout_s=10)
        assert _blocks_used(server) == 0
    finally:
        server.post("/admin/resume")


# Last in the module: an engine error here kills the core (fatal by design, as in vLLM v1),
# which would fail every later test of this module's server.


def test_min_tokens_extra(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="x", max_tokens=6, temperature=0, extra_body={"min_tokens": 6}
    )
    assert out.usage.completion_tokens == 6  # min_tokens == max_tokens: EOS is banned
