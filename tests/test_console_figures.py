"""The console's figures on their own, without a server: the step window's histograms and
throughput, Prometheus-compatible quantiles, the block map's downsampling, and a console that
imports no torch."""

from __future__ import annotations

import os
import time

import pytest
from appliance.console import figures
from appliance.console.blockmap import cells_from_counts, cells_from_states

from appliance.server.admin_schema import StepRecord


def step(
    n: int, t: float, seqs: int, bound: str = "none", prompt: int = 0, gen: int = 0
) -> StepRecord:
    return StepRecord(
        step=n,
        time=t,
        duration_s=0.01,
        num_running=seqs,
        num_waiting=0,
        num_swapped=0,
        num_seqs=seqs,
        num_scheduled_tokens=prompt + gen,
        num_context_tokens=0,
        num_prompt_tokens=prompt,
        num_generation_tokens=gen,
        blocks_used=0,
        blocks_cached=0,
        blocks_free=0,
        kv_usage=0.0,
        bound_by=bound,
    )


def test_step_window_histogram_bounds_and_throughput() -> None:
    w = figures.StepWindow(window_s=60)
    w.merge([step(1, 100.0, 1), step(2, 150.0, 3, "kv_blocks", gen=3)], 1, now=150.0)
    w.merge(
        [step(2, 150.0, 3, "kv_blocks", gen=3), step(3, 170.0, 8, "token_budget", prompt=100)],
        1,
        now=170.0,
    )
    assert [r.step for r in w.steps] == [2, 3]  # step 1 left the minute; step 2 merged once
    assert figures.batch_histogram(w.steps, 16) == [
        ("1", 0),
        ("2", 0),
        ("3-4", 1),
        ("5-8", 1),
        ("9-16", 0),
    ]
    assert figures.bound_shares(w.steps) == {
        "token_budget": 0.5,
        "time_budget": 0.0,
        "max_num_seqs": 0.0,
        "kv_blocks": 0.5,
        "none": 0.0,
    }
    prompt, gen = figures.tokens_per_second(w.steps, now=170.5)
    assert prompt[-1] == 100 and gen[-21] == 3 and sum(gen) == 3
    w.merge([step(1, 171.0, 1)], 2, now=171.0)  # a reload: step numbers restart
    assert [r.step for r in w.steps] == [1]


def test_histogram_quantile_matches_prometheus() -> None:
    buckets = [(0.1, 10.0), (0.5, 60.0), (1.0, 100.0), (float("inf"), 100.0)]
    assert figures.histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 40 / 50)
    assert figures.histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * 39 / 40)
    assert figures.histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    new = [(0.1, 12.0), (float("inf"), 20.0)]
    assert figures.bucket_delta(new, [(0.1, 10.0), (float("inf"), 10.0)]) == [
        (0.1, 2.0),
        (float("inf"), 10.0),
    ]
    assert figures.bucket_delta([(0.1, 1.0)], [(0.1, 5.0)]) == [(0.1, 1.0)]  # counters restarted


def test_block_map_downsamples_tens_of_thousands_of_blocks() -> None:
    cells = cells_from_counts(30_000, 10_000, 10_000, 100)
    assert (cells.count("U"), cells.count("C"), cells.count("F")) == (60, 20, 20)
    states = ("U" * 3 + "C" + "F" * 6) * 5_000  # 50,000 blocks
    t0 = time.perf_counter()
    cells = cells_from_states(states, 80 * 20)
    assert time.perf_counter() - t0 < 0.1
    assert set(cells) == {"F"}  # every cell holds ~31 blocks, 60% of them free
    assert cells_from_states("UCF", 5) == ["U", "C", "F", " ", " "]


def test_console_package_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, appliance.console.app; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ}, check=True
    )
    assert out.stdout.strip() == "False"
