"""`appliance bench slo-scale`: each server's pooled goodput with the reports' SLOs times each
scale (of every kind, or of the kinds named), against requests whose TTFT and TPOT are known,
the ratio to a baseline, the plot, and the errors for what cannot be scaled."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from appliance.bench import slo_scale
from tests.test_bench_pool import SLO_PER_KIND, counts, write


def request(index: int, kind: str, ttft_ms: float, tpot_ms: float, out: int = 11) -> dict:
    """A streamed request's record: e2e = TTFT + (out - 1) * TPOT."""
    ttft = ttft_ms / 1000
    return {
        "index": index,
        "priority_class": "(default)",
        "prompt_tokens": 64 if kind == "short" else 1500,
        "output_tokens": out,
        "status": 200,
        "ttft_s": ttft,
        "e2e_s": ttft + (out - 1) * tpot_ms / 1000,
        "retry_after": False,
        "refused_s": None,
        "kind": kind,
        "arrival_s": float(index),
        "itl_s": [],
        "tpot_s": tpot_ms / 1000,
    }


def report(seed: int, seconds: float, chats: list[tuple[float, float]], summaries: int) -> dict:
    """`chats`: (TTFT, TPOT) ms of each chat; the summaries each 3 s / 50 ms (all good at the
    stated 10 s / 200 ms, and at half of it)."""
    reqs = [request(i, "short", ttft, tpot) for i, (ttft, tpot) in enumerate(chats)]
    reqs += [request(len(chats) + i, "long", 3000, 50) for i in range(summaries)]
    n = len(reqs)
    return {
        "source": "http://127.0.0.1:8000",
        "profile": "mixed",
        "arrival": "poisson",
        "rate": 1.0,
        "num_requests": n,
        "seed": seed,
        "slo": {"ttft_ms": None, "tpot_ms": None, "e2e_ms": None},
        "slo_per_kind": SLO_PER_KIND,
        "summary": counts(n, n, seconds),
        "per_kind": {
            "short": counts(len(chats), len(chats), seconds),
            "long": counts(summaries, summaries, seconds),
        },
        "per_class": {},
        "requests": reqs,
    }


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    slo_scale.add_parser(parser.add_subparsers())
    ns = parser.parse_args(["slo-scale", *argv])
    result: int = ns.func(ns)
    return result


@pytest.fixture
def reports(tmp_path: Path) -> dict[str, list[str]]:
    # Fast: chats at 20-28 ms a token; slow: at 38-45 ms (vLLM's at 1 req/s), one slow first
    # token. Two seeds each, 40 s and 60 s.
    fast = [(100, 20), (150, 22), (300, 28)]
    slow = [(90, 38), (120, 41), (460, 45)]
    return {
        "fast": [
            write(tmp_path, "fast-0.json", report(0, 40.0, fast, 1)),
            write(tmp_path, "fast-1.json", report(1, 60.0, fast, 1)),
        ],
        "slow": [
            write(tmp_path, "slow-0.json", report(0, 40.0, slow, 1)),
            write(tmp_path, "slow-1.json", report(1, 60.0, slow, 1)),
        ],
    }


def points(out: str) -> dict[tuple[str, float], dict[str, Any]]:
    return {(p["group"], p["scale"]): p for p in json.loads(out)}


def test_the_chats_slos_scaled_count_the_requests_within_them(
    reports: dict[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--reports", "fast", *reports["fast"], "--reports", "slow", *reports["slow"]]
    assert run([*argv, "--scales", "1,0.4,0.3,0.25", "--kinds", "short", "--json"]) == 0
    got = points(capsys.readouterr().out)
    # Per seed, of 4 requests: scale 1 (1000/100 ms): all; 0.4 (400/40): fast all, slow the
    # summary and the 38 ms chat; 0.3 (300/30): fast all (300 ms is within), slow the summary;
    # 0.25 (250/25): fast the summary and two chats.
    expected = {1.0: (8, 8), 0.4: (8, 4), 0.3: (8, 2), 0.25: (6, 2)}
    for scale, (fast, slow) in expected.items():
        assert got[("fast", scale)]["good"] == fast, scale
        assert got[("slow", scale)]["good"] == slow, scale
        assert got[("fast", scale)]["goodput"] == pytest.approx(fast / 100.0, abs=1e-4)
    assert all(p["requests"] == 8 and p["seconds"] == 100.0 for p in got.values())


def test_every_kind_scaled_holds_the_summaries_too(
    reports: dict[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--reports", "fast", *reports["fast"], "--scales", "0.5,0.25", "--json"]
    assert run(argv) == 0
    got = points(capsys.readouterr().out)
    # The summaries' 3 s / 50 ms: within 5 s / 100 ms, past 2.5 s / 50 ms.
    assert got[("fast", 0.5)]["good"] == 8
    assert got[("fast", 0.25)]["good"] == 4


def test_the_table_gives_the_ratio_to_the_baseline_and_the_plot_is_drawn(
    reports: dict[str, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "curve.png"
    argv = ["--reports", "fast", *reports["fast"], "--reports", "slow", *reports["slow"]]
    argv += ["--baseline", "slow", "--kinds", "short", "--scales", "1,0.4", "--plot", str(png)]
    assert run(argv) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert "short 400/40; long 10000/200" in rows["0.4"]
    # The ratio, then the most it could be (every one of fast's requests good): at scale 1 the
    # slow server meets every SLO, so no server gets past 1.00x.
    assert rows["1"].rstrip().endswith("1.00x (1.00x)")
    assert rows["0.4"].rstrip().endswith("2.00x (2.00x)")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--scales", "1,0"], "--scales: '0': a scale must be a finite number > 0"),
        (["--scales", "1,x"], "--scales: 'x' is not a number"),
        (["--kinds", "medium"], "--kinds: 'medium' is not a kind of these reports"),
        (["--baseline", "nobody"], "--baseline 'nobody' names no --reports group"),
    ],
)
def test_bad_arguments_name_themselves(
    reports: dict[str, list[str]],
    extra: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run(["--reports", "fast", *reports["fast"], *extra]) == 2
    assert message in capsys.readouterr().err


def test_reports_without_slos_have_nothing_to_scale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = report(0, 10.0, [(100, 20)], 1)
    data["slo_per_kind"] = {}
    path = write(tmp_path, "bare.json", data)
    assert run(["--reports", "bare", path]) == 2
    assert "run without SLOs: nothing to scale" in capsys.readouterr().err
