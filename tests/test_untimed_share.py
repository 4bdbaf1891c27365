"""scheduler.untimed_work_share: how much of a chat's token interval work without a TPOT target
may take. A decode step of chats leaves out the summaries' decode rows that would make it cost
more than (1 + share) times the chats' rows alone (the step cost model's estimate against a
synthetic box whose costs the test knows), never one of them two steps running; and the
pauses of a summary's prefill come at that interval, not only at the chats' target."""

from __future__ import annotations

import time
from typing import Any

import pytest

from appliance.config import ConfigError, load_config
from appliance.core.scheduler import Scheduler
from appliance.core.step_cost import StepShape
from tests.test_scheduler import make, req, step
from tests.test_step_cost import trained, true_seconds

TARGET_S = 0.060
CLASSES: dict[str, Any] = {
    "scheduler.policy": "priority",
    "priority_classes.interactive.priority": 5,
    "priority_classes.interactive.tpot_slo_ms": TARGET_S * 1e3,
    "priority_classes.batch.priority": 10,
    "scheduler.max_num_batched_tokens": 4096,
}


def scheduler(share: float | None) -> Scheduler:
    s = make({**CLASSES, "scheduler.untimed_work_share": share}, num_blocks=1024)
    s.cost = trained()  # the synthetic box of test_step_cost: a row 1.5 ms, a context token 2 us
    return s


def chats_and_summaries_decoding(s: Scheduler) -> None:
    """Two chats (100-token prompts) and three summaries (2,000) past their prompts."""
    for i in range(3):
        s.add_request(
            req(f"summary-{i}", 2000, max_tokens=200, priority=10, cls="batch", base=10_000 * i)
        )
    while s.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in s.running):
        step(s)
    for i in range(2):
        s.add_request(
            req(f"chat-{i}", 100, max_tokens=200, priority=5, cls="interactive", base=50_000 + i)
        )
    step(s)
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in s.running)
    assert len(s.running) == 5


def chats_alone_s(s: Scheduler) -> float:
    chats = [r for r in s.running if r.priority_class == "interactive"]
    return true_seconds(StepShape.decoding(r.num_computed_tokens for r in chats))


def test_without_a_share_every_row_decodes_every_step() -> None:
    s = scheduler(None)
    chats_and_summaries_decoding(s)
    for _ in range(6):
        assert len(step(s).scheduled) == 5


@pytest.mark.parametrize("share", [0.5, 1.0, 2.0])
def test_summaries_that_do_not_fit_wait_one_step_at_most(share: float) -> None:
    s = scheduler(share)
    chats_and_summaries_decoding(s)
    # Each summary row adds 1.5 ms + 2,000 x 2 us = 5.5 ms to the chats' ~7.4 ms.
    alone = chats_alone_s(s)
    interval = min(TARGET_S, (1 + share) * alone)
    assert s.token_interval_s([r for r in s.running if r.priority_class == "interactive"]) == (
        pytest.approx(interval, rel=0.05)
    )
    missed: dict[str, int] = {}
    summary_tokens = 0
    deferred_before = s.counters.deferred_decode_rows
    for _ in range(12):
        out = step(s)
        ids = {r.request_id for r in out.scheduled}
        assert {"chat-0", "chat-1"} <= ids
        forced = [rid for rid, n in missed.items() if n == 1]
        assert set(forced) <= ids, "a summary waited two steps running"
        summaries = [rid for rid in ids if rid.startswith("summary")]
        summary_tokens += len(summaries)
        for rid in (f"summary-{i}" for i in range(3)):
            missed[rid] = 0 if rid in ids else missed.get(rid, 0) + 1
        # A step over the interval carries only summaries that waited the step before.
        if true_seconds(StepShape.of(out)) > interval * 1.05:
            assert set(summaries) <= set(forced)
        if len(summaries) < 3:
            assert out.bound_by == "time_budget"
    # The tighter the share, the fewer summary rows per step; never under every other step.
    assert 12 * 3 / 2 <= summary_tokens < 12 * 3
    assert s.counters.deferred_decode_rows - deferred_before == 12 * 3 - summary_tokens


@pytest.mark.parametrize("most", [1, 2, 3])
def test_max_deferrals_bounds_how_long_a_summary_waits_and_thins_the_chats_steps(
    most: int,
) -> None:
    """scheduler.untimed_max_deferrals: with a share so tight that no summary row fits, each
    waits exactly `most` steps and then rides one; the chats' steps then carry 3 / (most + 1)
    rows on average, which is what sets their token interval."""
    s = make(
        {**CLASSES, "scheduler.untimed_work_share": 0.05, "scheduler.untimed_max_deferrals": most},
        num_blocks=1024,
    )
    s.cost = trained()
    chats_and_summaries_decoding(s)
    runs: dict[str, int] = {}
    longest = 0
    summary_tokens = 0
    seconds = 0.0
    steps = 12 * (most + 1)
    for _ in range(steps):
        out = step(s)
        ids = {r.request_id for r in out.scheduled}
        assert {"chat-0", "chat-1"} <= ids
        seconds += true_seconds(StepShape.of(out))
        for rid in (f"summary-{i}" for i in range(3)):
            runs[rid] = 0 if rid in ids else runs.get(rid, 0) + 1
            longest = max(longest, runs[rid])
            summary_tokens += rid in ids
    assert longest == most
    assert summary_tokens == pytest.approx(3 * steps / (most + 1), abs=3)
    # Each summary row costs 5.5 ms a step it rides; the chats' own rows ~7.4 ms.
    chats = chats_alone_s(s)
    assert seconds / steps == pytest.approx(chats + 3 * 5.5e-3 / (most + 1), rel=0.1)


@pytest.mark.parametrize("bad", [0, -1])
def test_max_deferrals_below_one_is_a_config_error_naming_the_key(bad: int) -> None:
    with pytest.raises(ConfigError, match="untimed_max_deferrals"):
        load_config(None, {"scheduler.untimed_max_deferrals": bad})


def shape_of(out: Any, prefix: str) -> StepShape:
    """The step's rows whose request id starts with `prefix`, as StepShape.of reads them."""
    shape = StepShape()
    for r in out.scheduled:
        if r.request_id.startswith(prefix):
            n = len(r.token_ids)
            shape = shape.with_decode(r.start_pos) if n == 1 else shape.with_chunk(r.start_pos, n)
    return shape


@pytest.mark.parametrize("share", [0.1, 0.25])
def test_a_chats_prompt_step_takes_the_summary_rows_its_share_allows(share: float) -> None:
    """A step with a new chat's prompt beside the decoding chats is past their token interval
    already: the summaries' decode rows add at most the share of what the chats' rows cost
    alone (each held the new chat's first token and the others' next), those that waited the
    step before excepted; one left out comes in the next step."""
    s = scheduler(share)
    chats_and_summaries_decoding(s)
    for _ in range(4):  # to a step after which no summary has waited
        step(s)
        if not any(r.decode_deferrals for r in s.running):
            break
    waited = {r.request_id for r in s.running if r.decode_deferrals}
    assert not waited
    s.add_request(req("chat-new", 20, max_tokens=8, priority=5, cls="interactive", base=70_000))
    out = step(s)
    ids = {r.request_id for r in out.scheduled}
    assert {"chat-0", "chat-1", "chat-new"} <= ids
    assert waited <= ids, "a summary waited two steps running"
    summaries = {rid for rid in ids if rid.startswith("summary")}
    left_out = {f"summary-{i}" for i in range(3)} - summaries
    assert left_out and out.bound_by == "time_budget"
    # What the rows that did not wait the step before add: within the share.
    allowance = share * true_seconds(shape_of(out, "chat"))
    added = 5.5e-3 * len(summaries - waited)  # a row 1.5 ms + 2,000 x 2 us of context
    assert added <= allowance * 1.05
    assert added + 5.5e-3 > allowance * 0.95, "a summary that fit was left out"
    assert left_out <= {r.request_id for r in step(s).scheduled}


def test_without_a_share_a_chats_prompt_step_takes_every_summary_row() -> None:
    s = scheduler(None)
    chats_and_summaries_decoding(s)
    s.add_request(req("chat-new", 20, max_tokens=8, priority=5, cls="interactive", base=70_000))
    assert len(step(s).scheduled) == 6


def test_a_summarys_prefill_pauses_at_the_chats_interval() -> None:
    s = scheduler(0.5)
    s.add_request(req("chat", 100, max_tokens=64, priority=5, cls="interactive"))
    step(s)
    s.add_request(req("summary", 2000, max_tokens=4, priority=10, cls="batch", base=9000))
    out = s.schedule(interleave=True)
    assert [r.request_id for r in out.scheduled] == ["summary"]  # the chat left out
    alone = chats_alone_s(s)
    assert out.decode_interval_s == pytest.approx(min(TARGET_S, 1.5 * alone), rel=0.05)
    # Without the share, at the chats' target.
    t = scheduler(None)
    t.add_request(req("chat", 100, max_tokens=64, priority=5, cls="interactive"))
    step(t)
    t.add_request(req("summary", 2000, max_tokens=4, priority=10, cls="batch", base=9000))
    assert t.schedule(interleave=True).decode_interval_s == TARGET_S


@pytest.mark.parametrize("bad", [0, -0.5])
def test_a_share_of_zero_or_below_is_a_config_error_naming_the_key(bad: float) -> None:
    with pytest.raises(ConfigError, match="untimed_work_share"):
        load_config(None, {"scheduler.untimed_work_share": bad})


def scheduler_with_wait(share: float, max_wait_s: float) -> Scheduler:
    s = make(
        {
            **CLASSES,
            "scheduler.untimed_work_share": share,
            "scheduler.untimed_share_max_wait_s": max_wait_s,
        },
        num_blocks=1024,
    )
    s.cost = trained()
    return s


def chat_then_summary(s: Scheduler, summary_waited_s: float) -> float:
    """A chat decoding, then a summary (2,000 tokens) that arrived `summary_waited_s` ago:
    the interval the first step of its prefill pauses at for the chat."""
    s.add_request(req("chat", 100, max_tokens=64, priority=5, cls="interactive"))
    step(s)
    arrival = time.monotonic() - summary_waited_s
    s.add_request(
        req("summary", 2000, max_tokens=4, priority=10, cls="batch", base=9000, arrival=arrival)
    )
    out = s.schedule(interleave=True)
    assert [r.request_id for r in out.scheduled] == ["summary"]
    assert out.decode_interval_s is not None
    return out.decode_interval_s


def test_a_summary_overdue_for_its_first_token_suspends_the_share() -> None:
    """Past scheduler.untimed_share_max_wait_s without a first token, a summary's prefill
    pauses at the chats' target, as without a share; within it, at the share's interval."""
    fresh = scheduler_with_wait(0.5, max_wait_s=4.0)
    interval = chat_then_summary(fresh, summary_waited_s=1.0)
    assert interval == pytest.approx(min(TARGET_S, 1.5 * chats_alone_s(fresh)), rel=0.05)
    assert interval < TARGET_S * 0.5
    assert fresh.counters.untimed_share_suspended_steps == 0
    overdue = scheduler_with_wait(0.5, max_wait_s=4.0)
    assert chat_then_summary(overdue, summary_waited_s=5.0) == TARGET_S
    assert overdue.untimed_share is None
    assert overdue.counters.untimed_share_suspended_steps == 1


def test_the_share_returns_once_the_overdue_summary_has_its_first_token() -> None:
    s = scheduler_with_wait(0.5, max_wait_s=4.0)
    chat_then_summary(s, summary_waited_s=5.0)
    suspended = 0
    while s.requests["summary"].num_output_tokens == 0:
        out = s.schedule()
        suspended += s.untimed_share is None
        s.update_from_output(out, {r.request_id: 1 for r in out.scheduled if r.sample})
    assert suspended >= 1
    step(s)
    assert s.untimed_share == 0.5
    chat = [r for r in s.running if r.priority_class == "interactive"]
    assert s.token_interval_s(chat) == pytest.approx(1.5 * chats_alone_s(s), rel=0.05)


def test_a_chat_waiting_long_does_not_suspend_the_share() -> None:
    """Only classes without a TPOT target (the work the share holds back) count: a chat held
    in the queue is admission's business, not a sign the summaries fall behind."""
    s = scheduler_with_wait(0.5, max_wait_s=4.0)
    s.hold_class("interactive", True)
    s.add_request(req("held", 100, priority=5, cls="interactive", arrival=time.monotonic() - 30.0))
    step(s)
    assert s.untimed_share == 0.5
    assert s.counters.untimed_share_suspended_steps == 0


def test_decode_rows_are_deferred_only_while_the_share_is_in_force() -> None:
    s = scheduler_with_wait(0.5, max_wait_s=4.0)
    chats_and_summaries_decoding(s)
    before = s.counters.deferred_decode_rows
    step(s)
    assert s.counters.deferred_decode_rows > before  # the share leaves summary rows out
    # A summary that waits for a free sequence slot past the limit: the share is suspended,
    # and every row decodes every step.
    s.hold_class("batch", True)
    s.add_request(
        req("late", 2000, priority=10, cls="batch", base=90_000, arrival=time.monotonic() - 9.0)
    )
    for _ in range(4):
        assert len(step(s).scheduled) == 5
    assert s.counters.untimed_share_suspended_steps == 4


@pytest.mark.parametrize("bad", [0, -1.0])
def test_a_max_wait_of_zero_or_below_is_a_config_error_naming_the_key(bad: float) -> None:
    with pytest.raises(ConfigError, match="untimed_share_max_wait_s"):
        load_config(None, {"scheduler.untimed_share_max_wait_s": bad})
