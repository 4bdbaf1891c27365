"""Ops and admin endpoints: /metrics parses and carries vLLM's names, /admin/stats decodes into
its documented schema, /admin/abort stops a request, and /admin/reload switches the running
configuration, refuses an invalid one without touching anything, and restores the previous
engine when a new one fails to start."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, wait_for, write_template

from appliance.server.admin_schema import AdminStats

MODEL = "tiny"

VLLM_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:iteration_tokens_total",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:cache_config_info",
    # Per-request histograms of vLLM's classic Grafana dashboard.
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_max_num_generation_tokens",
    # Old names that classic dashboards still query.
    "vllm:gpu_cache_usage_perc",
    "vllm:time_per_output_token_seconds",
    # The appliance's own.
    "appliance_kv_blocks",
    "appliance_batch_size",
    "appliance_preemptions",
    "appliance_requests_rejected",
]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("srv-ops")
    srv = ServerProcess(write_template(d / "t.toml", tiny_model_dir), d / "log.txt").start()
    yield srv
    assert srv.stop() == 0, srv.log()


def families(server: ServerProcess) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}


def test_metrics_parse_and_carry_every_name(server: ServerProcess) -> None:
    for _ in range(2):
        r = server.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "metrics please",
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200
    response = server.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(response.text)}
    missing = [n for n in VLLM_NAMES if n not in fams]
    assert not missing
    # Counters are registered without _total; the exposition appends it, as vLLM's does.
    assert fams["vllm:generation_tokens"].type == "counter"
    samples = {s.name: s for s in fams["vllm:generation_tokens"].samples}
    assert samples["vllm:generation_tokens_total"].value >= 10
    assert samples["vllm:generation_tokens_total"].labels == {"model_name": MODEL}
    ttft_count = next(
        s for s in fams["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")
    )
    assert ttft_count.value >= 2
    it = next(s for s in fams["vllm:iteration_tokens_total"].samples if s.name.endswith("_count"))
    assert it.value >= 10  # one observation per engine step
    info = fams["vllm:cache_config_info"].samples[0]
    assert info.labels["block_size"] == "16" and info.value == 1
    states = {s.labels["state"] for s in fams["appliance_kv_blocks"].samples}
    assert {"used", "cached", "free"} <= states
    success = {
        s.labels["finished_reason"]: s.value
        for s in fams["vllm:request_success"].samples
        if s.name.endswith("_total")
    }
    assert success["length"] >= 2

    def sample(family: str, suffix: str) -> object:
        return next(s for s in fams[family].samples if s.name == family + suffix)

    # The dashboard's queries: *_bucket for the token histograms, *_sum for the phases.
    for family in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert sample(family, "_bucket").labels["model_name"] == MODEL
    assert sample("vllm:request_generation_tokens", "_count").value >= 2
    assert sample("vllm:request_generation_tokens", "_sum").value >= 10  # 5 tokens each
    assert sample("vllm:request_max_num_generation_tokens", "_sum").value >= 10
    five = [
        s.value
        for s in fams["vllm:request_max_num_generation_tokens"].samples
        if s.name.endswith("_bucket") and s.labels["le"] == "5.0"
    ]
    assert five and five[0] >= 2  # both requests generated exactly 5, all at or below le=5
    assert sample("vllm:request_decode_time_seconds", "_sum").value > 0
    assert sample("vllm:request_prefill_time_seconds", "_sum").value > 0
    assert sample("vllm:request_prefill_time_seconds", "_count").value >= 2


def test_admin_stats_decodes_into_its_schema(server: ServerProcess) -> None:
    stop, first = threading.Event(), threading.Event()

    def stream() -> None:
        body = {
            "model": MODEL,
            "prompt": "busy",
            "max_tokens": 300,
            "stream": True,
            "ignore_eos": True,
            "priority": "batch",
        }
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", server.url + "/v1/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: "):
                    first.set()
                if stop.is_set():
                    return

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    # Paused from its first token on (not after a stats poll: 300 steps can pass quickly), the
    # request cannot finish before it is aborted, however fast the machine.
    assert first.wait(30)
    assert server.post("/admin/pause").json() == {"paused": True}
    stats = msgspec.json.decode(server.get("/admin/stats").content, type=AdminStats)
    assert stats.server.paused
    assert stats.model_name == MODEL and stats.max_model_len == 512
    assert stats.server.phase == "ready" and stats.server.ready_after_s is not None
    assert "core.load_weights" in stats.server.startup_phases
    # What the CPU backend detected and picked (appliance.cpu.backend), and why.
    assert stats.backend["cpu"]["isa"] in ("avx2", "avx512", "avx512-bf16", "amx", "sse")
    assert stats.backend["compute_dtype"] in ("float32", "bfloat16") and stats.backend["matmul"]
    # oneDNN's primitive caches bounded in the core and filled at load (cpu/primitive_cache).
    caches = stats.backend["primitive_caches"]
    assert caches["LRU_CACHE_CAPACITY"] == os.environ.get("LRU_CACHE_CAPACITY", "64")
    assert "core.warm_matmuls" in stats.server.startup_phases
    assert stats.engine is not None and stats.engine.num_blocks > 0
    live = stats.requests[0]
    assert live.priority_class == "batch" and live.priority == 10
    assert live.blocks_held > 0 and live.age_s >= 0 and live.status == "running"
    assert [q.priority_class for q in stats.queues] == ["realtime", "interactive", "batch"]
    assert stats.history and stats.history[-1].time <= stats.time
    assert stats.config.path.endswith("t.toml")
    # Abort it by its API id (all choices).
    api_id = live.request_id.rsplit("-", 1)[0]
    r = server.post(f"/admin/abort/{api_id}")
    assert r.status_code == 200 and r.json()["aborted"] == [live.request_id]
    t.join(30)
    assert not t.is_alive()
    assert server.post("/admin/abort/cmpl-nope").status_code == 404
    stop.set()
    assert server.post("/admin/resume").json() == {"paused": False}


def test_paused_engine_holds_requests_and_resumes_them(server: ServerProcess) -> None:
    assert server.post("/admin/pause").status_code == 200
    try:
        body = {
            "model": MODEL,
            "prompt": "held",
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(server.post, "/v1/completions", json=body)
            held = wait_for(lambda: server.get("/admin/stats").json()["requests"])
            time.sleep(0.5)  # several idle polls of the core loop: still nothing scheduled
            again = server.get("/admin/stats").json()["requests"]
            assert held[0]["status"] == again[0]["status"] == "waiting"
            assert again[0]["output_tokens"] == 0 and not fut.done()
            assert server.get("/ready").status_code == 200  # paused is not unready
            assert server.post("/admin/resume").json() == {"paused": False}
            r = fut.result(60)
    finally:
        server.post("/admin/resume")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert server.get("/admin/stats").json()["server"]["paused"] is False


def _config(server: ServerProcess) -> dict:
    r = server.get("/admin/config")
    assert r.status_code == 200
    return r.json()


def test_reload_invalid_changes_nothing_and_says_why(server: ServerProcess) -> None:
    before = _config(server)
    gen = server.get("/admin/stats").json()["server"]["engine_generation"]
    r = server.post("/admin/reload", json={"overrides": {"scheduler.max_num_seqs": 0}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "nothing changed" in err["message"] and "max_num_seqs" in err["message"]
    r = server.post("/admin/reload", json={"template": "no-such-template"})
    assert r.status_code == 400 and "no-such-template" in r.json()["error"]["message"]
    r = server.post("/admin/reload", json={"overrides": {"cache.no_such_key": 1}})
    assert r.status_code == 400 and "no_such_key" in r.json()["error"]["message"]
    assert _config(server) == before
    assert server.get("/admin/stats").json()["server"]["engine_generation"] == gen


def test_reload_valid_switches_the_config(server: ServerProcess) -> None:
    r = server.post("/admin/reload", json={"overrides": {"scheduler.max_num_seqs": 8}})
    assert r.status_code == 200, r.text
    assert r.json()["ok"] is True
    cfg = _config(server)
    assert cfg["config"]["scheduler"]["max_num_seqs"] == 8
    # The start-up server.* overrides (here --port) stay pinned across reloads.
    assert cfg["overrides"]["scheduler.max_num_seqs"] == 8
    assert server.get("/ready").status_code == 200
    out = server.post(
        "/v1/completions", json={"model": MODEL, "prompt": "after reload", "max_tokens": 3}
    )
    assert out.status_code == 200


def test_reload_that_fails_to_start_restores_the_previous_engine(server: ServerProcess) -> None:
    before = _config(server)
    # Valid as a template, but the engine cannot start: one block cannot hold a sequence.
    r = server.post("/admin/reload", json={"overrides": {"cache.num_blocks": 1}})
    assert r.status_code == 500
    msg = r.json()["error"]["message"]
    assert "restored" in msg and "num_blocks" in msg or "blocks" in msg
    assert _config(server) == before
    assert server.get("/ready").status_code == 200
    stats = server.get("/admin/stats").json()
    assert stats["server"]["last_reload"]["ok"] is False
    out = server.post(
        "/v1/completions", json={"model": MODEL, "prompt": "still serving", "max_tokens": 3}
    )
    assert out.status_code == 200


def test_reload_keeps_the_startup_api_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A unit passes its key files with --set; a template applied from the console must not
    drop them and leave /v1/* open."""
    key = tmp_path / "api.key"
    key.write_text("sk-pinned\n")
    other = write_template(tmp_path / "other.toml", tiny_model_dir, scheduler={"max_num_seqs": 4})
    srv = ServerProcess(
        write_template(tmp_path / "t.toml", tiny_model_dir),
        tmp_path / "log.txt",
        args=["--set", f"server.api_key_file={key}"],
    ).start()
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert srv.post("/v1/completions", json=body).status_code == 401
        r = srv.post("/admin/reload", json={"template": str(other)})
        assert r.status_code == 200, r.text
        assert _config(srv)["config"]["scheduler"]["max_num_seqs"] == 4
        assert srv.post("/v1/completions", json=body).status_code == 401
        ok = srv.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-pinned"})
        assert ok.status_code == 200, ok.text
    finally:
        assert srv.stop() == 0, srv.log()
