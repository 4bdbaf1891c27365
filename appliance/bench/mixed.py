"""The `mixed` profile of `appliance bench offline`: real-time chat beside long batch work with
Poisson arrivals and a KV pool small enough that preemption happens; fcfs vs priority, swap vs
recompute."""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from appliance.config import load_config
from appliance.core.request import Request
from appliance.engine.llm_engine import Engine
from appliance.engine.loader import LoadedModel
from appliance.sampling_params import SamplingParams


@dataclass
class Arrival:
    at: float
    prompt: list[int]
    params: SamplingParams
    priority_class: str


@dataclass
class MixedResult:
    policy: str
    preemption_mode: str
    realtime_ttft_p50_s: float
    realtime_ttft_p99_s: float
    realtime_e2e_p99_s: float
    batch_e2e_p50_s: float
    output_tokens_per_s: float
    preemptions: int
    swap_fallbacks: int
    tokens_recomputed: int
    seconds: float


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def make_arrivals(vocab: int, ns: argparse.Namespace) -> list[Arrival]:
    rng = random.Random(ns.seed)
    t = 0.0
    out = []
    for _ in range(ns.num_requests):
        t += rng.expovariate(ns.rate)
        if rng.random() < ns.realtime_share:
            n = max(8, int(rng.gauss(64, 12)))
            params = SamplingParams(max_tokens=rng.randint(32, 128), ignore_eos=True, temperature=0.0)
            cls = "realtime"
        else:
            n = max(64, int(rng.gauss(1500, 150)))
            params = SamplingParams(max_tokens=512, ignore_eos=True, temperature=0.0)
            cls = "batch"
        out.append(Arrival(t, [rng.randrange(16, vocab) for _ in range(n)], params, cls))
    return out


def run_one(
    loaded: LoadedModel,
    template: str,
    overrides: dict[str, Any],
    arrivals: list[Arrival],
    policy: str,
    mode: str,
) -> MixedResult:
    cfg_overrides = dict(overrides)
    cfg_overrides["scheduler.policy"] = policy
    cfg_overrides["scheduler.preemption_mode"] = mode
    engine = Engine(load_config(template, cfg_overrides), loaded=loaded)
    pending = list(arrivals)
    requests: list[tuple[Request, str]] = []
    finished_at: dict[str, float] = {}
    start = time.monotonic()
    outputs = 0
    while pending or engine.has_unfinished():
        now = time.monotonic() - start
        while pending and pending[0].at <= now:
            a = pending.pop(0)
            req = engine.add_request(
                a.prompt, a.params, priority=a.priority_class, arrival_time=start + a.at
            )
            requests.append((req, a.priority_class))
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(0.0, pending[0].at - now)))
            continue
        for out in engine.step():
            outputs += len(out.new_token_ids)
            if out.finished:
                finished_at[out.request_id] = time.monotonic()
    seconds = time.monotonic() - start
    rt = [r for r, c in requests if c == "realtime"]
    batch = [r for r, c in requests if c == "batch"]
    ttft = [r.first_token_time - r.arrival_time for r in rt if r.first_token_time]
    e2e_rt = [finished_at[r.request_id] - r.arrival_time for r in rt if r.request_id in finished_at]
    e2e_batch = [
        finished_at[r.request_id] - r.arrival_time for r in batch if r.request_id in finished_at
    ]
    counters = engine.stats().counters
    return MixedResult(
        policy=policy,
        preemption_mode=mode,
        realtime_ttft_p50_s=percentile(ttft, 50),
        realtime_ttft_p99_s=percentile(ttft, 99),
        realtime_e2e_p99_s=percentile(e2e_rt, 99),
        batch_e2e_p50_s=percentile(e2e_batch, 50),
        output_tokens_per_s=outputs / seconds,
        preemptions=counters.preemptions,
        swap_fallbacks=counters.swap_fallbacks,
        tokens_recomputed=counters.tokens_recomputed,
        seconds=seconds,
    )


def run_mixed(ns: argparse.Namespace, loaded: LoadedModel, overrides: dict[str, Any]) -> int:
    overrides = dict(overrides)
    if "cache.num_blocks" not in overrides:
        # Room for about `pool_long_requests` long requests: preemption must happen.
        per_long = -(-(1700 + 512) // loaded.block_size)
        overrides["cache.num_blocks"] = int(per_long * ns.pool_long_requests)
    arrivals = make_arrivals(loaded.args.vocab_size, ns)
    results = [
        run_one(loaded, ns.template, overrides, arrivals, policy, mode)
        for mode in ("recompute", "swap")
        for policy in ("fcfs", "priority")
    ]
    if ns.json:
        print(json.dumps({"profile": "mixed", "results": [asdict(r) for r in results]}))
        return 0
    print(
        f"mixed profile: {ns.num_requests} requests, {ns.realtime_share:.0%} real-time, "
        f"Poisson {ns.rate}/s, KV pool {overrides['cache.num_blocks']} blocks"
    )
    header = (
        f"{'mode':<10} {'policy':<9} {'RT TTFT p50':>12} {'RT TTFT p99':>12} {'RT e2e p99':>11} "
        f"{'batch e2e p50':>14} {'out tok/s':>10} {'preempt':>8} {'fallback':>9} {'recomputed':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.preemption_mode:<10} {r.policy:<9} {r.realtime_ttft_p50_s:>11.2f}s "
            f"{r.realtime_ttft_p99_s:>11.2f}s {r.realtime_e2e_p99_s:>10.2f}s "
            f"{r.batch_e2e_p50_s:>13.2f}s {r.output_tokens_per_s:>10.1f} {r.preemptions:>8} "
            f"{r.swap_fallbacks:>9} {r.tokens_recomputed:>11}"
        )
    for mode in ("recompute", "swap"):
        fcfs = next(r for r in results if r.policy == "fcfs" and r.preemption_mode == mode)
        prio = next(r for r in results if r.policy == "priority" and r.preemption_mode == mode)
        print(
            f"{mode}: priority cuts real-time P99 TTFT "
            f"{fcfs.realtime_ttft_p99_s / max(prio.realtime_ttft_p99_s, 1e-9):.1f}x at "
            f"{100 * (1 - prio.output_tokens_per_s / fcfs.output_tokens_per_s):+.1f}% throughput loss"
        )
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixed profile")
    g.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    g.add_argument("--realtime-share", type=float, default=0.8)
    g.add_argument(
        "--pool-long-requests",
        type=float,
        default=2.5,
        help="KV pool size in long requests (1,500 + 512 tokens) unless cache.num_blocks is set",
    )
