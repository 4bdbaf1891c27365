"""`appliance bench host-phases`: where a served engine step's time goes, by phase, from
py-spy's raw stacks of the engine core process and the API process recorded while a load ran
(docs/benchmarks.md, "Host time per engine step", has the recipe).

A sample is given to the innermost frame that names a phase (a stack in the sampler inside the
runner counts as the sampler); the table divides each phase's sampled seconds by the engine
steps the load ran (from /admin/stats), so the core's phases add up to its wall time per step
and the API's to the same wall time, mostly idle. The API table counts the event loop's thread
only (the tokenizer and executor threads idle in it).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

# (a frame's function name, as py-spy writes it, starts with this; phase), innermost first.
CORE_PHASES = [
    ("FusedCpuDecode.__call__", "forward: fused native decode"),
    ("LlamaForCausalLM.compute_logits", "forward: torch model"),
    ("Module._wrapped_call_impl", "forward: torch model"),
    ("Sampler.__call__", "sampler"),
    ("ModelRunner._prepare", "runner: input tensors"),
    ("ModelRunner._update_block_tables", "runner: input tensors"),
    ("ModelRunner.execute", "runner: other"),
    ("Scheduler.schedule", "scheduler: schedule"),
    ("Scheduler.update_from_output", "scheduler: update"),
    ("Scheduler.observe_step", "step cost model + record"),
    ("Engine._record_step", "step cost model + record"),
    ("DepartureRate", "step cost model + record"),
    ("Engine.step", "engine: outputs"),
    ("_Core._send_started", "ipc: send"),
    ("_send", "ipc: send"),
    ("decode_to_core", "ipc: receive"),
    ("_Core._handle", "ipc: receive"),
    ("Connection._poll", "idle (waiting for work)"),
    ("_ConnectionBase.poll", "idle (waiting for work)"),
    ("_Core.run", "core loop: other"),
]
API_PHASES = [
    ("EpollSelector.select", "idle (waiting for work)"),
    ("IncrementalDetokenizer", "detokenize"),
    ("OutputProcessor.process", "output processor"),
    ("decode_from_core", "ipc: receive"),
    ("EngineClient._read", "ipc: receive"),
    ("Generation._on_output", "metrics + stream queue"),
    ("StreamFormatter", "SSE: format"),
    ("_sse_body", "SSE: format"),
    ("ASGIStreamingResponse", "HTTP: write"),
    ("RequestResponseCycle", "HTTP: write"),
    ("EngineClient._dispatch", "output processor"),
    ("prepare", "request: prepare"),
    ("_run_once", "event loop: other"),
]
# Frames of threads that are not the API's event loop.
WORKER_THREAD = "Thread._bootstrap"


def phase_samples(raw: str, phases: list[tuple[str, str]], main_thread_only: bool) -> Counter[str]:
    """Samples per phase in py-spy's `--format raw` output (one `frame;frame;... count` line
    per distinct stack, outermost frame first)."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        if not line.strip():
            continue
        stack, _, n = line.rpartition(" ")
        names = [frame.split(" (")[0] for frame in stack.split(";")]
        if main_thread_only and WORKER_THREAD in names:
            continue
        phase = "other"
        for name in reversed(names):
            hit = next((p for prefix, p in phases if name.startswith(prefix)), None)
            if hit is not None:
                phase = hit
                break
        counts[phase] += int(n)
    return counts


def ms_per_step(counts: Counter[str], rate_hz: float, steps: int) -> dict[str, float]:
    """Each phase's sampled time divided by the steps, largest first."""
    return {
        phase: n / rate_hz * 1000 / steps
        for phase, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    }


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("host-phases", help="a served step's time by phase, from py-spy raw stacks")
    p.add_argument("--core", type=Path, required=True, help="py-spy raw stacks of the core")
    p.add_argument("--api", type=Path, help="py-spy raw stacks of the API process")
    p.add_argument("--steps", type=int, required=True, help="engine steps run while recording")
    p.add_argument("--rate", type=float, default=200.0, help="py-spy's --rate (samples/s)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    if ns.steps < 1 or ns.rate <= 0:
        raise SystemExit("bench host-phases: --steps must be at least 1 and --rate above 0")
    tables = {
        "core": ms_per_step(
            phase_samples(ns.core.read_text(), CORE_PHASES, False), ns.rate, ns.steps
        )
    }
    if ns.api is not None:
        api = phase_samples(ns.api.read_text(), API_PHASES, True)
        tables["api"] = ms_per_step(api, ns.rate, ns.steps)
    if ns.json:
        print(json.dumps({"steps": ns.steps, **tables}))
        return 0
    for process, table in tables.items():
        print(f"{process} process, {ns.steps} steps: ms per step by phase")
        for phase, ms in table.items():
            print(f"  {phase:32s} {ms:8.2f}")
        print(f"  {'total':32s} {sum(table.values()):8.2f}")
    return 0
