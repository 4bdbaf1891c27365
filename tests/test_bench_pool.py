"""`appliance bench pool`: goodput pooled over `bench serve --json-out` reports of several
seeds per server (good requests over the runs' total seconds), the ratio to a baseline, and the
errors for reports that cannot be compared."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from appliance.bench import pool as bench_pool
from appliance.bench import serve as bench_serve

SLO_PER_KIND = {
    "short": {"ttft_ms": 1000.0, "tpot_ms": 100.0, "e2e_ms": None},
    "long": {"ttft_ms": 10000.0, "tpot_ms": 200.0, "e2e_ms": None},
}


def counts(requests: int, good: int, seconds: float) -> dict[str, Any]:
    return {"requests": requests, "ok": requests, "good": good, "seconds": seconds}


def report(seed: int, seconds: float, short: tuple[int, int], long: tuple[int, int]) -> dict:
    """A report as `bench serve --json-out` writes it, with the fields pooling reads (and one
    it ignores); `short`/`long`: (requests, good)."""
    return {
        "source": "http://127.0.0.1:8000",
        "profile": "mixed",
        "arrival": "poisson",
        "rate": 1.25,
        "num_requests": short[0] + long[0],
        "seed": seed,
        "slo": {"ttft_ms": None, "tpot_ms": None, "e2e_ms": None},
        "slo_per_kind": SLO_PER_KIND,
        "summary": counts(short[0] + long[0], short[1] + long[1], seconds),
        "per_kind": {"short": counts(*short, seconds), "long": counts(*long, seconds)},
        "per_class": {},
    }


def write(tmp_path: Path, name: str, data: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def run_pool(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    bench_pool.add_parser(parser.add_subparsers())
    ns = parser.parse_args(["pool", *argv])
    result: int = ns.func(ns)
    return result


def test_pooled_goodput_is_all_good_requests_over_all_seconds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Server A: a calm seed (40 good of 40 in 40 s) and an overloaded one (30 of 40 in 60 s).
    a = [
        write(tmp_path, "a2.json", report(2, 40.0, (32, 32), (8, 8))),
        write(tmp_path, "a5.json", report(5, 60.0, (32, 28), (8, 2))),
    ]
    b = [  # the same loads, listed in another order
        write(tmp_path, "b5.json", report(5, 80.0, (32, 12), (8, 4))),
        write(tmp_path, "b2.json", report(2, 45.0, (32, 28), (8, 8))),
    ]
    assert run_pool(["--reports", "A", *a, "--reports", "B", *b, "--baseline", "B", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # Pooled, not the mean of the runs' goodputs: (40 + 30) / (40 + 60), not (1.0 + 0.5) / 2.
    assert out["A"]["good"] == 70 and out["A"]["seconds"] == 100.0
    assert out["A"]["goodput"] == pytest.approx(0.70)
    assert out["A"]["attainment"] == pytest.approx(70 / 80)
    assert out["B"]["goodput"] == pytest.approx(52 / 125)
    assert out["A"]["vs_baseline"] == pytest.approx(0.70 / (52 / 125), abs=1e-3)
    assert out["B"]["vs_baseline"] == 1.0
    # At most: A's 80 requests all good in its 100 s, against B's 52 good in 125 s.
    assert out["A"]["ceiling_vs_baseline"] == pytest.approx(0.80 / (52 / 125), abs=1e-3)
    assert out["B"]["ceiling_vs_baseline"] == pytest.approx(80 / 52, abs=1e-3)
    assert out["A"]["per_kind"]["long"] == {"good": 10, "requests": 16, "goodput": 0.1}
    assert out["B"]["per_kind"]["short"]["goodput"] == pytest.approx(40 / 125)
    # The table: a row per run, a pooled row per server with the ratio to the baseline.
    assert run_pool(["--reports", "A", *a, "--reports", "B", *b, "--baseline", "B"]) == 0
    table = capsys.readouterr().out
    pooled = {line.split()[0]: line.split() for line in table.split("pooled")[1].splitlines()[2:]}
    assert pooled["A"][1:4] == ["2", "70", "80"] and pooled["A"][-2:] == ["1.68x", "1.92x"]
    assert pooled["B"][-2:] == ["1.00x", "1.54x"]


def with_requests(seed: int, tpots_ms: list[float]) -> dict:
    """A report whose short requests each took 100 ms to the first token and then 10 tokens at
    the given TPOT, plus a refused one and a one-token one (no TPOT)."""
    data = report(seed, 60.0, (len(tpots_ms) + 2, len(tpots_ms)), (0, 0))
    data["requests"] = [
        {"index": i, "prompt_tokens": 64, "output_tokens": 11, "status": 200, "ttft_s": 0.1}
        | {"e2e_s": 0.1 + 10 * t / 1000, "kind": "short"}
        for i, t in enumerate(tpots_ms)
    ] + [
        {"index": 98, "prompt_tokens": 64, "output_tokens": 0, "status": 429, "ttft_s": None}
        | {"e2e_s": None, "kind": "short"},
        {"index": 99, "prompt_tokens": 64, "output_tokens": 1, "status": 200, "ttft_s": 0.1}
        | {"e2e_s": 0.1, "kind": "short"},
    ]
    return data


def test_latency_percentiles_pool_every_runs_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A's two runs: TPOTs of 1-50 ms and 51-100 ms; B's the same, doubled.
    a = [
        write(tmp_path, "a2.json", with_requests(2, [float(t) for t in range(1, 51)])),
        write(tmp_path, "a5.json", with_requests(5, [float(t) for t in range(51, 101)])),
    ]
    b = [
        write(tmp_path, "b2.json", with_requests(2, [2.0 * t for t in range(1, 51)])),
        write(tmp_path, "b5.json", with_requests(5, [2.0 * t for t in range(51, 101)])),
    ]
    assert run_pool(["--reports", "A", *a, "--reports", "B", *b, "--baseline", "B", "--json"]) == 0
    short = json.loads(capsys.readouterr().out)["A"]["latency"]["short"]
    # 100 TPOTs of 1..100 ms: the nearest rank of p99 is the 99th (no single run holds it: each
    # run's own p99 is its slowest request, 50 or 100 ms), p50 the 51st (round half to even).
    assert short["tpot_ms"] == {"p50": 51.0, "p90": 90.0, "p99": 99.0}
    # Every completed request has a first token (the one-token ones too); the refused has none.
    assert short["requests"] == 102 and short["ttft_ms"]["p99"] == pytest.approx(100.0)
    assert short["tpot_p99_vs_baseline"] == pytest.approx(0.5)
    assert short["ttft_p99_vs_baseline"] == pytest.approx(1.0)
    assert run_pool(["--reports", "A", *a, "--reports", "B", *b, "--baseline", "B"]) == 0
    table = capsys.readouterr().out.split("pooled latency per kind")[1].splitlines()
    rows = {line.split()[0]: line.split() for line in table[3:]}
    assert rows["A"][1:3] == ["short", "102"] and rows["A"][-2:] == ["1.00x", "0.50x"]
    assert rows["B"][8] == "198.0"


def test_reports_that_cannot_be_compared_are_refused_naming_the_file_or_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a2 = write(tmp_path, "a2.json", report(2, 40.0, (32, 32), (8, 8)))
    b3 = write(tmp_path, "b3.json", report(3, 40.0, (32, 32), (8, 8)))
    other_slo = report(2, 40.0, (32, 32), (8, 8))
    other_slo["slo_per_kind"] = {**SLO_PER_KIND, "short": {**SLO_PER_KIND["short"], "tpot_ms": 50}}
    b2_slo = write(tmp_path, "b2-slo.json", other_slo)
    not_report = write(tmp_path, "x.json", {"profile": "mixed"})
    bad_seconds = write(tmp_path, "z.json", report(2, 0.0, (32, 32), (8, 8)))
    cases = [
        (["--reports", "A", a2, "--reports", "B", b3], "--reports B: its loads"),
        (["--reports", "A", a2, "--reports", "B", b2_slo], "b2-slo.json: its SLOs"),
        (["--reports", "A", not_report], "x.json: not a `bench serve --json-out` report"),
        (["--reports", "A", bad_seconds], "z.json: summary.seconds is 0.0"),
        (["--reports", "A", str(tmp_path / "none.json")], "none.json: cannot read it"),
        (["--reports", "A", a2, "--reports", "A", a2], "the group name 'A' is given twice"),
        (["--reports", "A", a2, "--baseline", "vllm"], "--baseline 'vllm' names no"),
        (["--reports", "A"], "--reports A names no report file"),
    ]
    for argv, message in cases:
        assert run_pool(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("bench pool: ") and message in err, (argv, err)
    # A missing field is named, with where it is missing.
    assert run_pool(["--reports", "A", not_report]) == 2
    assert "missing required field `arrival`" in capsys.readouterr().err
    no_seconds = report(2, 40.0, (32, 32), (8, 8))
    del no_seconds["summary"]["seconds"]
    assert run_pool(["--reports", "A", write(tmp_path, "s.json", no_seconds)]) == 2
    assert "missing required field `seconds` - at `$.summary`" in capsys.readouterr().err


def test_pools_the_reports_bench_serve_writes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two seeds of the mixed profile replayed in-process on the tiny model, each written by
    `bench serve --json-out`: pooling reads them as written."""
    parser = argparse.ArgumentParser()
    bench_serve.add_parser(parser.add_subparsers())
    paths = []
    for seed in (0, 1):
        out = tmp_path / f"seed{seed}.json"
        ns = parser.parse_args(
            ["serve", "--offline", "--model-dir", str(tiny_model_dir), "--profile", "mixed"]
            + ["--arrival", "burst", "--num-requests", "5", "--prompt-len", "12"]
            + ["--output-len", "3", "--vocab", "4096", "--seed", str(seed)]
            + ["--slo-tpot-ms", "short=600000,long=0.001", "--json-out", str(out), "--json"]
        )
        assert ns.func(ns) == 0
        paths.append(str(out))
    runs = [json.loads(Path(p).read_text()) for p in paths]
    [served] = bench_pool.pool([("served", paths)])
    assert served.good == sum(r["summary"]["good"] for r in runs)
    assert served.seconds == pytest.approx(sum(r["summary"]["seconds"] for r in runs))
    assert served.goodput == pytest.approx(served.good / served.seconds)
    long_good, long_requests, _ = served.kind_goodput("long")
    # No long request meets a 1 us TPOT; every request of both runs is counted once.
    assert long_good == 0 and long_requests == sum(r["per_kind"]["long"]["requests"] for r in runs)
    assert served.requests == 10 and served.kinds() == ["long", "short"]
    # The pooled latencies are those of both runs' completed requests, as each report has them.
    [long] = [x for x in bench_pool.pooled_latency([served]) if x.kind == "long"]
    written = [q for r in runs for q in r["requests"] if q["kind"] == "long" and q["status"] == 200]
    assert long.requests == len(written) > 0
    tpots = sorted(1000 * q["tpot_s"] for q in written if q["tpot_s"] is not None)
    assert sorted(long.tpot_ms) == pytest.approx(tpots)
