"""`appliance inspect`: the checks an operator runs after a change, as one pass/fail table.

Against a running server (its OpenAI API and /admin/*), with the limits of the template it
runs (GET /admin/config):

- chat: a chat completion answers (200, at least one token), in the default class;
- kv_usage: the most KV the engine used over the last `--history-s` seconds of steps, at or
  below the template's scheduler.preemption_threshold (above it, arrivals preempt work);
- preemption_rate: preemptions per finished request since the engine started, at or below
  `--max-preemption-rate`;
- kv_quantization: with a quantized KV cache, the stored `appliance kv-eval --json` result
  (`--kv-eval FILE`, by default kv-eval.json in the state directory) must be of the served
  format and keep-list, with top-1 agreement at or above `--min-top1`; skipped with a 16-bit
  cache or without a stored result;
- ttft_p99: p99 time to first token of a short probe load (`--probe` streamed requests,
  `--probe-concurrency` at a time), at or below the default class's ttft_slo_s, else
  `--max-ttft-s`.

Exit status 1 when any check fails. The result goes to the audit log (action "inspect"); the
systemd timer (systemd/appliance-inspect@.timer) runs it daily, as actor "systemd".
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from appliance.config import ApplianceConfig, ConfigError, config_from_dict
from appliance.server.audit import AuditLog, state_dir

PROBE_PROMPT = "Name one colour."


@dataclass
class CheckResult:
    name: str
    # pass | fail | skip
    status: str
    measured: str
    limit: str
    detail: str = ""


@dataclass
class InspectOptions:
    url: str
    admin_token: str | None = None
    api_key: str | None = None
    history_s: float = 600.0
    max_preemption_rate: float = 0.05
    kv_eval: Path | None = None
    min_top1: float = 0.90
    probe: int = 8
    probe_concurrency: int = 4
    max_ttft_s: float = 2.0
    timeout_s: float = 60.0


class Inspector:
    def __init__(self, opts: InspectOptions) -> None:
        self.opts = opts
        self.admin = {"Authorization": f"Bearer {opts.admin_token}"} if opts.admin_token else {}
        self.api = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        self.http = httpx.Client(base_url=opts.url, timeout=opts.timeout_s)

    def config(self) -> tuple[ApplianceConfig, str]:
        r = self.http.get("/admin/config", headers=self.admin)
        r.raise_for_status()
        body = r.json()
        return config_from_dict(body["config"], "the server's config"), body.get("template") or ""

    def model(self) -> str:
        r = self.http.get("/v1/models", headers=self.api)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])

    # -- the checks ------------------------------------------------------------------------------
    def chat(self, model: str) -> CheckResult:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROBE_PROMPT}],
            "max_tokens": 8,
            "temperature": 0,
        }
        try:
            r = self.http.post("/v1/chat/completions", json=body, headers=self.api)
        except httpx.HTTPError as exc:
            return CheckResult("chat", "fail", type(exc).__name__, "200, >= 1 token", str(exc))
        tokens = r.json().get("usage", {}).get("completion_tokens", 0) if r.is_success else 0
        ok = r.status_code == 200 and tokens >= 1
        detail = "" if ok else r.text[:200]
        measured = f"{r.status_code}, {tokens} tokens"
        return CheckResult("chat", "pass" if ok else "fail", measured, "200, >= 1 token", detail)

    def engine_checks(self, config: ApplianceConfig) -> list[CheckResult]:
        r = self.http.get(
            "/admin/stats", params={"history_s": self.opts.history_s}, headers=self.admin
        )
        r.raise_for_status()
        stats = r.json()
        engine = stats.get("engine") or {}
        usage = max([h["kv_usage"] for h in stats["history"]] + [engine.get("kv_usage", 0.0)])
        limit = config.scheduler.preemption_threshold
        kv = CheckResult(
            "kv_usage",
            "pass" if usage <= limit else "fail",
            f"{usage:.1%} max over {self.opts.history_s:g}s",
            f"<= {limit:.0%} (scheduler.preemption_threshold)",
        )
        finished = sum(engine.get("requests_finished", {}).values())
        preemptions = engine.get("counters", {}).get("preemptions", 0)
        rate = preemptions / finished if finished else 0.0
        pre = CheckResult(
            "preemption_rate",
            "pass" if rate <= self.opts.max_preemption_rate else "fail",
            f"{rate:.3f} ({preemptions} / {finished} requests)",
            f"<= {self.opts.max_preemption_rate:g} per request",
        )
        return [kv, pre]

    def kv_quantization(self, config: ApplianceConfig, default_dir: Path) -> CheckResult:
        cache = config.cache
        name, limit = "kv_quantization", f"top-1 >= {self.opts.min_top1:.0%}"
        if cache.kv_cache_dtype == "auto":
            return CheckResult(name, "skip", "16-bit KV", limit, "nothing quantized")
        path = self.opts.kv_eval or default_dir / "kv-eval.json"
        if not path.is_file():
            return CheckResult(name, "skip", "no stored kv-eval", limit, f"{path} not found")
        report = json.loads(path.read_text())
        if report.get("kv_cache_dtype") != cache.kv_cache_dtype:
            return CheckResult(
                name,
                "fail",
                f"evaluated {report.get('kv_cache_dtype')}",
                limit,
                f"the server runs {cache.kv_cache_dtype}: run appliance kv-eval again",
            )
        kept = sorted(cache.kv_cache_keep_16bit)
        if not kept:
            score = report["all_quantized"]
        elif sorted(report.get("keep_16bit", [])) == kept:
            score = report["with_keep_list"]
        else:
            return CheckResult(
                name,
                "fail",
                f"evaluated keep-list {report.get('keep_16bit')}",
                limit,
                f"the server keeps {kept} in 16-bit: run appliance kv-eval again",
            )
        top1 = float(score["top1_agreement"])
        status = "pass" if top1 >= self.opts.min_top1 else "fail"
        return CheckResult(name, status, f"top-1 {top1:.1%}, KL {score['kl']:.2e}", limit)

    def ttft(self, config: ApplianceConfig, model: str) -> CheckResult:
        slo = config.ttft_slo_s(config.default_class())
        limit = slo if slo is not None else self.opts.max_ttft_s
        source = "the default class's ttft_slo_s" if slo is not None else "--max-ttft-s"
        times = asyncio.run(self._probe(model))
        failed = sum(1 for t in times if t is None)
        done = sorted(t for t in times if t is not None)
        if failed or not done:
            return CheckResult(
                "ttft_p99", "fail", f"{failed} of {len(times)} probes failed", f"<= {limit:g}s"
            )
        p99 = done[min(len(done) - 1, int(0.99 * len(done)))]
        return CheckResult(
            "ttft_p99",
            "pass" if p99 <= limit else "fail",
            f"{p99:.3f}s over {len(done)} probes",
            f"<= {limit:g}s ({source})",
        )

    async def _probe(self, model: str) -> list[float | None]:
        gate = asyncio.Semaphore(max(1, self.opts.probe_concurrency))
        body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 4, "stream": True}
        async with httpx.AsyncClient(base_url=self.opts.url, timeout=self.opts.timeout_s) as http:

            async def one() -> float | None:
                async with gate:
                    t0 = time.perf_counter()
                    try:
                        async with http.stream(
                            "POST", "/v1/completions", json=body, headers=self.api
                        ) as r:
                            if r.status_code != 200:
                                return None
                            async for line in r.aiter_lines():
                                if line.startswith("data:") and '"text"' in line:
                                    return time.perf_counter() - t0
                    except httpx.HTTPError:
                        return None
                    return None

            return await asyncio.gather(*(one() for _ in range(self.opts.probe)))

    def run(self) -> tuple[list[CheckResult], ApplianceConfig, str]:
        config, template = self.config()
        model = self.model()
        results = [self.chat(model), *self.engine_checks(config)]
        results.append(self.kv_quantization(config, state_dir(config.server.state_dir)))
        results.append(self.ttft(config, model))
        return results, config, template


def format_table(results: list[CheckResult]) -> str:
    rows = [("check", "result", "measured", "limit")]
    rows += [(r.name, r.status.upper(), r.measured, r.limit) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines += [f"  {r.name}: {r.detail}" for r in results if r.detail and r.status == "fail"]
    return "\n".join(line.rstrip() for line in lines)


def default_actor() -> str:
    if os.environ.get("INVOCATION_ID"):  # started by systemd (the timer)
        return "systemd"
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "cli"


def inspect_and_record(
    opts: InspectOptions, actor: str, audit_dir: Path | None = None
) -> tuple[list[CheckResult], bool]:
    """Run every check and append the result to the audit log (the server's state directory
    unless `audit_dir`); returns the results and whether all passed (skips pass)."""
    inspector = Inspector(opts)
    results, config, template = inspector.run()
    log = AuditLog(audit_dir or state_dir(config.server.state_dir), config.server.audit_max_bytes)
    act = log.start(actor, "inspect", {"url": opts.url, "template": template})
    act.what["checks"] = [asdict(r) for r in results]
    failed = [r.name for r in results if r.status == "fail"]
    if failed:
        act.fail("failed", "failed: " + ", ".join(failed))
    log.finish(act)
    return results, not failed


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("inspect", help="check a running server after a change: a pass/fail table")
    d = InspectOptions(url="")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--admin-token", default=os.environ.get("APPLIANCE_ADMIN_TOKEN"))
    p.add_argument("--admin-token-file", default=None, help="read the admin token from a file")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--api-key-file", default=None)
    p.add_argument("--history-s", type=float, default=d.history_s)
    p.add_argument("--max-preemption-rate", type=float, default=d.max_preemption_rate)
    p.add_argument("--kv-eval", type=Path, default=None, help="stored `kv-eval --json` output")
    p.add_argument("--min-top1", type=float, default=d.min_top1)
    p.add_argument("--probe", type=int, default=d.probe, help="probe requests for the TTFT")
    p.add_argument("--probe-concurrency", type=int, default=d.probe_concurrency)
    p.add_argument("--max-ttft-s", type=float, default=d.max_ttft_s)
    p.add_argument("--actor", default=None, help="who runs it, for the audit log")
    p.add_argument("--audit-dir", type=Path, default=None, help="default: the server's state dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def _secret(value: str | None, file: str | None) -> str | None:
    if file:
        lines = [ln.strip() for ln in Path(file).read_text().splitlines()]
        return next((ln for ln in lines if ln and not ln.startswith("#")), None)
    return value


def main(ns: argparse.Namespace) -> int:
    opts = InspectOptions(
        url=ns.url,
        admin_token=_secret(ns.admin_token, ns.admin_token_file),
        api_key=_secret(ns.api_key, ns.api_key_file),
        history_s=ns.history_s,
        max_preemption_rate=ns.max_preemption_rate,
        kv_eval=ns.kv_eval,
        min_top1=ns.min_top1,
        probe=ns.probe,
        probe_concurrency=ns.probe_concurrency,
        max_ttft_s=ns.max_ttft_s,
    )
    try:
        results, ok = inspect_and_record(opts, ns.actor or default_actor(), ns.audit_dir)
    except (httpx.HTTPError, ConfigError, KeyError) as exc:
        print(f"inspect: cannot read the server at {ns.url}: {exc}")
        return 2
    if ns.json:
        print(json.dumps({"ok": ok, "checks": [asdict(r) for r in results]}))
    else:
        print(format_table(results))
    return 0 if ok else 1
