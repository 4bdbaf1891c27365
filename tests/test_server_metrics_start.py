"""Every series the shipped Grafana dashboard queries is on /metrics as soon as the server is
ready, before any request (at zero, as vLLM exports them), so a new dashboard draws flat lines
instead of "No data"; and the first request only moves values, never adds or lowers a series."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, write_template

MODEL = "tiny"
DASHBOARD = Path(__file__).parent.parent / "templates/observability/grafana-dashboard.json"
METRIC = re.compile(r"\b((?:vllm:|appliance_)[A-Za-z0-9_:]+)")
# `sum by (pool, finished_reason) (...)`: the labels a panel groups by must be on the series.
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")
# Labels Prometheus adds itself: `pool` from the scrape target (prometheus.yml), `le` only on
# _bucket samples.
NOT_EXPORTED = {"pool", "le"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets (rows nest panels) and the
    template variables' queries."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "definition") and isinstance(value, str):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(json.loads(DASHBOARD.read_text()))
    return found


def queried_series() -> dict[str, set[str]]:
    """Sample name the dashboard queries -> the labels its expressions group by."""
    out: dict[str, set[str]] = {}
    for expr in dashboard_queries():
        by = {label.strip() for g in GROUPING.findall(expr) for label in g.split(",")}
        for name in METRIC.findall(expr):
            out.setdefault(name, set()).update(by - NOT_EXPORTED - {""})
    return out


def scrape(server: ServerProcess) -> tuple[dict[str, str], Series]:
    """(sample name -> family type, every sample's value by name and labels); the _created
    timestamps prometheus_client adds are left out (not values)."""
    types: dict[str, str] = {}
    series: Series = {}
    for fam in text_string_to_metric_families(server.get("/metrics").text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            types[s.name] = fam.type
            series[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, series


def labels_of(series: Series, name: str) -> list[dict[str, str]]:
    return [dict(labels) for (n, labels) in series if n == name]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("srv-metrics-start")
    srv = ServerProcess(write_template(d / "t.toml", tiny_model_dir), d / "log.txt").start()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_every_dashboard_series_exists_at_zero_before_any_request(server: ServerProcess) -> None:
    queried = queried_series()
    assert len(queried) >= 15, sorted(queried)  # the parse found the dashboard's queries
    types, series = scrape(server)
    missing = sorted(name for name in queried if not labels_of(series, name))
    assert not missing, f"{len(missing)} of {len(queried)} dashboard series missing: {missing}"
    for name, grouped_by in queried.items():
        for labels in labels_of(series, name):
            assert labels.get("model_name") == MODEL, (name, labels)
            assert grouped_by <= labels.keys(), (name, grouped_by, labels)
        # A histogram's quantiles need its whole family; a counter is queried by its _total.
        base = next((name[: -len(s)] for s in HISTOGRAM_SUFFIXES if name.endswith(s)), None)
        if base is not None and types[name] == "histogram":
            assert all(labels_of(series, base + s) for s in HISTOGRAM_SUFFIXES), name
        if name.endswith("_total") and types[name] == "counter":
            assert labels_of(series, name), name

    # Nothing has happened yet: every counter and histogram is at zero, no request is counted.
    moved = {
        key: v for key, v in series.items() if types[key[0]] in ("counter", "histogram") and v != 0
    }
    assert not moved, moved
    for gauge in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "appliance_num_requests_swapped",
        "vllm:kv_cache_usage_perc",
    ):
        assert [v for (n, _), v in series.items() if n == gauge] == [0.0], gauge

    # The label values vLLM pre-creates (one series per finish reason), and the appliance's
    # per-mode and per-class series for the template's classes (the defaults).
    reasons = {d["finished_reason"] for d in labels_of(series, "vllm:request_success_total")}
    assert {"stop", "length", "abort", "error"} <= reasons
    preempt = {
        (d["mode"], d["priority_class"]) for d in labels_of(series, "appliance_preemptions_total")
    }
    classes = {"realtime", "interactive", "batch"}
    assert preempt == {(m, c) for m in ("recompute", "swap") for c in classes}
    rejected = labels_of(series, "appliance_requests_rejected_total")
    assert {d["priority_class"] for d in rejected} == classes
    assert {d["reason"] for d in rejected} >= {"queue_full", "queue_timeout"}


def test_counters_stay_monotonic_through_the_first_request(server: ServerProcess) -> None:
    types, before = scrape(server)
    r = server.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    _, after = scrape(server)
    # No series disappears; no counter or histogram sample goes down.
    assert before.keys() <= after.keys(), sorted(set(before) - set(after))
    for key, value in before.items():
        if types[key[0]] in ("counter", "histogram"):
            assert after[key] >= value, (key, value, after[key])

    def value(name: str, **labels: str) -> float:
        return after[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]

    # The request moved the series it should, from the zero they started at.
    assert value("vllm:request_success_total", finished_reason="length") == 1
    assert value("vllm:request_success_total", finished_reason="stop") == 0
    assert value("vllm:generation_tokens_total") == 4
    assert value("vllm:time_to_first_token_seconds_count") == 1
    assert value("vllm:e2e_request_latency_seconds_count") == 1
