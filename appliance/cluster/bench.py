"""`appliance bench cluster`: one box, the same burst of chats through four setups, one after
the other: `appliance up` directly, then the cluster's ingress with 1 replica (all the cores),
2 replicas (half the cores each) routed by queue depth, and 2 replicas routed by prefix
affinity. The chats share a few system prompts (tenants), so where a request lands decides
whether its prompt hits a prefix cache. It prints throughput, TTFT p50/p99, the prefix-cache
hit rate over the burst, and the latency of a one-token request (sequential), whose
difference from `appliance up` is the ingress's added latency. A benchmark, not a test:
figures from a shared box compare only within one run."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import msgspec

from appliance.cluster.routing import ReplicaLoad
from appliance.cluster.settings import ClusterConfig
from appliance.config import load_config
from appliance.config_sources import parse_sets


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))] if v else float("nan")


def chats(n: int, tenants: int, system_words: int) -> list[list[dict[str, str]]]:
    out = []
    for i in range(n):
        t = i % tenants
        system = f"You are assistant {t} of the appliance. " + " ".join(
            f"rule{t}-{k}" for k in range(system_words)
        )
        out.append(
            [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]
        )
    return out


async def _chat(
    client: httpx.AsyncClient, url: str, model: str, messages: Any, max_tokens: int
) -> tuple[float, float, int, int]:
    """(ttft, e2e, output tokens, status) of one streamed chat."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    ttft, tokens = float("nan"), 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return ttft, time.perf_counter() - t0, 0, r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft != ttft and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft, time.perf_counter() - t0, tokens, 200


async def measure(url: str, model: str, ns: argparse.Namespace) -> dict[str, float]:
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        probe = []
        for i in range(ns.probes):  # sequential one-token requests: the path's own latency
            t0 = time.perf_counter()
            await _chat(client, url, model, [{"role": "user", "content": f"p{i}"}], 1)
            probe.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(
                _chat(client, url, model, m, ns.max_tokens)
                for m in chats(ns.requests, ns.tenants, ns.system_words)
            )
        )
        seconds = time.perf_counter() - t0
    ok = [r for r in results if r[3] == 200]
    ttfts = [r[0] for r in ok]
    return {
        "ok": len(ok),
        "req_s": len(ok) / seconds,
        "tok_s": sum(r[2] for r in ok) / seconds,
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p99_s": _pct(ttfts, 99),
        "probe_p50_ms": _pct(probe, 50) * 1000,
    }


def _prefix_up(url: str) -> tuple[int, int]:
    engine = httpx.get(url + "/admin/stats", timeout=10).json()["engine"]
    return engine["prefix_cache_queries"], engine["prefix_cache_hits"]


def _prefix_cluster(url: str) -> tuple[int, int]:
    time.sleep(1.5)  # the replicas' next engine reports
    loads = msgspec.json.decode(
        httpx.get(url + "/cluster/replicas").content, type=list[ReplicaLoad]
    )
    return sum(r.prefix_cache_queries for r in loads), sum(r.prefix_cache_hits for r in loads)


def _hit_rate(before: tuple[int, int], after: tuple[int, int]) -> float:
    queries = after[0] - before[0]
    return (after[1] - before[1]) / queries if queries else float("nan")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_up(ns: argparse.Namespace, model: str) -> dict[str, float]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "appliance.cli",
        "up",
        "--template",
        ns.template,
        "--port",
        str(port),
        "--set",
        f"hardware.engine_threads={ns.cpus}",
    ]
    for item in ns.set:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        before = _prefix_up(url)
        row = asyncio.run(measure(url, model, ns))
        row["prefix_hit_rate"] = _hit_rate(before, _prefix_up(url))
        return row
    finally:
        proc.terminate()
        proc.wait(60)


def run_cluster(
    ns: argparse.Namespace, model: str, replicas: int, routing: str, port: int
) -> dict[str, float]:
    from ray import serve

    from appliance.cluster.app import build_app

    cfg = ClusterConfig(
        template=ns.template,
        overrides={**parse_sets(ns.set), "hardware.engine_threads": max(1, ns.cpus // replicas)},
        replicas=replicas,
        routing="prefix" if routing == "prefix" else "queue",
        cpus_per_replica=ns.cpus / replicas,
        port=port,
    )
    serve.run(build_app(cfg), name=cfg.name, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        loads = msgspec.json.decode(
            httpx.get(url + "/cluster/replicas").content, type=list[ReplicaLoad]
        )
        if len([r for r in loads if r.phase == "ready"]) == replicas:
            break
        time.sleep(0.5)
    before = _prefix_cluster(url)
    row = asyncio.run(measure(url, model, ns))
    row["prefix_hit_rate"] = _hit_rate(before, _prefix_cluster(url))
    serve.delete(cfg.name)
    return row


def main(ns: argparse.Namespace) -> int:
    import ray
    from ray import serve

    config = load_config(ns.template, parse_sets(ns.set))
    from appliance.config import served_model_name

    model = served_model_name(config)
    rows: list[tuple[str, dict[str, float]]] = [("appliance up", run_up(ns, model))]
    ray.init(num_cpus=ns.cpus, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        for replicas, routing in ((1, "queue"), (2, "queue"), (2, "prefix")):
            row = run_cluster(ns, model, replicas, routing, port)
            rows.append((f"cluster {replicas} replica(s), {routing}", row))
    finally:
        serve.shutdown()
        ray.shutdown()
    base = rows[0][1]["probe_p50_ms"]
    flags = _cpu_flags()
    print(
        f"{ns.requests} chats at once ({ns.tenants} system prompts of ~{ns.system_words} "
        f"words), {ns.max_tokens} tokens each; {ns.cpus} cores ({flags}); template {ns.template}"
    )
    print(
        "| setup | ok | req/s | out tok/s | TTFT p50 s | TTFT p99 s | prefix hit rate | "
        "1-token latency p50 ms | added ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['ok']:.0f} | {r['req_s']:.2f} | {r['tok_s']:.1f} | "
            f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['prefix_hit_rate']:.2f} | "
            f"{r['probe_p50_ms']:.1f} | {r['probe_p50_ms'] - base:+.1f} |"
        )
    if ns.json:
        print(json.dumps({name: r for name, r in rows}))
    return 0


def _cpu_flags() -> str:
    try:
        flags = next(
            line.split(":", 1)[1].split()
            for line in open("/proc/cpuinfo")
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return "flags unknown"
    wanted = ["avx2", "avx512f", "avx512_bf16", "amx_tile"]
    return " ".join(f for f in wanted if f in flags) or "no avx2"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "cluster", help="appliance up vs the Ray Serve cluster (1/2 replicas, routing policies)"
    )
    p.add_argument("--template", default="cpu-demo")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--requests", type=int, default=64, help="the burst (default 64)")
    p.add_argument("--tenants", type=int, default=4, help="distinct system prompts (default 4)")
    p.add_argument("--system-words", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--probes", type=int, default=20, help="sequential one-token requests")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)
