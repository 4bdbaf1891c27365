"""The dashboard panels' contents as Rich text, one function per panel: (snapshot, width, rows).

Where each figure comes from is said next to it; `EngineStats`, `StepRecord`, `QueueInfo` and
`PreemptionEvent` are the /admin/stats schema (appliance/server/admin_schema.py).
"""

from __future__ import annotations

import time

from appliance.console.figures import (
    TPOT,
    TTFT,
    batch_histogram,
    bound_shares,
    preemption_rate,
    recent_mean,
    split_counts,
    tokens_per_second,
)
from appliance.console.state import Snapshot
from appliance.console.widgets import BAD, DIM, OK, WARN, bar, gib, meter, rate, secs, spark
from rich.text import Text

from appliance.server.admin_schema import EngineStats

NO_ENGINE = Text("no engine running", DIM)


def kv_text(snap: Snapshot, width: int) -> Text:
    """EngineStats: blocks_used / blocks_cached / blocks_free, kv_usage, slot_utilisation."""
    e = snap.stats.engine if snap.stats else None
    if e is None:
        return NO_ENGINE
    pct = f" {e.kv_usage * 100:3.0f}% used"
    used = bar(
        [(e.blocks_used, "█", BAD), (e.blocks_cached, "▒", WARN), (e.blocks_free, "·", DIM)],
        max(4, width - len(pct)),
    )
    text = used.append(pct, "bold")
    # The glyphs double as the legend of the bar and of the block map below.
    text.append("\n█", BAD).append(f" used {e.blocks_used} ").append("▒", WARN)
    text.append(f" cached {e.blocks_cached} ").append("·", DIM).append(f" free {e.blocks_free}")
    text.append(f" / {e.num_blocks}" + (f" blocks of {e.block_size} tokens" if width >= 60 else ""))
    slots = f"{e.slot_utilisation * 100:.0f}%" if e.slots_allocated else "–"
    text.append(
        f"\nslots {slots}, peak {e.slot_utilisation_at_peak * 100:.0f}%"
        f" · swap {e.swap_blocks_used}/{e.swap_blocks_total}"
    )
    return text


def vbars(rows: list[tuple[str, int]], height: int, col: int) -> Text:
    """A vertical histogram: one column per bin, 8 levels per line, labels underneath."""
    top = max((n for _, n in rows), default=0)
    text = Text(no_wrap=True, overflow="crop")
    levels = "▁▂▃▄▅▆▇█"
    for line in range(height):
        floor = (height - 1 - line) * 8  # eighths below this line
        for _, n in rows:
            eighths = round(n / top * height * 8) if top else 0
            if n and not eighths:
                eighths = 1
            fill = eighths - floor
            glyph = " " if fill <= 0 else "█" if fill >= 8 else levels[fill - 1]
            text.append(glyph.ljust(col), OK)
        text.append("\n")
    for label, _ in rows:
        text.append(label.split("-")[-1].ljust(col), DIM)
    return text


def batch_text(snap: Snapshot, width: int, rows: int) -> Text:
    """EngineStats: num_running / num_waiting / num_swapped; StepRecord.num_seqs of the last
    minute (the console's merged step history) as a histogram."""
    stats = snap.stats
    e = stats.engine if stats else None
    if e is None:
        return NO_ENGINE
    text = Text.assemble(
        "running ",
        (str(e.num_running), "bold"),
        " · waiting ",
        (str(e.num_waiting), "bold"),
        " · swapped ",
        (str(e.num_swapped), "bold"),
    )
    if e.max_loras:
        text.append(lora_line(e))
    max_seqs = max([r.num_seqs for r in snap.steps] + [1])
    cfg_max = snap.config_max_num_seqs or max_seqs
    hist = batch_histogram(snap.steps, cfg_max)
    # Bins past the largest batch seen stay off screen when space is short.
    last = max((i for i, (_, n) in enumerate(hist) if n), default=0)
    col = max(len(label.split("-")[-1]) for label, _ in hist) + 1
    keep = hist if len(hist) * col <= width else hist[: max(last + 1, width // col)]
    text.append(f"\nseqs per step, {len(snap.steps)} steps in 60 s:\n", DIM)
    text.append(vbars(keep, max(1, rows - 3), col))
    return text


def lora_line(e: EngineStats) -> Text:
    """EngineStats.lora_*: the adapters requests may name, which hold a device slot (*), and
    each one's running / waiting requests."""
    text = Text(f"\nLoRA {len(e.lora_resident)}/{e.max_loras} slots, running/waiting:", DIM)
    if not e.lora_adapters:
        text.append(" no adapters", DIM)
    for name in e.lora_adapters:
        text.append(f" {name}{'*' if name in e.lora_resident else ''}", "bold")
        text.append(f" {e.lora_running.get(name, 0)}/{e.lora_waiting.get(name, 0)}", DIM)
    return text


def preemption_text(snap: Snapshot, width: int, rows: int) -> Text:
    """SchedulerCounters.preemptions_by ("mode/class" -> n); the rate and the log from
    AdminStats.preemptions (the server's bounded log of PreemptionEvent)."""
    stats = snap.stats
    e = stats.engine if stats else None
    if e is None or stats is None:
        return NO_ENGINE
    modes, classes = split_counts(e.counters.preemptions_by)
    n_min, overflow = preemption_rate(stats.preemptions, stats.time)
    text = Text.assemble(
        "total ",
        (str(e.counters.preemptions), "bold"),
        " · last minute ",
        (f"{'≥' if overflow else ''}{n_min}", "bold"),
    )
    text.append("\n" + " · ".join(f"{mode} {modes.get(mode, 0)}" for mode in ("recompute", "swap")))
    # Prefill steps paused between two layers for requests that outranked them (cut-in steps).
    text.append(f" · cut-in {e.counters.cut_in_steps}")
    by_class = " · ".join(f"{c} {n}" for c, n in sorted(classes.items())) or "by class: none yet"
    text.append(f"\n{by_class}", DIM if not classes else "")
    events = list(reversed(stats.preemptions))[: max(0, rows - 3)]
    for ev in events:
        text.append(f"\n{secs(stats.time - ev.time):>5} ", DIM)
        text.append(f"{ev.request_id} {ev.priority_class} {ev.mode}")
        if ev.swap_fallback:
            text.append(" (swap full)", WARN)
    if not events and rows > 3:
        text.append("\nno preemption in the log", DIM)
    return text


def _fmt_latency(v: float | None) -> str:
    return secs(v).rjust(6)


def throughput_text(snap: Snapshot, width: int, rows: int) -> Text:
    """Tokens/s from StepRecord.num_prompt_tokens / num_generation_tokens per second of the last
    minute; TTFT and TPOT p50/p99 over a 30 s window of the /metrics histograms
    vllm:time_to_first_token_seconds and vllm:inter_token_latency_seconds."""
    stats = snap.stats
    if stats is None:
        return NO_ENGINE
    prompt, gen = tokens_per_second(snap.steps, stats.time)
    label_w = 13
    val_w = 7
    w = max(4, width - label_w - val_w)
    text = Text(no_wrap=True, overflow="crop")
    text.append("prompt tok/s ", DIM).append(spark(prompt, w)).append(
        f"{rate(recent_mean(prompt)):>{val_w}}"
    )
    text.append("\ngen    tok/s ", DIM).append(spark(gen, w)).append(
        f"{rate(recent_mean(gen)):>{val_w}}"
    )
    # "TTFT " + 2 x ("p50 " + spark + value(6) + " ")
    half = max(2, (width - 5 - 2 * (4 + 6 + 1)) // 2)
    for name, label in ((TTFT, "TTFT"), (TPOT, "TPOT")):
        lat = snap.latency
        text.append(f"\n{label} ", DIM)
        for q, qn in ((0.5, "p50"), (0.99, "p99")):
            text.append(f"{qn} ", DIM).append(spark(list(lat.series[(name, q)]), half, WARN))
            text.append(f"{_fmt_latency(lat.latest(name, q))} ")
    if snap.metrics_error:
        text.append(f"\n/metrics: {snap.metrics_error}", BAD)
    elif rows > 4:
        text.append("\nlatency: 30 s window of /metrics", DIM)
    return text


BOUND_STYLE = {
    "token_budget": WARN,
    "time_budget": "#c678dd",
    "max_num_seqs": "#61afef",
    "kv_blocks": BAD,
    "none": DIM,
}
BOUND_LABEL = {
    "token_budget": "tokens",
    "time_budget": "time",
    "max_num_seqs": "seqs",
    "kv_blocks": "KV",
    "none": "idle",
}


def slow_text(snap: Snapshot, width: int, rows: int) -> Text:
    """StepRecord.bound_by shares over the last minute; per priority class the queue, its
    oldest wait and the estimated wait of a new arrival (QueueInfo.estimated_wait_s, "–"
    until measured) against queue_timeout_s."""
    stats = snap.stats
    if stats is None or stats.engine is None:
        return NO_ENGINE
    shares = bound_shares(snap.steps)
    text = Text(no_wrap=True, overflow="crop")
    name_w = max([len(q.priority_class) for q in stats.queues] + [5])
    # A bar of the shares when the panel has a line to spare for it (wide terminals).
    with_bar = rows >= 3 + len(stats.queues)
    if not shares:
        text.append("no steps in the last minute (idle)", DIM)
    else:
        if with_bar:
            parts = [(round(shares[b] * 1000), "█", BOUND_STYLE[b]) for b in BOUND_STYLE]
            text.append("bound ", DIM).append(bar(parts, max(4, width - 6))).append("\n")
        text.append("bound: ", DIM)
        for b in ("kv_blocks", "token_budget", "time_budget", "max_num_seqs"):
            text.append(f"{BOUND_LABEL[b]} ", DIM).append(
                f"{shares[b] * 100:.0f}% ", BOUND_STYLE[b]
            )
        text.append(f"idle {shares['none'] * 100:.0f}%", DIM)
    cost = stats.engine.step_cost
    if cost is not None and cost.fitted and rows >= 4 + len(stats.queues):
        # The cost model the time budget asks: a step, a decode row, a prefill token, and
        # what a step with prefill pays once (the torch forward instead of the fused decode).
        text.append("\ncost ", DIM).append(
            f"{cost.step_ms:.1f}ms +{cost.decode_row_ms:.2f}/row +{cost.prefill_token_ms:.3f}/tok"
            f" +{cost.prefill_step_ms:.1f}ms/prefill step"
        )
    spec = stats.engine.spec_decode
    if spec is not None and spec.method and rows >= 5 + len(stats.queues):
        # Speculative decoding: the last step's decision and the drafts' acceptance so far.
        text.append(f"\nspec {spec.method} ", DIM).append(
            f"{spec.drafting_rows}/{spec.decode_rows} rows drafting, "
            f"acc {spec.acceptance_rate * 100:.0f}% len {spec.mean_accepted_length:.2f}"
        )
    text.append(f"\n{'class':<{name_w}} {'wait':>4} {'est':>5} {'oldest':>6}/{'limit':<5}", DIM)
    room = width - (name_w + 1 + 4 + 1 + 5 + 1 + 6 + 1 + 5)
    for q in stats.queues[: max(0, rows - 2 - with_bar)]:
        text.append(f"\n{q.priority_class:<{name_w}} ", DIM)
        est = q.estimated_wait_s
        over = est is not None and q.queue_timeout_s > 0 and est > q.queue_timeout_s
        text.append(f"{q.waiting:>4} ").append(f"{secs(est):>5}", BAD if over else "")
        text.append(f" {secs(q.oldest_wait_s):>6}")
        if q.queue_timeout_s <= 0:
            text.append("/∞", DIM)  # no queue timeout for this class
            continue
        frac = q.oldest_wait_s / q.queue_timeout_s
        text.append(f"/{secs(q.queue_timeout_s):<5}", DIM)
        if room >= 8:
            text.append(" ").append(meter(frac, room - 1, warn=0.5, bad=0.8))
        else:  # 80 columns: the share of the timeout as a number instead of a meter
            style = BAD if frac >= 0.8 else WARN if frac >= 0.5 else OK
            text.append(f"{min(frac, 9.99) * 100:4.0f}%", style)
    return text


def host_text(snap: Snapshot, width: int, rows: int) -> Text:
    """pynvml per GPU on the console's machine; else "no GPU" and psutil's CPU and memory."""
    h = snap.host
    if h is None:
        return Text("reading …", DIM)
    text = Text(no_wrap=True, overflow="crop")
    for g in h.gpus:
        power = f" {g.power_w:.0f}W" if g.power_w is not None else ""
        text.append(f"GPU{g.index} ", "bold").append(f"{g.util_pct:3.0f}% ")
        text.append(f"{gib(g.mem_used)}/{gib(g.mem_total)} {g.temp_c:.0f}°C{power}")
        if width >= 52:
            text.append(f" {g.name}", DIM)
        text.append("\n")
    if not h.gpus:
        text.append("no GPU", "bold").append(" on this machine; host figures\n")
        text.append(f"({h.no_gpu_reason})\n", DIM)
    meter_w = max(4, width - 24)
    text.append(f"host CPU {h.cpu_pct:4.0f}%      ").append(meter(h.cpu_pct / 100, meter_w))
    text.append(f"\nhost mem {gib(h.mem_used):>5}/{gib(h.mem_total):<6}")
    text.append(meter(h.mem_used / h.mem_total if h.mem_total else 0, meter_w))
    if h.gpus:
        text.append(f"\n{h.cpu_count} CPU cores", DIM)
    return text


def engine_text(snap: Snapshot, width: int, rows: int) -> Text:
    """AdminStats model/device/config/server fields and EngineStats cache and token totals."""
    stats = snap.stats
    if stats is None:
        return NO_ENGINE
    s = stats.server
    text = Text(no_wrap=True, overflow="crop")
    text.append(
        f"{stats.model_name} on {stats.device or '?'} ({stats.dtype or '?'}), "
        f"max_model_len {stats.max_model_len}"
    )
    text.append(f"\ntemplate {stats.config.template or 'defaults'}", DIM)
    if stats.config.overrides:
        text.append(f"\noverrides {stats.config.overrides}", DIM)
    ready = (
        f"ready after {secs(s.ready_after_s)}" if s.ready_after_s is not None else "not ready yet"
    )
    text.append(f"\n{ready} · engine #{s.engine_generation}")
    text.append(f"\nrequests in flight {s.requests_in_flight} · served {s.requests_served}")
    e = stats.engine
    if e is not None:
        hit = e.prefix_cache_hits / e.prefix_cache_queries if e.prefix_cache_queries else 0.0
        text.append(
            f"\nprefix cache hits {hit * 100:.0f}% of {e.prefix_cache_queries} tokens"
            f" · step {e.step}"
        )
        text.append(
            f"\ntokens: prompt {e.prompt_tokens_total} · generated {e.generation_tokens_total}"
        )
    if s.last_reload:
        ok = s.last_reload.get("ok")
        when = time.strftime("%H:%M:%S", time.localtime(s.last_reload.get("time", 0)))
        text.append(f"\nlast reload {when}: ", DIM)
        text.append("ok" if ok else f"failed: {s.last_reload.get('error', '')}", OK if ok else BAD)
    return text
