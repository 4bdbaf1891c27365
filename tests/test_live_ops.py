"""Operations smaller than a template apply, against a real `appliance up`: live knobs land at a
step boundary while requests run (none lost or restarted, the next step under the new limit),
refusals change nothing and name the key, one priority class pauses and resumes while another
is served, and every action is in the audit log under its actor."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, wait_for, write_template

from appliance.config import load_config
from appliance.tools.inspection import InspectOptions, Inspector, format_table, inspect_and_record

MODEL = "tiny"


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("live-state")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, state_dir: Path):
    d = tmp_path_factory.mktemp("srv-live")
    template = write_template(
        d / "t.toml",
        tiny_model_dir,
        extra=f'[server]\nstate_dir = "{state_dir}"\n',
        scheduler={"max_num_seqs": 4},
    )
    # Steps slow enough for a change to land while requests are mid-way (fault injection).
    env = {"APPLIANCE_TEST_STEP_DELAY_S": "0.05"}
    srv = ServerProcess(template, d / "log.txt", env=env).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def patch(server: ServerProcess, body: Any, **kw: Any) -> httpx.Response:
    return httpx.patch(server.url + "/admin/config", json=body, timeout=30, **kw)


def completion(
    server: ServerProcess, max_tokens: int, priority: str | None = None
) -> httpx.Response:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": "live knobs",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if priority is not None:
        body["priority"] = priority
    return server.post("/v1/completions", json=body)


def scheduler_config(server: ServerProcess) -> dict[str, Any]:
    return server.get("/admin/config").json()["config"]["scheduler"]


def steps_after(server: ServerProcess, step: int) -> list[dict[str, Any]]:
    history = server.get("/admin/stats", params={"history_s": 600}).json()["history"]
    return [r for r in history if r["step"] > step]


def test_raised_max_num_seqs_lands_at_the_next_step(server: ServerProcess) -> None:
    r = patch(server, {"scheduler": {"max_num_seqs": 1}})
    assert r.status_code == 200, r.text
    assert r.json()["changed"] == [{"key": "scheduler.max_num_seqs", "before": 4, "after": 1}]
    preempted_before = server.get("/admin/stats").json()["engine"]["counters"]["preemptions"]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(completion, server, 24) for _ in range(4)]
        # One request at a time, the others queued.
        wait_for(
            lambda: (
                steps_after(server, 0)
                and server.get("/admin/stats").json()["engine"]["num_waiting"] == 3
            )
        )
        r = patch(server, {"scheduler": {"max_num_seqs": 4}})
        assert r.status_code == 200, r.text
        step = r.json()["applied_after_step"]
        results = [f.result(120) for f in futures]
    # None lost, none cut short, none restarted.
    assert [x.status_code for x in results] == [200] * 4
    assert [x.json()["usage"]["completion_tokens"] for x in results] == [24] * 4
    history = server.get("/admin/stats", params={"history_s": 600}).json()["history"]
    before = [h["num_seqs"] for h in history if h["step"] <= step and h["num_seqs"]]
    after = [h for h in history if h["step"] == step + 1]
    assert before and max(before[-3:]) == 1  # the old limit held up to the change
    assert after and after[0]["num_seqs"] == 4  # the very next step admitted the queue
    assert (
        server.get("/admin/stats").json()["engine"]["counters"]["preemptions"] == preempted_before
    )
    assert scheduler_config(server)["max_num_seqs"] == 4


@pytest.mark.parametrize(
    ("body", "status", "key"),
    [
        ({"scheduler": {"max_num_seqs": 0}}, 400, "scheduler.max_num_seqs"),
        ({"scheduler": {"max_num_seqs": "8"}}, 400, "scheduler.max_num_seqs"),
        ({"scheduler": {"preemption_threshold": 1.5}}, 400, "scheduler.preemption_threshold"),
        ({"scheduler": {"max_num_seq": 2}}, 400, "scheduler.max_num_seq"),
        (
            {"priority_classes": {"batch": {"queue_timeout_s": -1}}},
            400,
            "priority_classes.batch.queue_timeout_s",
        ),  # fmt: skip
        (
            {"priority_classes": {"nightly": {"queue_timeout_s": 1}}},
            400,
            "priority_classes.nightly",
        ),  # fmt: skip
        (
            {"scheduler": {"long_prefill_token_threshold": 4096}},
            400,
            "scheduler.long_prefill_token_threshold",
        ),  # fmt: skip
        (
            {"priority_classes": {"batch": {"tpot_ceiling_ms": 0.5}}},
            400,
            "priority_classes.batch.tpot_ceiling_ms",
        ),  # fmt: skip (a ceiling below the class's TPOT target, or without one)
        ({"cache": {"num_blocks": 8}}, 409, "cache.num_blocks"),
        ({"model": {"dtype": "bfloat16"}}, 409, "model.dtype"),
        ({"scheduler": {"policy": "priority"}}, 409, "scheduler.policy"),
        ({"priority_classes": {"batch": {"priority": 1}}}, 409, "priority_classes.batch.priority"),
        # Above what the engine was built with (its profile was sized for 4).
        ({"scheduler": {"max_num_seqs": 64}}, 409, "scheduler.max_num_seqs"),
    ],
)
def test_refused_change_names_the_key_and_changes_nothing(
    server: ServerProcess, body: dict[str, Any], status: int, key: str
) -> None:
    before = server.get("/admin/config").json()
    # A valid knob beside the bad one must not land either.
    body = {**body, "scheduler": {"max_waiting_requests": 7, **body.get("scheduler", {})}}
    r = patch(server, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == key and key in error["message"]
    if status == 409:
        assert error["code"] == "reload_required" and "/admin/reload" in error["message"]
    assert server.get("/admin/config").json() == before


def test_class_pause_holds_its_queue_while_another_class_runs(server: ServerProcess) -> None:
    assert server.post("/admin/classes/nightly/pause").status_code == 404
    with ThreadPoolExecutor(2) as pool:
        r = server.post("/admin/classes/batch/pause")
        assert r.status_code == 200 and r.json()["state"] == "paused"
        refused = completion(server, 4, "batch")
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "class_paused"
        assert refused.headers["Retry-After"]
        # The other classes are served while batch is paused.
        assert completion(server, 4, "interactive").status_code == 200
        metrics = {
            (s.labels["class"], s.labels["mode"]): s.value
            for f in text_string_to_metric_families(server.get("/metrics").text)
            if f.name == "appliance_class_paused"
            for s in f.samples
        }
        assert metrics[("batch", "paused")] == 1 and metrics[("interactive", "paused")] == 0
        assert server.post("/admin/resume").status_code == 200  # (the engine-wide lever)
    # A request queued before the pause waits in the queue, then runs on resume.
    server.post("/admin/classes/batch/resume")
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(completion, server, 40, "batch")
        wait_for(lambda: server.get("/admin/stats").json()["requests"])
        paused = server.post("/admin/classes/batch/pause").json()
        assert paused["classes"]["batch"] == "paused"
        queued = pool.submit(completion, server, 4, "batch")  # refused at the door
        assert queued.result(30).status_code == 503
        r = server.post("/admin/classes/batch/resume")
        assert r.json()["classes"] == {
            "realtime": "serving",
            "interactive": "serving",
            "batch": "serving",
        }
        assert slow.result(120).status_code == 200
    assert completion(server, 4, "batch").status_code == 200


def test_paused_class_queue_waits_and_drain_serves_it(server: ServerProcess) -> None:
    # max_num_seqs 1: the second batch request waits in the queue behind the first.
    assert patch(server, {"scheduler": {"max_num_seqs": 1}}).status_code == 200
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(completion, server, 30, "batch")
            wait_for(lambda: server.get("/admin/stats").json()["engine"]["num_running"] == 1)
            second = pool.submit(completion, server, 4, "batch")
            wait_for(lambda: server.get("/admin/stats").json()["engine"]["num_waiting"] == 1)
            assert server.post("/admin/classes/batch/pause").status_code == 200
            assert first.result(120).status_code == 200  # running work finishes
            time.sleep(0.5)  # several steps' worth: the queued one is held, not admitted
            waiting = server.get("/admin/stats").json()["requests"]
            assert [w["status"] for w in waiting] == ["waiting"] and not second.done()
            r = server.post("/admin/classes/batch/pause", params={"drain": "true"})
            assert r.json()["state"] == "draining"
            assert second.result(60).status_code == 200  # draining: the queue is served
            assert completion(server, 4, "batch").status_code == 503  # new ones still refused
    finally:
        server.post("/admin/classes/batch/resume")
        patch(server, {"scheduler": {"max_num_seqs": 4}})


def test_audit_log_records_each_action_with_its_actor(
    server: ServerProcess, state_dir: Path
) -> None:
    since = time.time()
    assert (
        patch(
            server,
            {"scheduler": {"queue_timeout_s": 30}},
            headers={"X-Appliance-Client": "console"},
        ).status_code
        == 200
    )
    assert patch(server, {"cache": {"num_blocks": 8}}).status_code == 409
    server.post("/admin/classes/batch/pause")
    server.post("/admin/classes/batch/resume")
    records = server.get("/admin/audit", params={"since": since}).json()["records"]
    got = [(r["action"], r["actor"], r["outcome"]) for r in records]
    assert got == [
        ("knob_change", "console", "ok"),
        ("knob_change", "local", "refused"),
        ("class_pause", "local", "ok"),
        ("class_resume", "local", "ok"),
    ]
    assert records[0]["diff"] == [
        {"key": "scheduler.queue_timeout_s", "before": 0.0, "after": 30.0}
    ]
    assert "cache.num_blocks" in records[1]["error"]
    assert all(r["duration_s"] is not None and r["duration_s"] >= 0 for r in records)
    path = state_dir / "audit.jsonl"
    assert oct(os.stat(path).st_mode & 0o777) == "0o640"
    patch(server, {"scheduler": {"queue_timeout_s": 0}})


def test_audit_log_survives_a_restart_and_a_kill_mid_apply_shows(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    template = write_template(
        tmp_path / "t.toml", tiny_model_dir, extra=f'[server]\nstate_dir = "{state}"\n'
    )
    srv = ServerProcess(template, tmp_path / "log1.txt").start()
    try:
        knob = {"scheduler": {"max_num_seqs": 8}}
        r = httpx.patch(
            srv.url + "/admin/config", json=knob, headers={"X-Appliance-Client": "console"}
        )
        assert r.status_code == 200, r.text
        # A template apply, killed (as by the OOM killer) while its new engine starts: the
        # successful apply's record is the console tests' (test_console.py, apply and roll back).
        with ThreadPoolExecutor(1) as pool:
            apply = {"template": str(template), "overrides": {"scheduler.max_num_seqs": 4}}
            fut = pool.submit(srv.post, "/admin/reload", json=apply)
            wait_for(lambda: "template_apply" in (state / "audit.jsonl").read_text())
            assert srv.proc is not None
            srv.proc.kill()
            srv.proc.wait(30)
            with contextlib.suppress(httpx.HTTPError):
                fut.result(30)
    finally:
        srv.stop()
    srv = ServerProcess(template, tmp_path / "log2.txt").start()
    try:
        records = srv.get("/admin/audit").json()["records"]
    finally:
        assert srv.stop() == 0, srv.log()
    assert [(r["action"], r["actor"], r["outcome"]) for r in records] == [
        ("knob_change", "console", "ok"),
        ("template_apply", "local", None),  # started, never ended: the kill
    ]
    assert records[0]["diff"] == [{"key": "scheduler.max_num_seqs", "before": 16, "after": 8}]
    # The stop of the second server is recorded too (its drain, by a signal).
    lines = (state / "audit.jsonl").read_text().splitlines()
    assert '"action":"drain"' in lines[-1] and '"event":"ok"' in lines[-1]


def test_inspect_passes_and_fails_when_a_check_is_broken_on_purpose(
    server: ServerProcess, state_dir: Path
) -> None:
    opts = InspectOptions(url=server.url, probe=4, probe_concurrency=2, max_ttft_s=60.0)
    results, ok = inspect_and_record(opts, "tester")
    assert ok, format_table(results)
    assert {r.name: r.status for r in results} == {
        "chat": "pass",
        "kv_usage": "pass",
        "preemption_rate": "pass",
        "kv_quantization": "skip",  # a 16-bit cache
        "ttft_p99": "pass",
    }
    # Broken on purpose: the default class paused, so nothing of it is answered.
    server.post("/admin/classes/interactive/pause")
    try:
        results, ok = inspect_and_record(opts, "tester")
    finally:
        server.post("/admin/classes/interactive/resume")
    failed = [r.name for r in results if r.status == "fail"]
    assert not ok and failed == ["chat", "ttft_p99"]
    assert "class_paused" in results[0].detail
    # One limit alone, through the command: a TTFT target no server meets; exit status 1.
    proc = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "inspect", "--url", server.url,
         "--probe", "2", "--max-ttft-s", "0.000001", "--actor", "tester"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {line.split()[0]: line.split()[1] for line in proc.stdout.splitlines()[2:7]}
    assert rows == {
        "chat": "PASS",
        "kv_usage": "PASS",
        "preemption_rate": "PASS",
        "kv_quantization": "SKIP",
        "ttft_p99": "FAIL",
    }
    records = server.get("/admin/audit").json()["records"]
    inspections = [r for r in records if r["action"] == "inspect"]
    assert [(r["actor"], r["outcome"]) for r in inspections] == [
        ("tester", "ok"),
        ("tester", "failed"),
        ("tester", "failed"),
    ]
    assert inspections[-1]["error"] == "failed: ttft_p99"
    assert [c["name"] for c in inspections[-1]["what"]["checks"]][-1] == "ttft_p99"


@pytest.mark.parametrize(
    ("stored", "keep", "status"),
    [
        ({"kv_cache_dtype": "int8", "top1": 0.97}, [], "pass"),
        ({"kv_cache_dtype": "int8", "top1": 0.60}, [], "fail"),  # a regression
        ({"kv_cache_dtype": "fp8_e4m3", "top1": 0.99}, [], "fail"),  # evaluated another format
        ({"kv_cache_dtype": "int8", "top1": 0.99}, [0], "fail"),  # evaluated another keep-list
        (None, [], "skip"),
    ],
)
def test_inspect_kv_quantization_reads_the_stored_kv_eval(
    tmp_path: Path, stored: dict[str, Any] | None, keep: list[int], status: str
) -> None:
    if stored is not None:
        score = {"kl": 1e-3, "top1_agreement": stored["top1"]}
        report = {"kv_cache_dtype": stored["kv_cache_dtype"], "keep_16bit": [1],
                  "all_quantized": score, "with_keep_list": score}  # fmt: skip
        (tmp_path / "kv-eval.json").write_text(json.dumps(report))
    config = load_config(None, {"cache.kv_cache_dtype": "int8", "cache.kv_cache_keep_16bit": keep})
    result = Inspector(InspectOptions(url="http://unused")).kv_quantization(config, tmp_path)
    assert result.status == status, result
