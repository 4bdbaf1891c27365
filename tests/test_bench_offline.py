"""`appliance bench offline --json` on the tiny model: every mode produces every token, stays
under its roofline bound, and reports whether the native CPU decode ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from appliance.kernels import cpu_native

from appliance.cli import main


def test_offline_bench_json(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([
        "bench", "offline", "--model", str(tiny_model_dir), "--num-requests", "5",
        "--prompt-len", "20", "--output-len", "6", "--static-batch", "2", "--json",
        "--set", "cache.kv_cache_memory=0.1",
    ])  # fmt: skip
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
    rc = main([
        "bench", "offline", "--model", str(tiny_model_dir), "--num-requests", "4",
        "--prompt-len", "20", "--output-len", "6", "--structured", "json-schema", "--json",
        "--structured-rounds", "1", "--set", "cache.kv_cache_memory=0.1",
    ])  # fmt: skip
    assert rc == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["batch"] for r in report["throughput"]] == [1, 4]
    assert all(r["plain_tok_s"] > 0 and r["schema_tok_s"] > 0 for r in report["throughput"])
    first, cached = report["first_token"][1:]
    # A cached schema skips the compile: its lookup is far below a fresh compile.
    assert cached["compile_ms"] < first["compile_ms"]
