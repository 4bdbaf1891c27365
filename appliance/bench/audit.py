"""`bench serve --audit`: what an overload soak must show, besides throughput.

- Every request's outcome: completed, or refused with 429/503 *and* a Retry-After header; what
  else came back (a refusal without Retry-After, a stream error, a client timeout) is listed.
- Nothing hung: a refusal later than its class's queue_timeout_s + GRACE_S, or a completed
  request whose first token came later than that limit + GRACE_S, counts as late (a request
  started before its limit may still take a few steps to its first token: the grace).
- No KV blocks leaked: once the load is gone the engine holds no request and no used block.
- RSS flat: the API and engine-core processes' resident memory sampled during the run (psutil,
  on the server's box: the bench must run there). The baseline is the first sample, taken
  before the load with the core idle: past its warm-up, since the core fills its bounded matmul
  primitive caches at load (appliance.cpu.primitive_cache) and returns freed heap to the OS
  whenever it goes idle (appliance.engine.heap). The last sample is taken once the load is
  gone and the core idle again, so the two compare like with like; `max` is the working set
  under load (a step's activations, heap not yet returned).

The classes' limits and the process ids come from /admin/stats (loopback, or --admin-token).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

GRACE_S = 5.0
SAMPLE_EVERY_S = 10.0
IDLE_TIMEOUT_S = 60.0
IDLE_SETTLE_S = 2.0


@dataclass
class Outcome:
    """One request as the audit sees it."""

    priority_class: str
    status: int | str
    retry_after: bool
    # Seconds from the scheduled arrival to the refusal, or to the first token when served.
    answered_s: float | None


def classify(o: Outcome) -> str:
    if o.status == 200:
        return "completed"
    if o.status in (429, 503):
        return (
            f"{o.status} with Retry-After" if o.retry_after else f"{o.status} WITHOUT Retry-After"
        )
    return f"other: {o.status}"


def late(o: Outcome, limits: dict[str, float]) -> float | None:
    """Seconds past the class's limit + grace (None: on time, or no limit known)."""
    limit = limits.get(o.priority_class) or 0.0
    if not limit or o.answered_s is None:
        return None
    over = o.answered_s - (limit + GRACE_S)
    return over if over > 0 else None


@dataclass
class ServerAudit:
    base_url: str
    headers: dict[str, str]
    limits: dict[str, float] = field(default_factory=dict)
    default_class: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    rss: dict[str, list[int]] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    async def _stats(
        self, client: httpx.AsyncClient, count_objects: bool = False
    ) -> dict[str, Any]:
        params = {"count_objects": "true"} if count_objects else {}
        r = await client.get(
            self.base_url + "/admin/stats", headers=self.headers, params=params, timeout=30
        )
        r.raise_for_status()
        return r.json()

    async def start(self, client: httpx.AsyncClient) -> None:
        s = await self._stats(client)
        self.limits = {q["priority_class"]: q["queue_timeout_s"] for q in s["queues"]}
        self.pids = {"api": s["server"]["pid"]}
        if s["server"].get("core_pid"):
            self.pids["core"] = s["server"]["core_pid"]
        self._sample()
        self._task = asyncio.create_task(self._sampler())

    def _sample(self) -> None:
        import psutil

        for name, pid in self.pids.items():
            try:
                self.rss.setdefault(name, []).append(psutil.Process(pid).memory_info().rss)
            except psutil.Error:  # another box, or gone: no figure rather than a wrong one
                pass

    async def _sampler(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_EVERY_S)
            self._sample()

    async def finish(self, client: httpx.AsyncClient, outcomes: list[Outcome]) -> dict[str, Any]:
        if self._task is not None:
            self._task.cancel()
        # The load is over: wait for the engine to let go of everything.
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            s = await self._stats(client)
            eng = s.get("engine") or {}
            idle = not s["requests"] and eng.get("blocks_used", 0) == 0
            if idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        # Per-request objects still alive in the engine process (after a gc pass there).
        objects = (await self._stats(client, count_objects=True)).get("engine_objects", {})
        # The core returns freed heap when it goes idle: give it the moment to (it polls its
        # pipe every second when idle), so the last sample is an idle one like the first.
        await asyncio.sleep(IDLE_SETTLE_S)
        self._sample()
        counts: dict[str, int] = {}
        for o in outcomes:
            counts[classify(o)] = counts.get(classify(o), 0) + 1
        lates = [x for o in outcomes if (x := late(o, self.limits)) is not None]
        # Refusals and first tokens apart: a refusal must come at the limit (the timer); a
        # request started before it may take a few slow steps to its first token.
        answered: dict[str, dict[str, Any]] = {}
        for kind in ("completed", "refused"):
            mine = [o for o in outcomes if (o.status == 200) == (kind == "completed")]
            over = [x for o in mine if (x := late(o, self.limits)) is not None]
            times = [o.answered_s for o in mine if o.answered_s is not None]
            answered[kind] = {"late": len(over), "max_s": round(max(times), 2) if times else None}
        rss = {
            name: {
                "first_mib": round(v[0] / 2**20, 1),
                "last_mib": round(v[-1] / 2**20, 1),
                "max_mib": round(max(v) / 2**20, 1),
                # Idle before the load -> idle after it: what a leak or a cache without a bound
                # would show.
                "change_pct": round((v[-1] - v[0]) / v[0] * 100, 2),
                "max_change_pct": round((max(v) - v[0]) / v[0] * 100, 2),
                "samples": len(v),
                "series_mib": [round(x / 2**20, 1) for x in v],
            }
            for name, v in self.rss.items()
            if v
        }
        return {
            "outcomes": counts,
            "limits_s": self.limits,
            "late": {
                "count": len(lates),
                "max_over_s": round(max(lates), 2) if lates else 0.0,
                "grace_s": GRACE_S,
                **answered,
            },
            "idle_after": {
                "engine_requests": len(s["requests"]),
                "blocks_used": eng.get("blocks_used"),
                "blocks_cached": eng.get("blocks_cached"),
                "api_requests_tracked": s["server"].get("requests_tracked"),
                "api_in_flight": s["server"].get("requests_in_flight"),
                "engine_objects": objects,
            },
            "rss": rss,
        }


def print_audit(a: dict[str, Any]) -> None:
    print("\naudit:")
    print(f"  outcomes: {a['outcomes']}")
    lt = a["late"]
    print(
        f"  late past class limit + {lt['grace_s']:.0f} s: {lt['count']} "
        f"(max {lt['max_over_s']:.2f} s over); limits {a['limits_s']}"
    )
    for kind, what in (("refused", "refusal came"), ("completed", "first token came")):
        k = lt[kind]
        print(f"    {kind}: {k['late']} late; latest {what} after {k['max_s']} s")
    i = a["idle_after"]
    print(
        f"  after the load: engine requests {i['engine_requests']}, KV blocks used "
        f"{i['blocks_used']} (cached free {i['blocks_cached']}), API tracked "
        f"{i['api_requests_tracked']}, in flight {i['api_in_flight']}; live engine objects "
        f"{i['engine_objects']}"
    )
    for name, r in a["rss"].items():
        print(
            f"  RSS {name}: idle before -> idle after the load {r['first_mib']} -> "
            f"{r['last_mib']} MiB ({r['change_pct']:+.2f}%), max under load {r['max_mib']} "
            f"MiB ({r['max_change_pct']:+.2f}%), {r['samples']} samples"
        )
