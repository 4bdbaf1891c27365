"""`appliance kv-eval`: how much a quantized KV cache changes the model's predictions, per layer.

The model reads evaluation text by teacher forcing: each window of tokens is prefilled in chunks
through the serving path (the runner's step tensors, the paged cache written by `write_kv` in
the layer's format and read back, dequantized, by paged attention), so the error measured is the
error served. Every window runs once with 16-bit KV (the reference) and once per configuration:
each layer quantized alone, all layers quantized, and the proposed keep-list (the `--budget`
layers whose quantization alone moved the next-token distribution most, kept in 16-bit).

Per configuration: mean KL(p_16bit || p_quantized) of the next-token distributions, top-1
agreement of their argmax, and the change of the text's mean negative log-likelihood.

`--per-head` also quantizes each KV head of each layer alone (the layer's other heads stored
apart in its 16-bit side cache, as serving stores `kv_cache_keep_16bit_heads`), to show whether a
layer's cost sits in one head, and proposes a keep-list of single heads at the layer keep-list's
memory (budget x KV heads heads); `--keep heads` writes that one with `--write-template`.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from appliance.config import ConfigError, load_config
from appliance.config_sources import resolve_template
from appliance.core.scheduler_output import ScheduledRequest
from appliance.engine.executor import load_model
from appliance.engine.kv_pool import KVCachePool
from appliance.engine.kv_quant import (
    apply_kv_specs,
    calibrate_absmax,
    calibration_windows,
    kv_storage,
)
from appliance.engine.loader import LoadedModel
from appliance.engine.model_runner import ModelRunner
from appliance.kernels.kv_formats import PER_TOKEN_KIND
from appliance.kv_layout import LayerKV
from appliance.sampling_params import SamplingParams
from appliance.tools.kv_template import write_keep_list

QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "int8")


@dataclass
class Score:
    """One configuration against the 16-bit reference, over all evaluated positions."""

    name: str
    quantized_layers: list[int]
    kl: float  # mean KL(p_16bit || p_quantized), nats
    top1_agreement: float
    nll_delta: float  # mean NLL of the text, quantized minus 16-bit (nats per token)
    positions: int
    head: int | None = None  # per-head runs: the one KV head quantized (of quantized_layers[0])


@dataclass
class Report:
    model: str
    kv_cache_dtype: str
    num_layers: int
    tokens: int
    windows: int
    chunk: int
    budget: int
    reference_nll: float
    per_layer: list[Score]
    all_quantized: Score
    keep_16bit: list[int]
    with_keep_list: Score
    per_head: list[Score] = field(default_factory=list)  # with --per-head, most sensitive first
    # With --per-head: the keep-list of budget x KV heads heads (the layer keep-list's memory),
    # as whole layers (every head chosen) and "layer:head" entries, and its score.
    head_keep_layers: list[int] = field(default_factory=list)
    head_keep_heads: list[str] = field(default_factory=list)
    # The scales the runs used: those the evaluated template serves this format with
    # (cache.kv_cache_scales resolved: per_token for int8 unless the template says per_head).
    kv_cache_scales: str = "per_head"
    with_head_keep_list: Score | None = None


class _Accumulator:
    def __init__(self, name: str, layers: Iterable[int], head: int | None = None) -> None:
        self.name, self.layers, self.head = name, sorted(layers), head
        self.kl = self.agree = self.nll = 0.0
        self.positions = self.nll_positions = 0

    def add(self, ref: torch.Tensor, quant: torch.Tensor, targets: torch.Tensor) -> None:
        """ref/quant: log-probs [n, vocab] of the same n positions; targets: the next tokens
        of the first len(targets) positions."""
        kl = (ref.exp() * (ref - quant)).sum(-1)
        self.kl += float(kl.sum())
        self.agree += float((ref.argmax(-1) == quant.argmax(-1)).sum())
        self.positions += ref.shape[0]
        rows = torch.arange(targets.numel())
        self.nll += float(ref[rows, targets].sum() - quant[rows, targets].sum())
        self.nll_positions += targets.numel()

    def score(self) -> Score:
        n = max(1, self.positions)
        return Score(
            self.name,
            self.layers,
            self.kl / n,
            self.agree / n,
            self.nll / max(1, self.nll_positions),
            self.positions,
            self.head,
        )


class TeacherForcer:
    """Runs windows of text through a loaded model with a chosen set of quantized layers."""

    def __init__(
        self,
        loaded: LoadedModel,
        kind: str,
        absmax: list[tuple[torch.Tensor, torch.Tensor]],
        chunk: int,
    ) -> None:
        self.loaded, self.kind, self.absmax, self.chunk = loaded, kind, absmax, chunk
        self.model = loaded.model
        self.num_layers = loaded.args.num_layers
        attn = self.model.attention_layers()[0]
        self.heads, self.head_dim = attn.num_kv_heads, attn.head_dim

    def layers(self, quantized: set[int], kept: dict[int, set[int]] | None = None) -> list[LayerKV]:
        """Per layer: quantized or 16-bit, and a quantized layer's KV heads kept apart (a
        layer keeping every head is a 16-bit layer, as kv_layout.layer_layout makes it)."""
        kept = kept or {}
        out = []
        for i in range(self.num_layers):
            heads = tuple(sorted(kept.get(i, ())))
            whole = i not in quantized or len(heads) == self.heads
            out.append(LayerKV("auto") if whole else LayerKV(self.kind, heads))
        return out

    @torch.inference_mode()
    def log_probs(
        self, window: list[int], quantized: set[int], kept: dict[int, set[int]] | None = None
    ) -> torch.Tensor:
        """Next-token log-probs [len(window), vocab] (float32, on the CPU); `kept`: per
        quantized layer, the KV heads stored apart in its 16-bit side cache (as serving stores
        kv_cache_keep_16bit_heads)."""
        layers = self.layers(quantized, kept)
        apply_kv_specs(self.model, layers, self.absmax)
        bs, device = self.loaded.block_size, self.loaded.device
        num_blocks = math.ceil(len(window) / bs)
        # A fresh, zeroed pool per run: nothing of an earlier configuration can leak in.
        pool = KVCachePool(
            self.num_layers,
            num_blocks,
            0,
            bs,
            self.heads,
            self.head_dim,
            kv_storage(layers, self.loaded.dtype),
            device,
        )
        runner = ModelRunner(self.model, pool, bs, device)
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        # Scattered block ids: the block table must be honoured, not assumed contiguous.
        block_ids = list(reversed(range(num_blocks)))
        out = []
        for start in range(0, len(window), self.chunk):
            ids = window[start : start + self.chunk]
            req = ScheduledRequest("kv-eval", ids, start, block_ids, False, greedy, 0)
            # The runner's own step preparation (positions, slot mapping, block tables) and
            # forward; logits of every row instead of only the last one. The runner keeps
            # block tables from what each step changed; this request's table is all of it.
            runner.block_tables[req.request_id] = block_ids
            input_ids, positions, meta, _ = runner._prepare([req])
            hidden = self.model(input_ids, positions, meta, pool.device_caches)
            logits = self.model.compute_logits(hidden)
            out.append(torch.log_softmax(logits.float(), dim=-1).cpu())
        return torch.cat(out)


@dataclass
class Run:
    """One configuration: the quantized layers, and per quantized layer the KV heads kept
    apart in 16-bit; `head` marks a per-head run (that one head of its layer quantized)."""

    name: str
    quantized: set[int]
    kept: dict[int, set[int]] = field(default_factory=dict)
    head: int | None = None


def evaluate(
    forcer: TeacherForcer, windows: list[list[int]], runs: Sequence[Run]
) -> tuple[list[Score], float]:
    """Scores of each run against the 16-bit run, and the 16-bit NLL."""
    accs = [_Accumulator(r.name, r.quantized, r.head) for r in runs]
    ref_nll, ref_n = 0.0, 0
    for window in windows:
        ref = forcer.log_probs(window, set())
        targets = torch.tensor(window[1:])
        ref_nll -= float(ref[torch.arange(len(targets)), targets].sum())
        ref_n += len(targets)
        for acc, run in zip(accs, runs, strict=True):
            acc.add(ref, forcer.log_probs(window, run.quantized, run.kept), targets)
    return [a.score() for a in accs], ref_nll / max(1, ref_n)


def propose_keep_list(per_layer: list[Score], budget: int) -> list[int]:
    """The `budget` layers whose quantization alone costs the most KL (ties: lower index)."""
    ranked = sorted(per_layer, key=lambda s: (-s.kl, s.quantized_layers[0]))
    return sorted(s.quantized_layers[0] for s in ranked[:budget])


def propose_head_keep_list(
    per_head: list[Score], budget_heads: int, heads: int
) -> tuple[list[int], list[str]]:
    """The `budget_heads` KV heads whose quantization alone (stored apart from the rest of
    their layer) costs the most KL, as (whole layers, "layer:head" entries): a layer with
    every head chosen is kept whole (one cache instead of an empty one and a side cache)."""
    ranked = sorted(per_head, key=lambda s: (-s.kl, s.quantized_layers[0], s.head))
    chosen: dict[int, set[int]] = {}
    for s in ranked[:budget_heads]:
        assert s.head is not None
        chosen.setdefault(s.quantized_layers[0], set()).add(s.head)
    whole = sorted(layer for layer, hs in chosen.items() if len(hs) == heads)
    entries = [
        f"{layer}:{h}"
        for layer in sorted(chosen)
        if layer not in whole
        for h in sorted(chosen[layer])
    ]
    return whole, entries


def keep_run(name: str, num_layers: int, whole: Sequence[int], entries: Sequence[str]) -> Run:
    """The run of a keep-list: every layer quantized but `whole`, with `entries` kept apart."""
    kept: dict[int, set[int]] = {}
    for entry in entries:
        layer, head = (int(x) for x in entry.split(":"))
        kept.setdefault(layer, set()).add(head)
    return Run(name, set(range(num_layers)) - set(whole), kept)


def read_windows(tokenizer: Any, files: list[str], max_tokens: int, window: int) -> list[list[int]]:
    text = "\n\n".join(Path(f).read_text("utf-8") for f in files)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    bos = getattr(tokenizer, "bos_token_id", None)
    body = window - (1 if bos is not None else 0)
    ids = ids[:max_tokens]
    windows = []
    for start in range(0, len(ids), body):
        piece = ids[start : start + body]
        if len(piece) >= 2:
            # Each window starts like a prompt does (with bos), so attention sinks form as in
            # serving.
            windows.append(([bos] if bos is not None else []) + piece)
    if not windows:
        raise ConfigError(f"--data: {', '.join(files)} gave fewer than 2 tokens to evaluate")
    return windows


def run_kv_eval(
    template: str,
    data: list[str],
    overrides: dict[str, Any] | None = None,
    kv_cache_dtype: str | None = None,
    budget: int | None = None,
    max_tokens: int = 2048,
    window: int = 256,
    chunk: int = 64,
    per_head: bool = False,
) -> Report:
    config = load_config(template, overrides)
    kind = kv_cache_dtype or (
        config.cache.kv_cache_dtype if config.cache.kv_cache_dtype != "auto" else "fp8_e4m3"
    )
    if kind not in QUANTIZED:
        raise ConfigError(
            f"--kv-cache-dtype: {kind!r} is not a quantized format ({', '.join(QUANTIZED)})"
        )
    # Evaluate what the template will serve: its scale mode for this format.
    scales = msgspec.structs.replace(config.cache, kv_cache_dtype=kind).scales()
    layer_kind = PER_TOKEN_KIND if scales == "per_token" else kind
    serving_max_len = config.model.max_model_len
    # The engine is loaded with 16-bit KV and a pool of one window; the runs below build their
    # own pools. Scales are calibrated as serving calibrates them (same text, same lengths).
    eval_overrides = dict(overrides or {})
    eval_overrides.update(
        {
            "cache.kv_cache_dtype": "auto",
            # (a 16-bit cache has no scales; the runs below set each layer's own)
            "cache.kv_cache_scales": "per_head",
            "cache.kv_cache_keep_16bit": [],
            "cache.kv_cache_keep_16bit_heads": [],
            "cache.swap_space": 0,
            "model.max_model_len": window,
            "cache.num_blocks": math.ceil(window / config.cache.block_size),
            # One process: the forward below runs outside the TP executor.
            "parallel.tensor_parallel_size": 1,
        }
    )
    loaded = load_model(load_config(template, eval_overrides))
    try:
        args = loaded.args
        budget = max(1, args.num_layers // 8) if budget is None else budget
        if not 0 <= budget <= args.num_layers:
            raise ConfigError(f"--budget: {budget} must lie in 0..{args.num_layers} (the layers)")
        calib_len = serving_max_len or args.max_position_embeddings
        absmax = calibrate_absmax(
            loaded.model,
            calibration_windows(loaded.tokenizer, calib_len),
            loaded.block_size,
            loaded.device,
            loaded.dtype,
        )
        windows = read_windows(loaded.tokenizer, data, max_tokens, window)
        forcer = TeacherForcer(loaded, layer_kind, absmax, chunk)
        n = args.num_layers
        runs = [Run(f"layer {i}", {i}) for i in range(n)] + [Run(f"all {kind}", set(range(n)))]
        scores, ref_nll = evaluate(forcer, windows, runs)
        per_layer, all_q = scores[:-1], scores[-1]
        keep = propose_keep_list(per_layer, budget)
        if keep:
            [with_keep], _ = evaluate(forcer, windows, [keep_run(f"keep {keep}", n, keep, [])])
        else:
            with_keep = all_q
        head_scores: list[Score] = []
        head_keep: tuple[list[int], list[str]] = ([], [])
        with_heads = None
        if per_head:
            heads = forcer.heads
            # One head quantized, the layer's other heads in its 16-bit side cache: the head's
            # own effect, stored as serving would store a keep-list of the others.
            head_runs = [
                Run(f"layer {i} head {h}", {i}, {i: set(range(heads)) - {h}}, h)
                for i in range(n)
                for h in range(heads)
            ]
            head_scores, _ = evaluate(forcer, windows, head_runs)
            head_scores.sort(key=lambda s: (-s.kl, s.quantized_layers[0], s.head))
            # At the layer keep-list's memory: budget layers = budget x heads KV heads.
            head_keep = propose_head_keep_list(head_scores, budget * heads, heads)
            if budget:
                name = f"keep {[*head_keep[0], *head_keep[1]]}"
                [with_heads], _ = evaluate(forcer, windows, [keep_run(name, n, *head_keep)])
        return Report(
            model=str(loaded.model_dir),
            kv_cache_dtype=kind,
            num_layers=args.num_layers,
            tokens=sum(len(w) for w in windows),
            windows=len(windows),
            chunk=chunk,
            budget=budget,
            reference_nll=ref_nll,
            per_layer=per_layer,
            all_quantized=all_q,
            keep_16bit=keep,
            with_keep_list=with_keep,
            per_head=head_scores,
            head_keep_layers=head_keep[0],
            head_keep_heads=head_keep[1],
            with_head_keep_list=with_heads,
            kv_cache_scales=scales,
        )
    finally:
        loaded.close()


def format_report(r: Report) -> str:
    lines = [
        f"kv-eval {Path(r.model).name}: {r.kv_cache_dtype} ({r.kv_cache_scales} scales), {r.tokens} tokens in {r.windows} "
        f"windows (teacher forced, prefill chunks of {r.chunk}), 16-bit NLL "
        f"{r.reference_nll:.3f} nats/token",
        f"{'quantized':<24} {'KL(16||q) nats':>15} {'top-1 agree':>12} {'dNLL nats':>10}",
    ]
    lines.append("-" * len(lines[-1]))

    def row(s: Score) -> str:
        return f"{s.name:<24} {s.kl:>15.3e} {100 * s.top1_agreement:>11.2f}% {s.nll_delta:>+10.4f}"

    lines += [row(s) for s in r.per_layer]
    lines.append("-" * len(lines[1]))
    lines.append(row(r.all_quantized))
    lines.append(row(r.with_keep_list))
    gain = r.all_quantized.kl / r.with_keep_list.kl if r.with_keep_list.kl > 0 else math.inf
    lines.append(
        f"proposed kv_cache_keep_16bit = {r.keep_16bit} (budget {r.budget} of {r.num_layers} "
        f"layers): KL {gain:.1f}x lower than all {r.kv_cache_dtype}"
    )
    if r.per_head:
        total = sum(s.kl for s in r.per_head) or 1.0
        lines.append(
            "per KV head (one head quantized, its layer's other heads in a 16-bit side cache), "
            f"the 10 most sensitive of {len(r.per_head)}:"
        )
        lines += [
            f"{row(s)}  ({100 * s.kl / total:.1f}% of the heads' KL)" for s in r.per_head[:10]
        ]
        if r.with_head_keep_list is not None:
            lines.append(row(r.with_head_keep_list))
            gain = (
                r.all_quantized.kl / r.with_head_keep_list.kl
                if r.with_head_keep_list.kl > 0
                else math.inf
            )
            lines.append(
                f"proposed kv_cache_keep_16bit = {r.head_keep_layers}, kv_cache_keep_16bit_heads = "
                f"{r.head_keep_heads} (the layer keep-list's memory): KL {gain:.1f}x lower than "
                f"all {r.kv_cache_dtype}"
            )
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "kv-eval",
        help="measure the effect of a quantized KV cache per layer and propose a keep-list",
    )
    p.add_argument("--template", required=True)
    p.add_argument("--data", nargs="+", required=True, metavar="FILE", help="evaluation text")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--kv-cache-dtype",
        choices=QUANTIZED,
        default=None,
        help="format to evaluate (default: the template's, or fp8_e4m3 if auto)",
    )
    p.add_argument(
        "--budget",
        type=int,
        default=None,
        help="layers the keep-list may hold in 16-bit (default: num_layers // 8, >= 1); the "
        "head keep-list of --per-head takes as many KV heads (budget x KV heads)",
    )
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=256, help="tokens per teacher-forced sequence")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens per step)")
    p.add_argument(
        "--write-template",
        metavar="OUT",
        help="write a copy of the template with the format and the keep-list",
    )
    p.add_argument(
        "--per-head",
        action="store_true",
        help="also quantize each KV head alone (layers x KV heads more runs)",
    )
    p.add_argument(
        "--keep",
        choices=("layers", "heads"),
        default="layers",
        help="the keep-list --write-template writes: whole layers, or (implies --per-head) "
        "single KV heads, as many as the layer budget holds (budget x KV heads)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def main(ns: argparse.Namespace) -> int:
    from appliance.config_sources import parse_sets

    report = run_kv_eval(
        ns.template,
        ns.data,
        parse_sets(ns.set),
        ns.kv_cache_dtype,
        ns.budget,
        ns.max_tokens,
        ns.window,
        ns.chunk,
        ns.per_head or ns.keep == "heads",
    )
    if ns.write_template:
        heads = ns.keep == "heads"
        write_keep_list(
            resolve_template(ns.template),
            Path(ns.write_template),
            report.kv_cache_dtype,
            report.head_keep_layers if heads else report.keep_16bit,
            report.head_keep_heads if heads else [],
        )
    if ns.json:
        print(json.dumps(asdict(report)))
    else:
        print(format_report(report))
        if ns.write_template:
            print(f"wrote {ns.write_template}")
    return 0
