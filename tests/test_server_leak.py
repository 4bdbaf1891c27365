"""Per-request state does not outlive its request: 2,000 served requests that ask for logprobs
(some streamed, some ended by a stop string, some abandoned mid-stream) leave no request, no
engine output and no logprob alive in the engine process, and no output state in the API."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest
from server_harness import ServerProcess, wait_for, write_template

NUM_REQUESTS = 2000
CONCURRENCY = 32


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("srv-leak")
    srv = ServerProcess(write_template(d / "t.toml", tiny_model_dir), d / "log.txt").start()
    yield srv
    assert srv.stop() == 0, srv.log()


async def _one(http: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    body: dict[str, object] = {
        "model": "tiny",
        "prompt": [rng.randrange(5, 4000) for _ in range(rng.randrange(3, 40))],
        "max_tokens": rng.randrange(1, 6),
        "temperature": 1.0,
        "seed": i,
        "logprobs": 2,
    }
    if i % 3 == 1:
        body["stop"] = ["e", "a", " "]
    if i % 10 == 2:  # streamed; every other one abandoned after its first chunk
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data:") and i % 20 == 2:
                    return "abandoned"
        return "streamed"
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["finish_reason"]


async def _serve_all(url: str) -> dict[str, int]:
    rng = random.Random(0)
    sem = asyncio.Semaphore(CONCURRENCY)
    counts: dict[str, int] = {}

    async def run(i: int, http: httpx.AsyncClient) -> None:
        async with sem:
            kind = await _one(http, i, rng)
            counts[kind] = counts.get(kind, 0) + 1

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await asyncio.gather(*(run(i, http) for i in range(NUM_REQUESTS)))
    return counts


@pytest.mark.slow
def test_served_logprob_requests_leave_no_state_behind(server: ServerProcess) -> None:
    counts = asyncio.run(_serve_all(server.url))
    assert sum(counts.values()) == NUM_REQUESTS
    assert counts.get("stop", 0) > 100 and counts.get("length", 0) > 100 and counts["abandoned"] > 0

    def idle() -> dict | None:
        stats = httpx.get(server.url + "/admin/stats", params={"count_objects": "true"}).json()
        engine = stats["engine"]
        busy = engine["num_running"] + engine["num_waiting"] + engine["num_swapped"]
        return None if busy or stats["server"]["requests_in_flight"] else stats

    stats = wait_for(idle, timeout_s=30)
    assert stats["engine_objects"] == {"Request": 0, "EngineOutput": 0, "Logprob": 0}
    assert stats["server"]["requests_tracked"] == 0
    assert stats["requests"] == [] and stats["engine"]["blocks_used"] == 0
    finished = stats["engine"]["requests_finished"]
    assert sum(finished.values()) == NUM_REQUESTS  # each finished once in the engine
