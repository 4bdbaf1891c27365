"""The queue's estimated wait (core/wait_estimate.py): departures per second of engine busy
time over a sliding window, and the wait of a new arrival behind the queue."""

from __future__ import annotations

import pytest

from appliance.core.wait_estimate import DepartureRate, estimated_wait_s


def test_no_rate_until_enough_departures() -> None:
    rate = DepartureRate(window_s=30.0, min_departures=4)
    for _ in range(3):
        rate.observe(1.0, 1)
    assert rate.rate is None
    rate.observe(1.0, 1)
    assert rate.rate == pytest.approx(4 / 4.0)


def test_rate_counts_busy_time_only_over_the_window() -> None:
    rate = DepartureRate(window_s=10.0, min_departures=1)
    for _ in range(20):  # 20 s busy at 2 departures a second ...
        rate.observe(0.5, 1)
    assert rate.rate == pytest.approx(2.0)
    for _ in range(20):  # ... then 10 s at 0.5 a second: the old steps fall out of the window
        rate.observe(1.0, 0 if _ % 2 else 1)
    assert rate.rate == pytest.approx(0.5)


def test_estimated_wait() -> None:
    assert estimated_wait_s(ahead=3, free_slots=4, rate=None) == 0.0  # a slot is free for it
    assert estimated_wait_s(ahead=4, free_slots=4, rate=None) is None  # must wait: unknown
    assert estimated_wait_s(ahead=4, free_slots=4, rate=2.0) == pytest.approx(0.5)
    assert estimated_wait_s(ahead=9, free_slots=0, rate=2.0) == pytest.approx(5.0)
    assert estimated_wait_s(ahead=9, free_slots=-1, rate=2.0) == pytest.approx(5.0)
