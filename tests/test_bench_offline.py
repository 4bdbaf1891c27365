"""`appliance bench offline --json` on the tiny model: every mode produces every token, stays
under its roofline bound, and reports whether the native CPU decode ran."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from appliance.kernels import cpu_native

from appliance.cli import main


def test_offline_bench_json(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "bench",
            "offline",
            "--model",
            str(tiny_model_dir),
            "--num-requests",
            "5",
            "--prompt-len",
            "20",
            "--output-len",
            "6",
            "--static-batch",
            "2",
            "--json",
            "--set",
            "cache.kv_cache_memory=0.1",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["native_cpu_decode"] == (cpu_native.load() is not None)
    modes = {r["mode"]: r for r in report["results"]}
    assert set(modes) == {"one-at-a-time", "static", "continuous"}
    for r in modes.values():
        assert r["output_tokens"] == 5 * 6
        assert 0 < r["share_of_bound"] <= 1.0, r
        assert r["output_tokens_per_s"] <= r["bound_tokens_per_s"]
    assert modes["one-at-a-time"]["mean_batch"] == 1.0
    assert modes["static"]["peak_running"] == 2


def test_structured_bench_json(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "bench",
            "offline",
            "--model",
            str(tiny_model_dir),
            "--num-requests",
            "4",
            "--prompt-len",
            "20",
            "--output-len",
            "6",
            "--structured",
            "json-schema",
            "--json",
            "--structured-rounds",
            "1",
            "--set",
            "cache.kv_cache_memory=0.1",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["batch"] for r in report["throughput"]] == [1, 4]
    assert all(r["plain_tok_s"] > 0 and r["schema_tok_s"] > 0 for r in report["throughput"])
    first, cached = report["first_token"][1:]
    # A cached schema skips the compile: its lookup is far below a fresh compile.
    assert cached["compile_ms"] < first["compile_ms"]


# The mixed profile at toy sizes: a few seconds on the tiny model, every scheduling mix runs,
# and a pool of 1.5 long requests makes the runs preempt (recomputed or swapped requests).
MIXED_SMALL = [
    "--profile",
    "mixed",
    "--num-requests",
    "8",
    "--rate",
    "200",
    "--realtime-share",
    "0.5",
    "--realtime-prompt-len",
    "16",
    "--realtime-max-tokens",
    "8",
    "--batch-prompt-len",
    "96",
    "--batch-output-len",
    "16",
    "--pool-long-requests",
    "1.5",
    "--seed",
    "1",
]


def test_mixed_profile_json(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "offline", "--model", str(tiny_model_dir), *MIXED_SMALL, "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["profile"] == "mixed"
    runs = {(r["preemption_mode"], r["policy"]) for r in report["results"]}
    assert runs == {(m, p) for m in ("recompute", "swap") for p in ("fcfs", "priority")}
    for r in report["results"]:
        assert r["realtime_requests"] >= 1, r
        # Every real-time request's TTFT comes from the engine's outputs, none is left out.
        assert r["realtime_ttft_measured"] == r["realtime_requests"], r
        assert 0 < r["realtime_ttft_p50_s"] <= r["realtime_ttft_p99_s"] < 60, r
        assert math.isfinite(r["realtime_e2e_p99_s"]) and math.isfinite(r["batch_e2e_p50_s"]), r
        assert r["output_tokens_per_s"] > 0, r


def test_mixed_profile_table(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI's table, as an operator runs it (no --json)."""
    rc = main(["bench", "offline", "--model", str(tiny_model_dir), *MIXED_SMALL])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln.split() for ln in lines if ln.startswith(("recompute ", "swap "))]
    assert len(rows) == 4, lines
    for row in rows:
        measured, added = row[2].split("/")
        assert measured == added != "0", row
        assert all(math.isfinite(float(v.rstrip("s"))) for v in row[3:7]), row
        assert float(row[7]) > 0, row  # output tok/s
