"""A class's first-token goal (priority_classes.X.ttft_goal_s) stretches the token interval of the
classes decoding toward their tpot_ceiling_ms (core/first_token_goal.py): the share of the box
the queued prefills need is their cost, by the step cost model, over the seconds left to each
goal; the interval leaves the prefill that share after the chats' step, never past the ceiling.
Against the synthetic box of test_step_cost, whose costs the test knows."""

from __future__ import annotations

import time
from typing import Any

import pytest

from appliance.config import ConfigError, load_config
from appliance.core.first_token_goal import GoalPlan, plan_goals, stretched_interval_s
from appliance.core.scheduler import Scheduler
from appliance.core.step_cost import StepShape
from tests.test_scheduler import make, req, step
from tests.test_step_cost import trained, true_seconds
from tests.test_untimed_share import chats_alone_s

TARGET_S = 0.035
CEILING_S = 0.100
GOAL_S = 10.0
SUMMARY = 2000
CLASSES: dict[str, Any] = {
    "scheduler.policy": "priority",
    "priority_classes.interactive.priority": 5,
    "priority_classes.interactive.tpot_slo_ms": TARGET_S * 1e3,
    "priority_classes.interactive.tpot_ceiling_ms": CEILING_S * 1e3,
    "priority_classes.batch.priority": 10,
    "priority_classes.batch.ttft_goal_s": GOAL_S,
    "scheduler.max_num_batched_tokens": 4096,
}


def scheduler(overrides: dict[str, Any] | None = None) -> Scheduler:
    s = make({**CLASSES, **(overrides or {})}, num_blocks=2048)
    s.cost = trained()  # a prefill token 0.8 ms, a pair 3 ns, a decode row 1.5 ms, ...
    return s


def summary_s(start: int = 0, tokens: int = SUMMARY) -> float:
    return true_seconds(StepShape().with_chunk(start, tokens))


def summary(i: int, arrived: float) -> Any:
    return req(
        f"summary-{i}",
        SUMMARY,
        max_tokens=4,
        priority=10,
        cls="batch",
        base=10_000 * i,
        arrival=arrived,
    )


def chat_decoding(s: Scheduler) -> None:
    s.add_request(req("chat", 100, max_tokens=64, priority=5, cls="interactive"))
    step(s)
    assert s.running[0].num_tokens - s.running[0].num_computed_tokens == 1


def need(s: Scheduler, now: float) -> float | None:
    return plan_goals(s, now).need


def test_the_share_needed_is_the_prefill_ahead_over_the_time_left_to_each_goal() -> None:
    s = scheduler()
    now = 1000.0
    one = summary_s()  # ~1.63 s on the synthetic box
    # Waited 8 s (2 s left, its own prompt: 0.82 of the box), 7 s (3 s left behind the first's
    # prompt and its own: it misses even with the whole box, and yields its turn) and 1 s (9 s
    # left for the first's prompt and its own: 0.36).
    for i, waited in enumerate([8.0, 7.0, 1.0]):
        s.add_request(summary(i, now - waited))
    plan = plan_goals(s, now)
    assert plan.need == pytest.approx(one / 2.0, rel=0.05)
    assert plan.yielding == {"summary-1"}
    # Without the first, the second can meet its goal again: its own prompt in 3 s (0.54),
    # the third's two in 9 s (0.36).
    s.abort("summary-0")
    plan = plan_goals(s, now)
    assert plan.need == pytest.approx(one / 3.0, rel=0.05)
    assert plan.yielding == frozenset()


def test_a_request_past_its_goal_yields_its_turn_until_it_has_waited_twice_its_goal() -> None:
    s = scheduler()
    now = 1000.0
    s.add_request(summary(0, now - 12.0))  # past its goal: stretching helps it no more
    assert plan_goals(s, now) == GoalPlan(None, frozenset({"summary-0"}))
    s.add_request(summary(1, now - 6.0))  # 4 s left; the first is served after it
    assert need(s, now) == pytest.approx(summary_s() / 4.0, rel=0.05)
    # Twice its goal: it takes its turn again, and its prompt counts before the second's.
    assert "summary-0" not in plan_goals(s, now + 8.5).yielding
    t = scheduler()
    t.add_request(summary(0, now - 2 * GOAL_S - 1.0))
    t.add_request(summary(1, now - 6.0))
    assert need(t, now) == pytest.approx(2 * summary_s() / 4.0, rel=0.05)


def test_the_summary_that_can_still_meet_its_goal_is_admitted_first() -> None:
    s = scheduler({"scheduler.max_num_batched_tokens": SUMMARY})  # one prompt a step
    now = time.monotonic()
    s.add_request(summary(0, now - GOAL_S + 0.5))  # 0.5 s left for a 1.63 s prompt
    s.add_request(summary(1, now))
    assert [r.request_id for r in step(s).scheduled] == ["summary-1"]
    # The next step: its token, and the other's prompt.
    assert [r.request_id for r in step(s).scheduled] == ["summary-1", "summary-0"]
    # Without a goal, in arrival order.
    t = scheduler(
        {"scheduler.max_num_batched_tokens": SUMMARY, "priority_classes.batch.ttft_goal_s": None}
    )
    t.add_request(summary(0, now - GOAL_S + 0.5))
    t.add_request(summary(1, now))
    assert [r.request_id for r in step(t).scheduled] == ["summary-0"]


def test_no_goal_no_share_needed() -> None:
    s = scheduler({"priority_classes.batch.ttft_goal_s": None})
    now = 1000.0
    s.add_request(summary(0, now - 8.0))
    assert plan_goals(s, now) == GoalPlan()


def test_a_prompt_being_prefilled_counts_its_remaining_tokens_only() -> None:
    s = scheduler({"scheduler.max_num_batched_tokens": 1024})
    now = time.monotonic()
    s.add_request(summary(0, now - 5.0))
    step(s)  # its first 1,024 tokens
    left = s.running[0].arrival_time + GOAL_S - time.monotonic()
    assert need(s, time.monotonic()) == pytest.approx(
        summary_s(1024, SUMMARY - 1024) / left, rel=0.05
    )


@pytest.mark.parametrize("need", [None, 0.0, 0.5, 0.9, 0.99, 1.0, 1.5])
def test_the_interval_leaves_the_prefill_that_share_between_the_target_and_the_ceiling(
    need: float | None,
) -> None:
    s = scheduler()
    chat_decoding(s)
    chats = list(s.running)
    step_s = chats_alone_s(s)  # ~5.7 ms
    interval = stretched_interval_s(s, chats, TARGET_S, need)
    if need is None:
        assert interval == TARGET_S
        return
    expected = CEILING_S if need >= 1 else min(max(TARGET_S, step_s / (1 - need)), CEILING_S)
    assert interval == pytest.approx(expected, rel=0.05)
    assert TARGET_S <= interval <= CEILING_S
    if TARGET_S < interval < CEILING_S:  # what it leaves the prefill is the share needed
        assert (interval - step_s) / interval == pytest.approx(need, abs=0.01)


def test_a_class_without_a_ceiling_is_never_stretched() -> None:
    s = scheduler({"priority_classes.interactive.tpot_ceiling_ms": None})
    chat_decoding(s)
    assert stretched_interval_s(s, list(s.running), TARGET_S, 0.99) == TARGET_S


def paused_interval(s: Scheduler, summary_waited_s: float) -> float | None:
    """A chat decoding, then a summary that arrived `summary_waited_s` ago: the interval the
    first step of its prefill pauses at for the chat."""
    chat_decoding(s)
    s.add_request(summary(0, time.monotonic() - summary_waited_s))
    out = s.schedule(interleave=True)
    assert [r.request_id for r in out.scheduled] == ["summary-0"]  # the chat left out
    return out.decode_interval_s


def test_a_late_summary_stretches_the_chats_interval_and_a_fresh_one_does_not() -> None:
    fresh = scheduler()
    assert paused_interval(fresh, 0.0) == TARGET_S
    assert fresh.counters.tpot_stretched_steps == 0
    late = scheduler()
    # 1.63 s of prompt in the 1.8 s left: 0.9 of the box, so the chats' 5.7 ms step every
    # ~57 ms.
    interval = paused_interval(late, GOAL_S - 1.8)
    need = summary_s() / 1.8
    assert interval == pytest.approx(chats_alone_s(late) / (1 - need), rel=0.1)
    assert TARGET_S < interval < CEILING_S  # type: ignore[operator]
    assert late.counters.tpot_stretched_steps == 1
    # Past its goal: stretching would not get it there, so the chats keep their target.
    missed = scheduler()
    assert paused_interval(missed, GOAL_S + 1.0) == TARGET_S


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"priority_classes.interactive.tpot_ceiling_ms": 20.0}, "interactive.tpot_ceiling_ms"),
        ({"priority_classes.batch.tpot_ceiling_ms": 80.0}, "batch.tpot_ceiling_ms"),
        ({"priority_classes.batch.ttft_goal_s": 0.0}, "ttft_goal_s"),
        ({"priority_classes.interactive.tpot_ceiling_ms": -1.0}, "tpot_ceiling_ms"),
    ],
)
def test_bad_goal_and_ceiling_settings_name_their_key(overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(None, {**CLASSES, **overrides})


def test_the_cpu_demo_template_paces_for_the_summaries_goal() -> None:
    cfg = load_config("cpu-demo")
    assert cfg.ttft_goal_s("batch") == 10.0
    interactive = cfg.tpot_ceiling_s("interactive")
    target = cfg.tpot_slo_s("interactive")
    assert interactive is not None and target is not None and interactive > target
