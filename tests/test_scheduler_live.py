"""Live knobs and class holds in the scheduler alone (fake model: every token is 1): a change
made between two steps binds the next one, a lowered max_num_seqs evicts nobody, and a held
class's queue waits while other classes are admitted. Pure Python, milliseconds."""

from __future__ import annotations

from test_scheduler import make, req, run_all, step

from appliance.config import load_config
from appliance.core.scheduler import Scheduler
from appliance.core.scheduler_output import SchedulerOutput


def test_lowered_max_num_seqs_binds_admissions_and_preempts_nobody() -> None:
    s = make({"scheduler.max_num_seqs": 4})
    for i in range(6):
        s.add_request(req(f"r{i}", 10, max_tokens=6 + i, base=100 * i))
    assert len(step(s).scheduled) == 4
    s.reconfigure(load_config(None, {"scheduler.max_num_seqs": 1}))
    seqs = [len(out.scheduled) for out in run_all(s)]
    # The four running ones finish one by one; nothing new starts until one is left.
    assert seqs[:3] == [4, 4, 4] and seqs[-1] == 1
    for before, after in zip(seqs, seqs[1:], strict=False):
        assert after <= before or after <= 1
    assert s.counters.preemptions == 0
    finished = {f.request.request_id: f.request.num_output_tokens for f in s.take_finished()}
    assert finished == {f"r{i}": 6 + i for i in range(6)}


def test_raised_token_budget_applies_at_the_next_step() -> None:
    s = make({"scheduler.max_num_batched_tokens": 32})
    s.add_request(req("long", 200, max_tokens=2))
    assert step(s).num_scheduled_tokens == 32
    s.reconfigure(load_config(None, {"scheduler.max_num_batched_tokens": 100}))
    assert step(s).num_scheduled_tokens == 100


def test_held_class_waits_while_others_are_admitted() -> None:
    s = make()
    s.hold_class("batch", True)
    s.add_request(req("b", 8, max_tokens=3, cls="batch"))
    s.add_request(req("i", 8, max_tokens=3, cls="interactive", base=50))
    outs = run_all_until_idle(s)
    assert {r.request_id for out in outs for r in out.scheduled} == {"i"}
    assert [r.request_id for r in s.waiting] == ["b"]
    s.hold_class("batch", False)
    assert [r.request_id for r in step(s).scheduled] == ["b"]


def run_all_until_idle(s: Scheduler, limit: int = 50) -> list[SchedulerOutput]:
    """Steps until nothing is scheduled (a held queue never empties)."""
    outs = []
    for _ in range(limit):
        out = step(s)
        if not out.scheduled:
            return outs
        outs.append(out)
    raise AssertionError("still scheduling")
