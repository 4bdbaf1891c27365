"""`appliance bench serve`: goodput per kind and per class under SLOs per kind, the SLO flags'
errors, and `--plot` (the figure's points, counted from the Figure, and the PNG it writes)."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_harness import ServerProcess, write_template

from appliance.bench.goodput import SLO, SLOError, SLOs, parse_slos
from appliance.bench.serve import Result, summarize
from appliance.bench.workload import PROFILES, make_workload

KINDS = ["short", "long"]


def done(i: int, kind: str, ttft_s: float, tpot_s: float, out: int = 11) -> Result:
    cls = "realtime" if kind == "short" else "batch"
    e2e = ttft_s + tpot_s * (out - 1)
    return Result(i, cls, 10, out, 200, ttft_s, e2e, kind=kind, arrival_s=0.5 * i)


def synthetic() -> list[Result]:
    return [
        done(0, "short", 0.05, 0.01),  # good
        done(1, "short", 0.20, 0.01),  # misses TTFT only
        done(2, "short", 0.05, 0.08),  # misses TPOT only
        done(3, "long", 0.50, 0.01),  # good: long's TTFT SLO is 1000 ms
        done(4, "long", 1.50, 0.01),  # misses long's TTFT
        done(5, "short", 0.05, 0.0, out=1),  # one token: no TPOT, meets the TPOT SLO
        Result(6, "realtime", 10, status=429, kind="short", arrival_s=3.0),  # refused
    ]


def test_goodput_counts_requests_that_met_every_slo_of_their_kind() -> None:
    slos = parse_slos("short=100,long=1000", "50", None, None, KINDS)
    results = synthetic()
    s = summarize(results, 2.0, slos)
    assert (s.requests, s.ok, s.good) == (7, 6, 3)
    assert s.goodput == 1.5  # 3 good requests over the run's 2 s
    assert s.slo_counts == {"ttft": {"met": 4, "missed": 2}, "tpot": {"met": 5, "missed": 1}}
    short = summarize([r for r in results if r.kind == "short"], 2.0, slos)
    assert (short.requests, short.ok, short.good, short.goodput) == (5, 4, 2, 1.0)
    assert short.slo_counts["ttft"] == {"met": 3, "missed": 1}
    assert short.slo_counts["tpot"] == {"met": 3, "missed": 1}
    long = summarize([r for r in results if r.kind == "long"], 2.0, slos)
    assert (long.good, long.goodput, long.slo_counts["ttft"]) == (1, 0.5, {"met": 1, "missed": 1})
    # TTFT alone: request 2 is good now; TPOT alone: requests 1 and 4 are.
    assert (
        summarize(results, 2.0, parse_slos("short=100,long=1000", None, None, None, KINDS)).good
        == 4
    )
    assert summarize(results, 2.0, parse_slos(None, "50", None, None, KINDS)).good == 5
    # No SLO: every completed request is good, and no SLO is counted.
    none = summarize(results, 2.0, SLOs())
    assert (none.good, none.slo_counts) == (6, {})


def test_a_single_slo_holds_every_kind_and_a_kind_overrides_it() -> None:
    slos = parse_slos("1000,long=20000", None, "60000", None, KINDS)
    assert slos.of("short") == SLO(1000, None, 60000)
    assert slos.of("long") == SLO(20000, None, 60000)
    assert slos.of("") == SLO(1000, None, 60000)  # a request of no kind: the default
    assert slos.describe() == "TTFT <= 1000 ms (long 20000 ms); E2E <= 60000 ms"
    vllm = parse_slos(None, None, None, ["ttft:500", "tpot:40", "e2el:9000"], KINDS)
    assert vllm.of("long") == SLO(500, 40, 9000) and vllm.given()
    assert not parse_slos(None, None, None, None, KINDS).given()
    assert parse_slos("long=5", None, None, None, KINDS).describe() == "TTFT: long 5 ms"


@pytest.mark.parametrize(
    ("ttft", "goodput", "words"),
    [
        ("fast=100", None, ["--slo-ttft-ms", "'fast=100'", "no kind 'fast'", "short, long"]),
        ("-5", None, ["--slo-ttft-ms", "'-5'", "> 0"]),
        ("0", None, ["--slo-ttft-ms", "'0'", "> 0"]),
        ("short=0", None, ["--slo-ttft-ms", "'short=0'", "> 0"]),
        ("nan", None, ["--slo-ttft-ms", "'nan'", "> 0"]),
        ("1s", None, ["--slo-ttft-ms", "'1s'", "not a number"]),
        ("100,", None, ["--slo-ttft-ms", "''", "KIND=MS"]),
        ("short=", None, ["--slo-ttft-ms", "'short='", "KIND=MS"]),
        ("short=1,short=2", None, ["--slo-ttft-ms", "'short=2'", "twice"]),
        ("1,2", None, ["--slo-ttft-ms", "'2'", "the default is given twice"]),
        (None, ["ttft=100"], ["--goodput", "'ttft=100'", "KEY:MS"]),
        (None, ["itl:100"], ["--goodput", "'itl:100'", "ttft, tpot, e2el"]),
        (None, ["tpot:-1"], ["--goodput", "'tpot:-1'", "> 0"]),
        ("100", ["ttft:100"], ["--goodput", "'ttft:100'", "already given", "--slo-ttft-ms"]),
    ],
)
def test_slo_errors_name_the_flag_and_the_bad_part(
    ttft: str | None, goodput: list[str] | None, words: list[str]
) -> None:
    with pytest.raises(SLOError) as info:
        parse_slos(ttft, None, None, goodput, KINDS)
    for w in words:
        assert w in str(info.value)


def test_a_bad_slo_stops_the_run_before_it_starts(capsys: pytest.CaptureFixture[str]) -> None:
    from appliance.cli import main

    assert main(["bench", "serve", "--profile", "chat", "--slo-tpot-ms", "long=50"]) == 2
    assert "--slo-tpot-ms: 'long=50': no kind 'long'" in capsys.readouterr().err


def test_every_request_carries_its_profiles_kind() -> None:
    items = make_workload("mixed", 200, "poisson", 4.0, seed=3)
    assert {i.kind for i in items} == {"short", "long"}
    assert all((i.kind == "short") == (i.priority_class == "realtime") for i in items)
    assert all(len(i.prompt) >= 1400 for i in items if i.kind == "long")
    assert {k.name for k in PROFILES["chat"]} == {"short"}


def offsets(ax: object) -> list[int]:
    return [len(c.get_offsets()) for c in ax.collections]  # type: ignore[attr-defined]


def test_plot_draws_a_point_per_request_and_the_slo_lines(tmp_path: Path) -> None:
    from appliance.bench.serve_plot import plot_results

    slos = parse_slos("short=100,long=1000", "50", None, None, KINDS)
    path = tmp_path / "x.png"
    fig = plot_results(synthetic(), slos, "bench serve: test", str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    ttft, tpot = fig.axes
    # TTFT: 4 short and 2 long points, then 1 refused request's cross along the top.
    assert offsets(ttft) == [4, 2, 1]
    assert [c.get_label() for c in ttft.collections] == ["short (4)", "long (2)", "failed (1)"]
    # TPOT: the one-token request has none.
    assert offsets(tpot) == [3, 2]
    # SLO lines: one per kind on TTFT (100 and 1000 ms), one for every kind on TPOT (50 ms).
    assert sorted(line.get_ydata()[0] for line in ttft.get_lines()) == [100, 1000]
    assert [line.get_ydata()[0] for line in tpot.get_lines()] == [50]
    assert ttft.get_yscale() == "log"  # 50 ms to 1500 ms: more than 20x
    assert tpot.get_yscale() == "linear"  # 10 ms to 80 ms


def test_bench_serve_offline_reports_goodput_per_kind_and_plots(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole path on the tiny model: a burst of the mixed profile replayed in-process."""
    from appliance.bench.serve import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    plot, out = tmp_path / "run.png", tmp_path / "run.json"
    ns = parser.parse_args(
        ["serve", "--offline", "--model-dir", str(tiny_model_dir), "--profile", "mixed"]
        + ["--arrival", "burst", "--num-requests", "6", "--prompt-len", "12"]
        + ["--output-len", "3", "--vocab", "4096", "--seed", "0", "--goodput", "ttft:600000"]
        + ["--slo-tpot-ms", "short=600000,long=0.001", "--plot", str(plot)]
        + ["--json-out", str(out)]
    )
    assert ns.func(ns) == 0
    table = capsys.readouterr().out
    assert "goodput: requests that met every SLO" in table and f"plot: {plot}" in table
    assert "ITL p50" in table
    report = json.loads(out.read_text())
    kinds = report["per_kind"]
    assert set(kinds) == {"short", "long"}
    assert report["summary"]["ok"] == 6
    # Every short request met its SLOs; no long one met its 1 us TPOT.
    assert kinds["short"]["good"] == kinds["short"]["requests"] > 0
    assert kinds["long"]["requests"] == 2  # seed 0: requests 0 and 4
    assert kinds["long"]["good"] == 0 and kinds["long"]["slo_counts"]["tpot"]["missed"] == 2
    assert report["summary"]["good"] == kinds["short"]["good"]
    assert report["slo_per_kind"]["long"] == {"ttft_ms": 600000, "tpot_ms": 0.001, "e2e_ms": None}
    # Each request's own record, in arrival order, its timings consistent with the summary.
    details = report["requests"]
    assert [d["index"] for d in details] == list(range(6))
    assert [d["kind"] for d in details].count("long") == 2
    for d in details:
        assert d["status"] == 200 and d["output_tokens"] == 3 and d["prompt_tokens"] == 12
        assert 0 < d["ttft_s"] <= d["e2e_s"]
        assert d["tpot_s"] == pytest.approx((d["e2e_s"] - d["ttft_s"]) / 2, abs=1e-4)
        # One token a step: a gap before each token after the first, adding up to the rest.
        assert len(d["itl_s"]) == 2 and min(d["itl_s"]) > 0
        assert sum(d["itl_s"]) == pytest.approx(d["e2e_s"] - d["ttft_s"], abs=1e-4)
    gaps = sorted(g * 1000 for d in details for g in d["itl_s"])
    assert report["summary"]["itl_ms"]["p99"] == pytest.approx(gaps[-1], abs=0.01)
    # The summary rounds the run's seconds to the millisecond; no request ends after the run.
    assert max(d["e2e_s"] for d in details) <= report["summary"]["seconds"] + 0.0005
    assert plot.stat().st_size > 0


def test_itl_pools_every_gap_and_shows_the_stall_tpot_averages_away() -> None:
    """One request streams 20 tokens 10 ms apart; another stalls 200 ms once among 10 ms gaps.
    Their TPOTs are near (10 and 20 ms); the ITL p99 is the stall."""
    steady = Result(0, "c", 10, 21, 200, 0.05, 0.05 + 0.2, itl_s=[0.01] * 20)
    stalled = Result(1, "c", 10, 21, 200, 0.05, 0.05 + 0.39, itl_s=[0.01] * 19 + [0.2])
    s = summarize([steady, stalled], 1.0, SLO())
    assert s.tpot_ms["p99"] == pytest.approx(19.5)
    assert s.itl_ms == {"p50": 10.0, "p90": 10.0, "p99": 200.0}


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("srv-bench")
    srv = ServerProcess(write_template(d / "t.toml", tiny_model_dir), d / "log.txt").start()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_bench_serve_over_http_times_each_streamed_chunk(server: ServerProcess) -> None:
    """The HTTP client's ITL: a gap per streamed chunk after the first, within the request's
    time after its first token. A chunk may carry more than one token (the tiny model's
    tokens come faster than the stream sends them), so a request has at most a gap a token."""
    from appliance.bench.serve import add_parser, run_http

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    ns = parser.parse_args(
        ["serve", "--url", server.url, "--model", "tiny", "--profile", "chat"]
        + ["--arrival", "burst", "--num-requests", "3", "--prompt-len", "8"]
        + ["--output-len", "6", "--vocab", "4096", "--prompt-format", "tokens"]
    )
    items = make_workload("chat", 3, "burst", 1.0, seed=0, vocab=4096, prompt_len=8, output_len=6)
    results, _, _ = asyncio.run(run_http(items, ns))
    assert [r.status for r in results] == [200] * 3
    for r in results:
        assert r.output_tokens == 6 and r.ttft_s is not None and r.e2e_s is not None
        assert 1 <= len(r.itl_s) <= r.output_tokens and min(r.itl_s) >= 0
        assert r.ttft_s + sum(r.itl_s) <= r.e2e_s + 1e-6
