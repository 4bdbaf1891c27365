"""`appliance bench serve`: a load generator for any OpenAI-compatible server.

Streams /v1/completions with httpx under burst or Poisson arrivals and reports request and
token throughput, TTFT / TPOT / end-to-end percentiles (overall, per kind of request and per
priority class), goodput under SLOs per kind (appliance/bench/goodput.py), and errors by status,
as a table and as JSON; `--plot` draws each request's TTFT and TPOT over its arrival time.

`--offline` replays the very same requests (same token ids, lengths, classes and arrival times)
through an in-process engine, with no HTTP and no IPC: the reference the served numbers are
compared with.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from appliance.bench.audit import Outcome, ServerAudit, print_audit
from appliance.bench.goodput import SLO, SLOError, SLOs, count, parse_slos, print_goodput
from appliance.bench.serve_table import print_table
from appliance.bench.workload import PROFILES, Item, make_workload
from appliance.config import CLIENT_KEEPALIVE_EXPIRY_S

if TYPE_CHECKING:
    import httpx


@dataclass
class Result:
    index: int
    priority_class: str
    prompt_tokens: int
    output_tokens: int = 0
    status: int | str = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    # Refusals (429, 503): whether they said when to retry, and how long they took to come.
    retry_after: bool = False
    refused_s: float | None = None
    # The profile's kind (short, long, ...) and the scheduled arrival, s after the start.
    kind: str = ""
    arrival_s: float = 0.0
    # Inter-token latencies: the gaps between two streamed chunks after the first (vLLM's
    # benchmark's ITL; a chunk carries more than one token where the stream coalesced them),
    # so a stall inside a request shows, where TPOT averages it away.
    itl_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


# -- HTTP ----------------------------------------------------------------------------------------
async def _one(
    client: httpx.AsyncClient,
    url: str,
    item: Item,
    ns: argparse.Namespace,
    t0: float,
    slots: asyncio.Semaphore | None = None,
) -> Result:
    await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.perf_counter()))
    if slots is None:
        return await _send(client, url, item, ns, t0 + item.arrival_s)
    async with slots:
        # --max-concurrency: the client holds the request back, so its latency counts from
        # when it is sent (as vLLM's benchmark does), not from the scheduled arrival.
        return await _send(client, url, item, ns, max(t0 + item.arrival_s, time.perf_counter()))


async def _send(
    client: httpx.AsyncClient, url: str, item: Item, ns: argparse.Namespace, start: float
) -> Result:
    # Without the priority extra the server picks the class (its default): say so in the rows.
    label = "(default)" if ns.no_priority else item.priority_class
    res = Result(item.index, label, len(item.prompt), kind=item.kind, arrival_s=item.arrival_s)
    body: dict[str, Any] = {
        "model": ns.model,
        "prompt": item.prompt if ns.prompt_format == "tokens" else item.text,
        "max_tokens": item.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": not ns.allow_eos,
    }
    if not ns.no_priority:
        body["priority"] = item.priority_class
    try:
        async with client.stream("POST", url, json=body) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                res.retry_after = "retry-after" in resp.headers
                res.refused_s = time.perf_counter() - start
                return res
            last = 0.0
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.status = f"stream_error:{chunk['error'].get('code')}"
                    return res
                if chunk.get("choices"):
                    now = time.perf_counter() - start
                    if res.ttft_s is None:
                        res.ttft_s = now
                    else:
                        res.itl_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
            res.e2e_s = time.perf_counter() - start
    except Exception as exc:  # connection refused, reset, timeout: an error class of its own
        res.status = type(exc).__name__
    return res


def outcome(r: Result, label: str) -> Outcome:
    return Outcome(label, r.status, r.retry_after, r.ttft_s if r.status == 200 else r.refused_s)


async def run_http(
    items: list[Item], ns: argparse.Namespace
) -> tuple[list[Result], float, dict[str, Any] | None]:
    import httpx

    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limits = httpx.Limits(
        max_connections=ns.max_connections,
        max_keepalive_connections=ns.max_connections,
        keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S,
    )
    url = ns.url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(
        headers=headers, limits=limits, timeout=httpx.Timeout(ns.timeout)
    ) as client:
        if ns.model is None:
            models = (await client.get(ns.url.rstrip("/") + "/v1/models")).json()
            ns.model = models["data"][0]["id"]
        audit = None
        if ns.audit:
            admin = {"Authorization": f"Bearer {ns.admin_token}"} if ns.admin_token else {}
            audit = ServerAudit(ns.url.rstrip("/"), admin)
            await audit.start(client)
        t0 = time.perf_counter()
        slots = asyncio.Semaphore(ns.max_concurrency) if ns.max_concurrency else None
        results = await asyncio.gather(*(_one(client, url, it, ns, t0, slots) for it in items))
        seconds = time.perf_counter() - t0
        report = None
        if audit is not None:
            # Requests sent without `priority` are in the server's default class.
            default = "interactive" if "interactive" in audit.limits else ""
            report = await audit.finish(
                client,
                [
                    outcome(r, it.priority_class if not ns.no_priority else default)
                    for r, it in zip(results, items, strict=True)
                ],
            )
        return list(results), seconds, report


# -- in-process reference ------------------------------------------------------------------------
def run_offline(items: list[Item], ns: argparse.Namespace) -> tuple[list[Result], float, float]:
    """Returns results, wall seconds and process CPU seconds (on a shared box the CPU time per
    token is the figure that does not depend on what else runs)."""
    from appliance.config import load_config
    from appliance.config_sources import parse_override_value
    from appliance.engine.llm_engine import Engine
    from appliance.sampling_params import SamplingParams

    overrides: dict[str, Any] = {}
    if ns.model_dir:
        overrides["model.path"] = ns.model_dir
    for s in ns.set:
        key, _, value = s.partition("=")
        overrides[key] = parse_override_value(value)
    engine = Engine(load_config(ns.template, overrides))
    results = {
        it.index: Result(
            it.index, it.priority_class, len(it.prompt), kind=it.kind, arrival_s=it.arrival_s
        )
        for it in items
    }
    pending = sorted(items, key=lambda it: it.arrival_s)
    arrival: dict[str, float] = {}
    last: dict[str, float] = {}  # each request's latest output, s after its arrival
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0].arrival_s <= now:
            it = pending.pop(0)
            params = SamplingParams(
                max_tokens=it.output_len, temperature=0.0, ignore_eos=not ns.allow_eos
            )
            prio = None if ns.no_priority else it.priority_class
            rid = str(it.index)
            arrival[rid] = t0 + it.arrival_s
            req = engine.add_request(it.prompt, params, request_id=rid, priority=prio)
            if req.is_finished:
                results[it.index].status = 429
        if not engine.has_unfinished():
            if pending:
                time.sleep(max(0.0, pending[0].arrival_s - (time.perf_counter() - t0)))
            continue
        for out in engine.step():
            r = results[int(out.request_id)]
            t = time.perf_counter() - arrival[out.request_id]
            if out.new_token_ids:
                if r.ttft_s is None:
                    r.ttft_s = t
                else:
                    r.itl_s.append(t - last[out.request_id])
                last[out.request_id] = t
            r.output_tokens += len(out.new_token_ids)
            if out.finished:
                r.status = (
                    200 if out.finish_reason in ("stop", "length") else out.finish_reason or "?"
                )
                r.e2e_s = t
    return list(results.values()), time.perf_counter() - t0, time.process_time() - cpu0


# -- report --------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


@dataclass
class Summary:
    requests: int
    ok: int
    seconds: float
    request_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    goodput: float
    # Requests that met every SLO of their kind; per metric bounded, completed requests that
    # met and missed it.
    good: int = 0
    slo_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    tpot_ms: dict[str, float | None] = field(default_factory=dict)
    itl_ms: dict[str, float | None] = field(default_factory=dict)
    e2e_s: dict[str, float | None] = field(default_factory=dict)


def _dist(values: list[float], scale: float) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for q in (50, 90, 99):
        p = pct(values, q)
        out[f"p{q}"] = None if p is None else round(p * scale, 2)
    return out


def summarize(results: list[Result], seconds: float, slo: SLO | SLOs) -> Summary:
    """`seconds`: the whole run's, also for a subset of its results (a kind, a class)."""
    slos = slo if isinstance(slo, SLOs) else SLOs(slo)
    ok = [r for r in results if r.ok]
    good, slo_counts = count(ok, slos)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return Summary(
        requests=len(results),
        ok=len(ok),
        seconds=round(seconds, 3),  # ms: an offline tiny-model run lasts ~10 ms
        request_throughput=round(len(ok) / seconds, 3),
        output_token_throughput=round(out_tokens / seconds, 1),
        total_token_throughput=round((out_tokens + in_tokens) / seconds, 1),
        goodput=round(good / seconds, 3),
        good=good,
        slo_counts=slo_counts,
        ttft_ms=_dist([r.ttft_s for r in ok if r.ttft_s is not None], 1000),
        tpot_ms=_dist([t for r in ok if (t := r.tpot_s) is not None], 1000),
        itl_ms=_dist([gap for r in ok for gap in r.itl_s], 1000),
        e2e_s=_dist([r.e2e_s for r in ok if r.e2e_s is not None], 1),
    )


def _detail(r: Result) -> dict[str, object]:
    """One request's record in the JSON report (times in seconds), its TPOT included."""
    return {**asdict(r), "itl_s": [round(gap, 6) for gap in r.itl_s], "tpot_s": r.tpot_s}


def errors_by_status(results: list[Result]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        if not r.ok:
            out[str(r.status)] = out.get(str(r.status), 0) + 1
    return out


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (or --offline)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="mixed")
    p.add_argument("--arrival", choices=["burst", "poisson"], default="poisson")
    p.add_argument("--rate", type=float, default=2.0, help="requests/s for Poisson arrivals")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument(
        "--prompt-len", type=int, default=0, help="every prompt this long (0: the profile's)"
    )
    p.add_argument(
        "--output-len", type=int, default=0, help="every output this long (0: the profile's)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=8000, help="token ids are drawn from [16, vocab)")
    p.add_argument("--prompt-format", choices=["tokens", "text"], default="tokens")
    per_kind = "MS for every request, or KIND=MS,... per kind of the profile (short, long)"
    p.add_argument("--slo-ttft-ms", metavar="MS|KIND=MS,...", help=f"TTFT SLO: {per_kind}")
    p.add_argument("--slo-tpot-ms", metavar="MS|KIND=MS,...", help=f"TPOT SLO: {per_kind}")
    p.add_argument("--slo-e2e-ms", metavar="MS|KIND=MS,...", help=f"end-to-end SLO: {per_kind}")
    p.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="vLLM's spelling of the SLOs, for every kind: ttft:MS tpot:MS e2el:MS",
    )
    p.add_argument(
        "--plot", metavar="FILE.png", help="draw TTFT and TPOT per request over arrival time"
    )
    p.add_argument("--no-priority", action="store_true", help="do not send the priority extra")
    p.add_argument("--allow-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--max-connections", type=int, default=1024)
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=0,
        help="at most this many requests in flight (1: one at a time; 0: no limit)",
    )
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--offline", action="store_true", help="replay in-process (no server)")
    p.add_argument("--template", default="cpu-demo", help="--offline: engine template")
    p.add_argument("--model-dir", default=None, help="--offline: model directory")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--audit",
        action="store_true",
        help="soak checks: outcomes with Retry-After, late answers, KV blocks and "
        "requests left after the load, RSS (run on the server's box)",
    )
    p.add_argument("--admin-token", default=None, help="--audit: token for /admin/stats")
    p.add_argument("--json", action="store_true", help="print JSON instead of the tables")
    p.add_argument("--json-out", help="also write the JSON report to this file")
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    if ns.max_concurrency < 0:
        print(
            f"--max-concurrency must be >= 0 (0: no limit), got {ns.max_concurrency}",
            file=sys.stderr,
        )
        return 2
    try:
        slos = parse_slos(
            ns.slo_ttft_ms,
            ns.slo_tpot_ms,
            ns.slo_e2e_ms,
            ns.goodput,
            [k.name for k in PROFILES[ns.profile]],
        )
    except SLOError as e:
        print(e, file=sys.stderr)
        return 2
    items = make_workload(
        ns.profile,
        ns.num_requests,
        ns.arrival,
        ns.rate,
        ns.seed,
        ns.vocab,
        ns.prompt_len,
        ns.output_len,
    )
    cpu_s = None
    audit = None
    if ns.offline:
        results, seconds, cpu_s = run_offline(items, ns)
        source = f"offline ({ns.template}, {cpu_s:.1f} CPU s)"
    else:
        results, seconds, audit = asyncio.run(run_http(items, ns))
        source = ns.url
    overall = summarize(results, seconds, slos)
    classes = sorted({r.priority_class for r in results})
    per_class = {
        c: summarize([r for r in results if r.priority_class == c], seconds, slos) for c in classes
    }
    # Per kind where the profile mixes kinds (with one kind the row would repeat "all").
    kinds = [k.name for k in PROFILES[ns.profile]] if len(PROFILES[ns.profile]) > 1 else []
    per_kind = {k: summarize([r for r in results if r.kind == k], seconds, slos) for k in kinds}
    errors = errors_by_status(results)
    report = json.dumps(
        {
            "source": source,
            "profile": ns.profile,
            "arrival": ns.arrival,
            "rate": ns.rate,
            "num_requests": ns.num_requests,
            "seed": ns.seed,
            "slo": asdict(slos.default),
            "slo_per_kind": {k: asdict(s) for k, s in slos.kinds.items()},
            "summary": asdict(overall),
            "per_kind": {k: asdict(s) for k, s in per_kind.items()},
            "per_class": {c: asdict(s) for c, s in per_class.items()},
            "errors": errors,
            "offline_cpu_s": cpu_s,
            "audit": audit,
            "max_concurrency": ns.max_concurrency,
            # Each request's outcome, as vLLM's --save-detailed keeps them: where the tail is.
            "requests": [_detail(r) for r in results],
        }
    )
    model = ns.model or (ns.model_dir and os.path.basename(ns.model_dir.rstrip("/")))
    arrival = "burst" if ns.arrival == "burst" else f"poisson {ns.rate:g} req/s"
    if ns.plot:
        from appliance.bench.serve_plot import plot_results

        plot_results(
            results,
            slos,
            f"bench serve: profile {ns.profile}, {arrival}, "
            + (f"model {model}" if model else f"template {ns.template}"),
            ns.plot,
        )
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            f.write(report + "\n")
    if ns.json:
        print(report)
        return 0
    if ns.max_concurrency and not ns.offline:
        arrival += f", at most {ns.max_concurrency} in flight"
    print_table(
        f"bench serve: {source}, profile {ns.profile}, {ns.num_requests} requests, {arrival}",
        overall,
        per_class,
        errors,
        per_kind,
    )
    if slos.given():
        print_goodput([("all", overall), *per_kind.items(), *per_class.items()], slos)
    if ns.plot:
        print(f"\nplot: {ns.plot}")
    if audit is not None:
        print_audit(audit)
    return 0
