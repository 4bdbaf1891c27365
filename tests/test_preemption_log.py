"""What `Scheduler.preempt` records: one event per preemption, describing what it did (mode,
swap fallback, tokens to recompute, blocks, KV usage before and after), in the bounded log.
Pure Python, milliseconds."""

from __future__ import annotations

import pytest

from appliance.config import load_config
from appliance.core.kv_cache_manager import KVCacheManager
from appliance.core.preemption_log import PreemptionLog
from appliance.core.request import Request, RequestStatus
from appliance.core.scheduler import Scheduler
from appliance.sampling_params import SamplingParams


def running_request(mode: str, swap_blocks: int) -> tuple[Scheduler, Request]:
    cfg = load_config(None, {"scheduler.preemption_mode": mode})
    s = Scheduler(cfg, KVCacheManager(8, 16, True, swap_blocks), max_model_len=256)
    r = Request("r", list(range(20)), SamplingParams(max_tokens=4), priority_class="batch")
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {"r": 7})  # 20 prompt tokens computed, one sampled
    assert r.status is RequestStatus.RUNNING and len(r.blocks) == 2
    return s, r


@pytest.mark.parametrize(
    ("mode", "swap_blocks", "logged_mode", "fallback", "recompute", "swapped"),
    [
        ("recompute", 0, "recompute", False, 20, 0),
        ("swap", 4, "swap", False, 0, 2),
        ("swap", 0, "recompute", True, 20, 0),  # swap pool too small: recompute instead
    ],
)
def test_preempt_records_what_it_did(
    mode: str, swap_blocks: int, logged_mode: str, fallback: bool, recompute: int, swapped: int
) -> None:
    s, r = running_request(mode, swap_blocks)
    usage_before = s.kv.usage_fraction()
    copies = s.preempt(r, "out_of_blocks")
    assert len(copies) == swapped
    [event] = list(s.preemption_log)
    assert (event.request_id, event.priority_class, event.cause) == ("r", "batch", "out_of_blocks")
    assert (event.mode, event.swap_fallback) == (logged_mode, fallback)
    assert (event.tokens_to_recompute, event.blocks_swapped) == (recompute, swapped)
    assert event.blocks_held == 2 and event.times_preempted == 1
    assert event.kv_usage_before == usage_before > event.kv_usage_after == s.kv.usage_fraction()
    assert s.counters.by_mode() == {logged_mode: 1}
    assert s.counters.swap_fallbacks == int(fallback)


def test_the_log_keeps_the_latest_events_only() -> None:
    log = PreemptionLog(maxlen=2)
    for i in range(3):
        r = Request(f"r{i}", [1], SamplingParams(max_tokens=1), priority=i)
        log.record(r, "kv_pressure", None, False, 0, 1, (0.5, 0.4))
    assert [e.request_id for e in log] == ["r1", "r2"] and len(log) == 2
    # No class name: the priority stands in, as the counters label it.
    assert [e.priority_class for e in log] == ["1", "2"]
