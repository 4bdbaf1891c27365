"""Scheduler behaviour with a fake model (every sampled token is 1): budgets, chunking,
ordering, preemption, admission control. Pure Python, milliseconds per test."""

from __future__ import annotations

import time

import pytest

from appliance.config import load_config
from appliance.core.kv_cache_manager import KVCacheManager
from appliance.core.request import FinishReason, Request, RequestStatus
from appliance.core.scheduler import Scheduler
from appliance.core.scheduler_output import SchedulerOutput
from appliance.sampling_params import SamplingParams

BS = 16


def make(overrides: dict | None = None, num_blocks: int = 64, swap: int = 0) -> Scheduler:
    cfg = load_config(None, overrides or {})
    kv = KVCacheManager(num_blocks, BS, cfg.cache.enable_prefix_caching, swap)
    return Scheduler(cfg, kv, max_model_len=4096)


def req(
    rid: str,
    n: int,
    max_tokens: int = 8,
    priority: int = 0,
    arrival: float | None = None,
    base: int = 0,
    cls: str = "",
) -> Request:
    return Request(
        rid,
        [base + i for i in range(n)],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        priority=priority,
        priority_class=cls,
        arrival_time=time.monotonic() if arrival is None else arrival,
    )


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, {r.request_id: 1 for r in out.scheduled if r.sample})
    return out


def run_all(s: Scheduler, limit: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while s.has_unfinished():
        outs.append(step(s))
        assert len(outs) < limit, "scheduler made no progress"
    return outs


def test_budget_and_max_num_seqs_are_never_exceeded() -> None:
    s = make({"scheduler.max_num_batched_tokens": 64, "scheduler.max_num_seqs": 3})
    for i in range(10):
        s.add_request(req(f"r{i}", 20 + 17 * i, base=1000 * i))
    for out in run_all(s):
        assert out.num_scheduled_tokens <= 64
        assert len(out.scheduled) <= 3
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_long_prompt_is_chunked_while_decodes_advance() -> None:
    s = make({"scheduler.max_num_batched_tokens": 40})
    for i in range(4):
        s.add_request(req(f"short{i}", 5, max_tokens=50, base=100 * i))
    step(s)  # prefill the shorts
    s.add_request(req("long", 300, max_tokens=4, base=5000))
    chunks = []
    while s.requests.get("long") and s.requests["long"].num_output_tokens == 0:
        out = step(s)
        by_id = {r.request_id: r for r in out.scheduled}
        # Every running decode advances every step.
        for i in range(4):
            assert len(by_id[f"short{i}"].token_ids) == 1
        long = by_id.get("long")
        if long is not None:
            chunks.append(len(long.token_ids))
            # Output only comes from the last chunk.
            assert long.sample == (long.start_pos + len(long.token_ids) == 300)
    assert sum(chunks) == 300 and len(chunks) > 1 and max(chunks) <= 36


def test_running_requests_go_before_waiting_ones() -> None:
    s = make({"scheduler.max_num_batched_tokens": 32})
    s.add_request(req("a", 4, max_tokens=20))
    step(s)
    s.add_request(req("b", 100, base=500))
    out = s.schedule()
    assert out.scheduled[0].request_id == "a"
    assert [r.request_id for r in out.scheduled] == ["a", "b"]
    assert len(out.scheduled[1].token_ids) == 31


def test_priorities_order_admission() -> None:
    s = make({"scheduler.policy": "priority", "scheduler.max_num_seqs": 1})
    t = time.monotonic()
    for rid, prio, arr in [("0", 2, 1), ("1", 1, 3), ("2", 1, 2), ("3", 0, 4)]:
        s.add_request(
            req(rid, 4, max_tokens=1, priority=prio, arrival=t + arr, base=int(rid) * 100)
        )
    order = []
    for out in run_all(s):
        order += [r.request_id for r in out.scheduled]
    assert order == ["3", "2", "1", "0"]


def test_fcfs_ignores_priority() -> None:
    s = make({"scheduler.policy": "fcfs", "scheduler.max_num_seqs": 1})
    t = time.monotonic()
    for rid, prio, arr in [("0", 2, 1), ("1", 1, 3), ("2", 1, 2), ("3", 0, 4)]:
        s.add_request(
            req(rid, 4, max_tokens=1, priority=prio, arrival=t + arr, base=int(rid) * 100)
        )
    order = [r.request_id for out in run_all(s) for r in out.scheduled]
    assert order == ["0", "2", "1", "3"]


def test_finished_and_aborted_requests_return_blocks() -> None:
    s = make()
    s.add_request(req("a", 40, max_tokens=3))
    s.add_request(req("b", 40, max_tokens=100, base=900))
    step(s)
    held = s.kv.pool.num_used_blocks
    assert held == 6
    s.abort("b")
    assert s.kv.pool.num_used_blocks == 3
    run_all(s)
    assert s.kv.pool.num_used_blocks == 0
    reasons = {f.request.request_id: f.reason for f in s.take_finished()}
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.ABORT}


@pytest.mark.parametrize("where", ["waiting", "running", "mid_chunk", "swapped"])
def test_abort_anywhere_frees_everything_and_reports_once(where: str) -> None:
    s = make({"scheduler.max_num_batched_tokens": 32, "scheduler.preemption_mode": "swap"}, swap=16)
    s.add_request(req("x", 100 if where == "mid_chunk" else 10, max_tokens=50))
    if where != "waiting":
        step(s)
    if where == "swapped":
        s.swap_out_for_test = s.preempt(s.requests["x"], "test")  # type: ignore[attr-defined]
        assert s.requests["x"].status is RequestStatus.SWAPPED
    assert s.abort("x")
    assert not s.abort("x")
    assert s.kv.pool.num_used_blocks == 0 and s.kv.usage().swap_blocks_used == 0
    assert [f.reason for f in s.take_finished()] == [FinishReason.ABORT]
    assert not s.has_unfinished()


def test_stop_conditions_and_no_trailing_tokens() -> None:
    s = make()
    r = Request("eos", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=frozenset({1}))
    s.add_request(r)
    run_all(s)
    assert r.output_token_ids == [1] and r.finish_reason is FinishReason.STOP
    s2 = make()
    r2 = Request(
        "minimum",
        [1, 2, 3],
        SamplingParams(max_tokens=10, min_tokens=3),
        eos_token_ids=frozenset({1}),
    )
    s2.add_request(r2)
    run_all(s2)
    assert r2.num_output_tokens == 3 and r2.finish_reason is FinishReason.STOP
    s3 = make()
    r3 = Request("stopid", [5, 6], SamplingParams(max_tokens=10, stop_token_ids=[1]))
    s3.add_request(r3)
    run_all(s3)
    assert r3.output_token_ids == [1] and r3.finish_reason is FinishReason.STOP
    s4 = make()
    s4.max_model_len = 6
    r4 = Request("len", [5, 6, 7, 8], SamplingParams(max_tokens=10, ignore_eos=True))
    s4.add_request(r4)
    run_all(s4)
    assert r4.num_tokens == 6 and r4.finish_reason is FinishReason.LENGTH


def test_static_policy_waits_for_whole_batch() -> None:
    s = make({"scheduler.policy": "static", "scheduler.max_num_seqs": 2})
    s.add_request(req("a", 4, max_tokens=2))
    s.add_request(req("b", 4, max_tokens=10, base=100))
    s.add_request(req("c", 4, max_tokens=2, base=200))
    outs = run_all(s)
    first_c = next(i for i, o in enumerate(outs) if any(r.request_id == "c" for r in o.scheduled))
    last_b = max(i for i, o in enumerate(outs) if any(r.request_id == "b" for r in o.scheduled))
    assert first_c > last_b  # c waited for the slowest member (b) of the first batch


def test_request_too_large_for_pool_fails_with_reason() -> None:
    s = make(num_blocks=4)
    r = req("big", 60, max_tokens=100)
    s.add_request(r)
    run_all(s)
    assert r.finish_reason is FinishReason.ERROR
    assert "pool has 4" in r.finish_detail
    assert s.kv.pool.num_used_blocks == 0


def test_swapped_mid_prefill_resumes_only_with_room_for_its_next_chunk() -> None:
    s = make(
        {
            "scheduler.max_num_batched_tokens": 48,
            "scheduler.preemption_mode": "swap",
            "scheduler.policy": "priority",
        },
        num_blocks=8,
        swap=16,
    )
    s.add_request(req("x", 100, max_tokens=2, priority=1))
    step(s)  # x prefilled its first 48-token chunk: 3 blocks
    s.preempt(s.requests["x"], "test")  # swapped out mid-prefill
    s.add_request(req("b", 60, max_tokens=3, priority=0, base=900))
    # b holds 4 blocks: x's 3 swapped blocks + 1 would fit, its next 36-token chunk would not.
    outs = run_all(s)
    assert all(out.num_scheduled_tokens <= 48 for out in outs)
    reasons = {f.request.request_id: f.reason for f in s.take_finished()}
    assert reasons == {"x": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert s.kv.pool.num_used_blocks == 0 and s.kv.usage().swap_blocks_used == 0


def test_each_step_sends_only_the_blocks_that_changed() -> None:
    """The runner keeps each request's block table: a step carries a new request's whole table,
    then only the blocks added since; a preempted or finished request is named for the runner
    to drop, and a resumed one comes back with a whole new table."""
    s = make(
        {"scheduler.max_num_batched_tokens": 64, "scheduler.preemption_mode": "recompute"},
        num_blocks=8,
    )
    s.add_request(req("a", 30, max_tokens=40))
    tables: dict[str, list[int]] = {}

    def apply(out: SchedulerOutput) -> None:  # what the runner does with it
        for rid in out.finished_request_ids:
            tables.pop(rid, None)
        for r in out.scheduled:
            tables[r.request_id] = (
                list(r.block_ids) if r.new_table else tables[r.request_id] + r.block_ids
            )

    first = step(s)
    apply(first)
    (a,) = first.scheduled
    assert a.new_table and a.block_ids == s.kv.block_ids(s.requests["a"]) and len(a.block_ids) == 2
    for _ in range(2):  # positions 30 and 31 still fit the second block
        out = step(s)
        apply(out)
        assert (out.scheduled[0].new_table, out.scheduled[0].block_ids) == (False, [])
    out = step(s)  # position 32 opens a third block
    apply(out)
    assert (out.scheduled[0].new_table, len(out.scheduled[0].block_ids)) == (False, 1)
    assert tables["a"] == s.kv.block_ids(s.requests["a"])
    s.preempt(s.requests["a"], "test")
    out = step(s)  # dropped and resumed in the same step: drop first, then the new table
    apply(out)
    assert out.finished_request_ids == ["a"] and out.scheduled[0].new_table
    assert tables["a"] == s.kv.block_ids(s.requests["a"])
    while s.has_unfinished():
        out = step(s)
        apply(out)
        if "a" in s.requests:
            assert tables["a"] == s.kv.block_ids(s.requests["a"])
    assert step(s).finished_request_ids == ["a"]


def test_one_stop_set_per_request_reaches_the_sampler() -> None:
    """EOS (unless ignore_eos) and stop_token_ids are one set, computed once on the request:
    the scheduler stops on it and the scheduled request hands it to the sampler's min_tokens ban."""
    s = make()
    eos = frozenset({1})
    plain = Request(
        "plain", [5, 6], SamplingParams(max_tokens=4, stop_token_ids=[7]), eos_token_ids=eos
    )
    ignoring = Request(
        "ignoring",
        [5, 6],
        SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=[7]),
        eos_token_ids=eos,
    )
    assert plain.stop_token_ids == {1, 7} and ignoring.stop_token_ids == {7}
    s.add_request(plain)
    s.add_request(ignoring)
    out = s.schedule()
    by_id = {r.request_id: r for r in out.scheduled}
    assert by_id["plain"].stop_token_ids == {1, 7}
    assert by_id["ignoring"].stop_token_ids == {7}
