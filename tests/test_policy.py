"""The scheduling policy objects on their own (queue order, victims, arrival preemption, static
batches, the API's classes ahead), and that the scheduler, the engine client and the API's
estimated-wait check all ask the object built by the one factory. Pure Python, milliseconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from appliance.config import PriorityClass, load_config
from appliance.core.kv_cache_manager import KVCacheManager
from appliance.core.policy import (
    PriorityPolicy,
    SchedulingPolicy,
    StaticPolicy,
    make_policy,
)
from appliance.core.request import Request
from appliance.core.scheduler import Scheduler
from appliance.engine.client import EngineClient
from appliance.sampling_params import SamplingParams
from appliance.server.errors import APIError
from appliance.server.prepare import check_estimated_wait

NAMES = ["continuous", "fcfs", "priority", "static"]


def policy(name: str, **overrides: object) -> SchedulingPolicy:
    sets = {"scheduler.policy": name, **{f"scheduler.{k}": v for k, v in overrides.items()}}
    return make_policy(load_config(None, sets).scheduler)


def req(rid: str, priority: int, arrival: float, preemptions: int = 0) -> Request:
    r = Request(
        rid, [1, 2, 3], SamplingParams(max_tokens=4), priority=priority, arrival_time=arrival
    )
    r.num_preemptions = preemptions
    return r


def item_13() -> list[Request]:
    # TESTS.md item 13: priorities [2, 1, 1, 0] arriving [1, 3, 2, 4].
    return [req(str(i), p, a) for i, (p, a) in enumerate([(2, 1), (1, 3), (1, 2), (0, 4)])]


def ids(reqs: list[Request]) -> list[str]:
    return [r.request_id for r in reqs]


def test_the_factory_maps_each_configured_name_to_one_class() -> None:
    assert type(policy("continuous")) is SchedulingPolicy
    assert type(policy("fcfs")) is SchedulingPolicy  # vLLM's name for arrival order
    assert type(policy("priority")) is PriorityPolicy
    assert type(policy("static")) is StaticPolicy


def test_priority_orders_the_queue_by_priority_then_arrival() -> None:
    assert ids(sorted(item_13(), key=policy("priority").queue_key)) == ["3", "2", "1", "0"]


@pytest.mark.parametrize("name", ["continuous", "fcfs", "static"])
def test_the_other_policies_order_the_queue_by_arrival(name: str) -> None:
    assert ids(sorted(item_13(), key=policy(name).queue_key)) == ["0", "2", "1", "3"]


@pytest.mark.parametrize("name", NAMES)
def test_the_victim_is_the_least_urgent_then_latest_under_every_policy(name: str) -> None:
    p = policy(name)
    running = item_13()
    # Least urgent is "0" (priority 2); of the two at priority 1, "1" arrived later.
    assert p.out_of_blocks_victim(running[3], running).request_id == "0"
    assert p.out_of_blocks_victim(running[3], running[1:]).request_id == "1"
    # Budget goes the other way round: the most urgent first.
    assert ids(p.serve_order(running)) == ["3", "2", "1", "0"]


def test_a_protected_request_is_no_victim_except_of_its_own_need() -> None:
    p = policy("priority", max_preemptions_per_request=2)
    urgent, lazy = req("u", 0, 1.0), req("l", 9, 2.0, preemptions=2)
    assert p.is_protected(lazy) and not p.is_protected(urgent)
    # `urgent` needs blocks: the protected `lazy` is spared, so `urgent` gives way itself.
    assert p.out_of_blocks_victim(urgent, [urgent, lazy]) is urgent
    # Protected `lazy` needs blocks: still the least urgent candidate, it gives back its own.
    assert p.out_of_blocks_victim(lazy, [urgent, lazy]) is lazy
    # A protected request in need takes from unprotected, less urgent work as anyone would.
    guarded, batch = req("g", 0, 1.0, preemptions=2), req("b", 10, 0.5)
    assert p.out_of_blocks_victim(guarded, [guarded, batch]) is batch


@pytest.mark.parametrize("name", ["continuous", "fcfs", "static"])
def test_arrivals_never_preempt_under_arrival_order(name: str) -> None:
    p = policy(name)
    urgent, running = req("u", 0, 5.0), [req("b", 10, 1.0)]
    for cause in ("max_num_seqs", "kv_pressure"):
        assert not p.arrival_may_preempt(cause, pressure_steps=1000)
        assert p.arrival_victim(urgent, running, cause, pressure_steps=1000) is None


def test_under_priority_an_arrival_preempts_at_once_for_a_seat_and_after_patience_for_blocks() -> (
    None
):
    p = policy("priority", preemption_patience_steps=4)
    assert p.arrival_may_preempt("max_num_seqs", pressure_steps=0)
    assert not p.arrival_may_preempt("kv_pressure", pressure_steps=3)
    assert p.arrival_may_preempt("kv_pressure", pressure_steps=4)
    urgent, batch = req("u", 0, 5.0), req("b", 10, 1.0)
    assert p.arrival_victim(urgent, [batch], "kv_pressure", pressure_steps=3) is None
    assert p.arrival_victim(urgent, [batch], "kv_pressure", pressure_steps=4) is batch


def test_an_arrival_preempts_only_strictly_less_urgent_unprotected_work() -> None:
    # TESTS.md item 16: never the reverse, and not an equal either.
    p = policy("priority", max_preemptions_per_request=3)
    mid = req("m", 5, 5.0)
    assert p.arrival_victim(mid, [req("u", 0, 1.0)], "max_num_seqs", 0) is None
    assert p.arrival_victim(mid, [req("e", 5, 1.0)], "max_num_seqs", 0) is None
    assert p.arrival_victim(mid, [req("p", 9, 1.0, preemptions=3)], "max_num_seqs", 0) is None
    older, newer = req("o", 9, 1.0), req("n", 9, 2.0)
    assert p.arrival_victim(mid, [older, newer, req("u", 0, 0.5)], "max_num_seqs", 0) is newer


@pytest.mark.parametrize("name", NAMES)
def test_only_static_holds_admissions_while_its_batch_runs(name: str) -> None:
    p = policy(name)
    assert p.may_admit(batch_running=False)
    assert p.may_admit(batch_running=True) is (name != "static")


CLASSES = {
    "realtime": PriorityClass(priority=0),
    "interactive": PriorityClass(priority=5),
    "batch": PriorityClass(priority=10),
}


def test_the_classes_ahead_under_priority_are_the_equally_or_more_urgent() -> None:
    p = policy("priority")
    assert p.classes_ahead(CLASSES, "realtime") == ["realtime"]
    assert p.classes_ahead(CLASSES, "interactive") == ["realtime", "interactive"]
    assert p.classes_ahead(CLASSES, "batch") == ["realtime", "interactive", "batch"]
    # A class the config does not name waits behind everything, itself included.
    assert p.classes_ahead(CLASSES, "0") == ["realtime", "interactive", "batch", "0"]
    assert p.counts_ahead(5, 5) and p.counts_ahead(0, 5) and not p.counts_ahead(10, 5)


@pytest.mark.parametrize("name", ["continuous", "fcfs", "static"])
def test_the_classes_ahead_under_arrival_order_are_all(name: str) -> None:
    p = policy(name)
    assert p.classes_ahead(CLASSES, "realtime") == ["realtime", "interactive", "batch"]
    assert p.counts_ahead(10, 0)


@pytest.mark.parametrize("name", NAMES)
def test_the_scheduler_and_the_engine_client_build_the_same_policy(name: str) -> None:
    cfg = load_config(None, {"scheduler.policy": name})
    sched = Scheduler(cfg, KVCacheManager(16, 16, True, 0), max_model_len=256)
    client = EngineClient(cfg)
    assert type(sched.policy) is type(client.policy) is type(make_policy(cfg.scheduler))
    for cls in CLASSES:
        assert sched.policy.classes_ahead(CLASSES, cls) == client.policy.classes_ahead(CLASSES, cls)


def _state(policy_name: str) -> tuple[SimpleNamespace, EngineClient]:
    """A ServerState's parts the estimated-wait check reads, around a real (unstarted) client
    whose core reported 4 requests waiting in each class, every seat taken, 1 departure/s."""
    cfg = load_config(
        None,
        {
            "scheduler.policy": policy_name,
            "scheduler.max_num_seqs": 2,
            "scheduler.estimated_wait_admission": True,
            "scheduler.queue_timeout_s": 6.0,
        },
    )
    client = EngineClient(cfg)
    client.waiting_by_class = {"realtime": 4, "interactive": 4, "batch": 4}
    client.num_running = 2
    client.departure_rate = 1.0
    rejected: list[str] = []
    metrics = SimpleNamespace(count_rejection=lambda reason, cls: rejected.append(cls))
    return SimpleNamespace(config=cfg, client=client, metrics=metrics, rejected=rejected), client


def test_the_api_estimated_wait_check_asks_the_clients_policy_object() -> None:
    state, client = _state("priority")
    # Priority: only realtime's 4 are ahead of a realtime arrival, a 5 s wait under 6 s.
    check_estimated_wait(state, "realtime")  # type: ignore[arg-type]
    with pytest.raises(APIError) as exc:  # interactive waits behind 8: 9 s
        check_estimated_wait(state, "interactive")  # type: ignore[arg-type]
    assert exc.value.status == 429 and "8 requests queued ahead" in str(exc.value)

    # Give the client another policy object: the check follows it (no copy of the rule).
    class EverythingAhead(PriorityPolicy):
        def counts_ahead(self, other_priority: int, mine: int) -> bool:
            return True

    client.policy = EverythingAhead(state.config.scheduler)
    with pytest.raises(APIError) as exc:
        check_estimated_wait(state, "realtime")  # type: ignore[arg-type]
    assert "12 requests queued ahead" in str(exc.value)
    assert state.rejected == ["interactive", "realtime"]


def test_under_arrival_order_the_api_counts_every_class_ahead() -> None:
    state, _ = _state("fcfs")
    with pytest.raises(APIError) as exc:
        check_estimated_wait(state, "realtime")  # type: ignore[arg-type]
    assert "12 requests queued ahead" in str(exc.value)
