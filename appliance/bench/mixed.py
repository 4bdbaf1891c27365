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
    # Real-time requests added, and how many of them produced a first token (their TTFT).
    realtime_requests: int
    realtime_ttft_measured: int
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
    rt_len, rt_max = ns.realtime_prompt_len, ns.realtime_max_tokens
    batch_len = ns.batch_prompt_len
    t = 0.0
    out = []
    for _ in range(ns.num_requests):
        t += rng.expovariate(ns.rate)
        if rng.random() < ns.realtime_share:
            # Defaults: prompts of 64 +- 12 tokens (at least 8), 32-128 tokens out.
            n = max(min(8, rt_len), int(rng.gauss(rt_len, rt_len * 3 / 16)))
            out_len = rng.randint(max(1, rt_max // 4), rt_max)
            params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0)
            cls = "realtime"
        else:
            # Defaults: prompts of 1,500 +- 150 tokens (at least 64), 512 tokens out.
            n = max(min(64, batch_len), int(rng.gauss(batch_len, batch_len / 10)))
            params = SamplingParams(
                max_tokens=ns.batch_output_len, ignore_eos=True, temperature=0.0
            )
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
    # (request id, arrival time, class) per request added.
    added: list[tuple[str, float, str]] = []
    # The request record keeps no first-token time: the engine's outputs tell when each
    # request's first token came out of step(), as a caller would see it.
    first_token_at: dict[str, float] = {}
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
            added.append((req.request_id, req.arrival_time, a.priority_class))
        if not engine.has_unfinished():
            time.sleep(min(0.01, max(0.0, pending[0].at - now)))
            continue
        for out in engine.step():
            stamp = time.monotonic()
            outputs += len(out.new_token_ids)
            if out.new_token_ids and out.request_id not in first_token_at:
                first_token_at[out.request_id] = stamp
            if out.finished:
                finished_at[out.request_id] = stamp
    seconds = time.monotonic() - start
    rt = [(rid, at) for rid, at, c in added if c == "realtime"]
    batch = [(rid, at) for rid, at, c in added if c == "batch"]
    ttft = [first_token_at[rid] - at for rid, at in rt if rid in first_token_at]
    e2e_rt = [finished_at[rid] - at for rid, at in rt if rid in finished_at]
    e2e_batch = [finished_at[rid] - at for rid, at in batch if rid in finished_at]
    counters = engine.stats().counters
    return MixedResult(
        policy=policy,
        preemption_mode=mode,
        realtime_ttft_p50_s=percentile(ttft, 50),
        realtime_ttft_p99_s=percentile(ttft, 99),
        realtime_e2e_p99_s=percentile(e2e_rt, 99),
        batch_e2e_p50_s=percentile(e2e_batch, 50),
        output_tokens_per_s=outputs / seconds,
        realtime_requests=len(rt),
        realtime_ttft_measured=len(ttft),
        preemptions=counters.preemptions,
        swap_fallbacks=counters.swap_fallbacks,
        tokens_recomputed=counters.tokens_recomputed,
        seconds=seconds,
    )


def run_mixed(ns: argparse.Namespace, loaded: LoadedModel, overrides: dict[str, Any]) -> int:
    overrides = dict(overrides)
    if "cache.num_blocks" not in overrides:
        # Room for about `pool_long_requests` long requests: preemption must happen. A long
        # request counted at 1.33 sigma above the mean prompt (1,700 tokens at the default).
        long_tokens = ns.batch_prompt_len + ns.batch_prompt_len * 2 // 15 + ns.batch_output_len
        per_long = -(-long_tokens // loaded.block_size)
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
        f"{'mode':<10} {'policy':<9} {'RT TTFT n':>10} {'RT TTFT p50':>12} {'RT TTFT p99':>12} "
        f"{'RT e2e p99':>11} "
        f"{'batch e2e p50':>14} {'out tok/s':>10} {'preempt':>8} {'fallback':>9} {'recomputed':>11}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.preemption_mode:<10} {r.policy:<9} "
            f"{f'{r.realtime_ttft_measured}/{r.realtime_requests}':>10} "
            f"{r.realtime_ttft_p50_s:>11.2f}s "
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
        help="KV pool size in long requests (batch prompt + output, 1,700 + 512 tokens by "
        "default) unless cache.num_blocks is set",
    )
    # Request sizes; the defaults are the profile's own, smaller ones make a quick check.
    g.add_argument("--realtime-prompt-len", type=int, default=64, help="mean real-time prompt")
    g.add_argument(
        "--realtime-max-tokens", type=int, default=128, help="real-time output: 1/4 to all of it"
    )
    g.add_argument("--batch-prompt-len", type=int, default=1500, help="mean batch prompt")
    g.add_argument("--batch-output-len", type=int, default=512, help="batch output tokens")
